"""A function run in a fresh Python process with its own empty compile caches, its answer read back as JSON.

Cold means cold: Inductor keeps its FX graphs, AOTAutograd's graphs and its C++ kernels under
``TORCHINDUCTOR_CACHE_DIR``, and Triton its GPU kernels under ``TRITON_CACHE_DIR``; but some of its caches live under
``<temporary folder>/torchinductor_<user>`` whatever ``TORCHINDUCTOR_CACHE_DIR`` says (its newer on-disk caches, and
its precompiled C++ headers, which it keeps for the machine on purpose), so ``TMPDIR`` is pointed into the folder
too. A process also keeps what it compiled in memory. So every start here is a new process whose cache folders are
named by the caller, the folders' files are counted before (a cold start requires zero) and after, and the remote
caches are switched off. The one thing a caller may share between starts is the precompiled headers (``headers``):
they depend on the compiler and its flags only, not on any model, so a machine builds them once.
"""
from __future__ import annotations

import getpass
import importlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.errors import OptlabError

ANSWER = "optlab-answer: "  # the worker's last line of output starts with this
CACHE_SWITCHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
                  "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "0",
                  "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "0"}
TIMEOUT_S = 1800


@dataclass(frozen=True)
class CacheFolder:
    """One start's cache folder: Inductor's and AOTAutograd's caches in it, Triton's in its ``triton`` sub-folder,
    the process's temporary files (Inductor's caches kept there among them) in ``tmp``; ``headers``, if given, a
    folder outside it that holds Inductor's precompiled headers for every start that names it."""

    path: Path
    headers: "Path | None" = None

    def environment(self) -> dict[str, str]:
        """The variables that point torch.compile's on-disk caches here."""
        return {"TORCHINDUCTOR_CACHE_DIR": str(self.path), "TRITON_CACHE_DIR": str(self.path / "triton"),
                "TMPDIR": str(self.path / "tmp"), **CACHE_SWITCHES}

    def prepare(self) -> None:
        """Create the folder, and link Inductor's headers folder in it to ``headers`` where one is shared."""
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as Inductor names its folder
        inductor_tmp = self.path / "tmp" / f"torchinductor_{user}"
        inductor_tmp.mkdir(parents=True, exist_ok=True)
        if self.headers is not None:
            self.headers.mkdir(parents=True, exist_ok=True)
            link = inductor_tmp / "precompiled_headers"
            if not link.is_symlink():
                link.symlink_to(self.headers, target_is_directory=True)

    def files(self) -> int:
        """How many files the folder holds now (0 if it does not exist), the shared headers not counted."""
        return sum(len(names) for _, _, names in os.walk(self.path))  # os.walk does not follow the headers' link


def run_fresh(function: str, kwargs: dict[str, Any], cache: CacheFolder, cold: bool,
              settings: "dict[str, str] | None" = None) -> dict[str, Any]:
    """``function`` ("module:name") called with ``kwargs`` in a new process using ``cache``; its JSON answer, with
    ``cache_files_before``, ``cache_files_after`` and ``process_s`` (the whole process, interpreter start included).

    ``cold`` requires the folder to be empty first: a start that finds files there is refused, not measured.
    ``settings``: more environment variables for the process (``TORCHINDUCTOR_COMPILE_THREADS``, say)."""
    before = cache.files()
    if cold and before:
        raise OptlabError(f"a cold start needs an empty cache folder; {cache.path} holds {before} files")
    cache.prepare()
    env = {**os.environ, **(settings or {}), **cache.environment(),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-m", __name__, function, json.dumps(kwargs)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    elapsed = time.perf_counter() - started
    answers = [line for line in done.stdout.splitlines() if line.startswith(ANSWER)]
    if done.returncode or not answers:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise OptlabError(f"the fresh process for {function} failed (exit {done.returncode}): {last}")
    answer = json.loads(answers[-1][len(ANSWER):])
    return {**answer, "cache_files_before": before, "cache_files_after": cache.files(), "process_s": elapsed}


def main(argv: list[str]) -> None:
    """The worker's side: call the named function with the JSON keyword arguments and print its answer."""
    module, name = argv[0].split(":")
    answer = getattr(importlib.import_module(module), name)(**json.loads(argv[1]))
    print(ANSWER + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
