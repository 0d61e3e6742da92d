"""A function run in a fresh Python process with its own empty compile caches, its answer read back as JSON.

Cold means cold: Inductor keeps its FX graphs, AOTAutograd's graphs and its C++ kernels under
``TORCHINDUCTOR_CACHE_DIR``, and Triton its GPU kernels under ``TRITON_CACHE_DIR``; but Inductor's precompiled C++
headers go to ``<temporary folder>/torchinductor_<user>/precompiled_headers`` whatever ``TORCHINDUCTOR_CACHE_DIR``
says (they are meant to outlive a fresh cache), so ``TMPDIR`` is pointed into the folder too. A process also keeps
what it compiled in memory. So every start here is a new process whose cache folders are named by the caller, the
folders' files are counted before (a cold start requires zero) and after, and the remote caches are switched off.
"""
from __future__ import annotations

import importlib
import json
import os
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
    the process's temporary files (Inductor's precompiled headers among them) in ``tmp``."""

    path: Path

    def environment(self) -> dict[str, str]:
        """The variables that point torch.compile's on-disk caches here."""
        return {"TORCHINDUCTOR_CACHE_DIR": str(self.path), "TRITON_CACHE_DIR": str(self.path / "triton"),
                "TMPDIR": str(self.path / "tmp"), **CACHE_SWITCHES}

    def files(self) -> int:
        """How many files the folder holds now (0 if it does not exist)."""
        return sum(1 for item in self.path.rglob("*") if item.is_file()) if self.path.exists() else 0


def run_fresh(function: str, kwargs: dict[str, Any], cache: CacheFolder, cold: bool) -> dict[str, Any]:
    """``function`` ("module:name") called with ``kwargs`` in a new process using ``cache``; its JSON answer, with
    ``cache_files_before``, ``cache_files_after`` and ``process_s`` (the whole process, interpreter start included).

    ``cold`` requires the folder to be empty first: a start that finds files there is refused, not measured."""
    before = cache.files()
    if cold and before:
        raise OptlabError(f"a cold start needs an empty cache folder; {cache.path} holds {before} files")
    (cache.path / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **cache.environment(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
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
