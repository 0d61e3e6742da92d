"""A function run in a fresh Python process with its own empty compile caches, its answer read back as JSON.

Cold means cold: Inductor keeps its FX graphs, AOTAutograd's graphs and its C++ kernels under
``TORCHINDUCTOR_CACHE_DIR``, and Triton its GPU kernels under ``TRITON_CACHE_DIR``; but some of its caches live under
``<temporary folder>/torchinductor_<user>`` whatever ``TORCHINDUCTOR_CACHE_DIR`` says (its newer on-disk caches, and
its precompiled C++ headers, which it keeps for the machine on purpose), so ``TMPDIR`` is pointed into the folder
too. A process also keeps what it compiled in memory. So every start here is a new process whose cache folders are
named by the caller, the folders' files are counted before (a cold start requires zero) and after, and the remote
caches are switched off. The one thing a caller may share between starts is the precompiled headers (``headers``):
they depend on the compiler and its flags only, not on any model, so a machine builds them once.

Where many starts run on a small CPU, a :class:`ForkServer` saves each one the interpreter's and torch's start (seconds
a process there): one parent imports what every start imports before its timer starts, and nothing else, then forks a
child per start. The child is a new process, with nothing compiled in memory; its caches are named by its own
variables, read after the fork (Inductor reads its folders when it is first used, and the parent never uses it).
Given a folder of its own for it, the parent also runs Inductor's probe of the CPU's vector instructions once
(:func:`probe_machine`: seconds of C++ builds a process on a small CPU, which depend on the machine, not on any model),
so that no child pays it; it then imports Inductor's cache module, which fixes the precompiled headers' folder: the
parent's is the shared one, as every child's is.
"""
from __future__ import annotations

import contextlib
import getpass
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ...core.errors import OptlabError

ANSWER = "optlab-answer: "  # the worker's last line of output starts with this
CACHE_SWITCHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
                  "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "0",
                  "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "0"}
TIMEOUT_S = 1800


class StartsStopped(OptlabError):
    """A start was ended, or refused, because its study's :class:`Stop` came: its deadline, a signal, or an error."""


class Stop:
    """The end of a study's fresh starts: at ``deadline`` (a ``time.monotonic()`` time; None: none) or when
    ``stop()`` is called, every process group registered with it is killed and every start asked for after is
    refused, so that a deadline or a signal ends the study at once, not after the starts already queued."""

    def __init__(self, deadline: "float | None" = None) -> None:
        self.deadline, self.why = deadline, ""
        self._lock, self._groups = threading.Lock(), set()

    def remaining(self) -> "float | None":
        """Seconds to the deadline (0 when past it or stopped; None without a deadline)."""
        if self.why:
            return 0.0
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def check(self) -> None:
        """Raise :class:`StartsStopped` if the study is stopped or past its deadline."""
        if not self.why and self.remaining() == 0.0:
            self.stop("its deadline")
        if self.why:
            raise StartsStopped(f"the starts were stopped: {self.why}")

    def register(self, group: int) -> None:
        """A process group to kill at the stop (one already stopped is killed at once)."""
        with self._lock:
            self._groups.add(group)
        if self.why:
            self.stop(self.why)

    def unregister(self, group: int) -> None:
        with self._lock:
            self._groups.discard(group)

    def stop(self, why: str) -> None:
        """Stop the study: kill every registered process group now."""
        self.why = self.why or why
        with self._lock:
            groups = list(self._groups)
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)


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


@contextlib.contextmanager
def redirected(cache: CacheFolder) -> Iterator[None]:
    """Inside the block, this process's compile caches point at ``cache``, as a fresh process's would: its variables
    set (Inductor's, Triton's and the temporary folder), the temporary folder read again, and Inductor's in-memory
    caches cleared on the way in and out; the variables as they were after. For a start that must stay in this
    process (a model only the caller can build); a start that needs nothing compiled in memory runs in a fork."""
    from torch._inductor.utils import clear_caches

    cache.prepare()
    saved = {name: os.environ.get(name) for name in cache.environment()}
    os.environ.update(cache.environment())
    tempfile.tempdir = None  # read TMPDIR again
    clear_caches()
    try:
        yield
    finally:
        clear_caches()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = None


IMPORT_FIXED = ("torch._inductor.codecache",)  # modules that fix a cache folder when imported: a fork server must not
# (unless it probes the machine in a folder whose headers are the children's: then the folder it fixes is theirs)


def _import_path() -> str:
    """This process's import path, for a child Python that must import the same optlab and the same tests."""
    return os.pathsep.join(path for path in sys.path if path)


def forks_possible() -> bool:
    """Whether starts may be forked here: Linux (fork is safe there), and no GPU (CUDA does not survive a fork)."""
    import torch

    return sys.platform == "linux" and not torch.cuda.is_available()


def probe_machine() -> float:
    """Run Inductor's probe of the vector instructions the CPU and its compiler support (it builds and loads a small C++
    library for each one it knows, in the cache folder); the seconds it took. Inductor runs it once a process, the
    first time it compiles for a CPU, and keeps the answer in memory: a process forked after it does not run it."""
    from torch._inductor import cpu_vec_isa

    started = time.perf_counter()
    cpu_vec_isa.pick_vec_isa()
    return time.perf_counter() - started


class ForkServer:
    """A parent process that imports ``module`` (what every start of it imports before its timer starts) and nothing
    else, then forks one child per :meth:`run`: a new process, with nothing compiled in memory, that skips the
    interpreter's start. ``settings`` are the variables every child shares, set in the parent before its imports
    (Inductor reads its switches when it is imported); each child's own cache folders are set after the fork.
    ``machine``: a folder of the parent's own, whose ``headers`` are the children's, where it runs
    :func:`probe_machine` before its first fork (:attr:`probe_s`); no child may write there
    (:meth:`machine_untouched`). One start at a time; close it (or use it as a context manager) to end the parent.
    The parent and its children are a process group of their own, which ``stop`` (a :class:`Stop`) kills when it
    comes."""

    def __init__(self, module: str, settings: "dict[str, str] | None" = None,
                 machine: "CacheFolder | None" = None, stop: "Stop | None" = None) -> None:
        if machine is not None and machine.headers is None:
            raise OptlabError(f"the fork server's machine folder {machine.path} names no shared headers folder: the "
                              "parent's imports would fix its own as every child's")
        self.folder = Path(tempfile.mkdtemp(prefix="optlab-forks-"))  # the children's output, outside their caches
        self.runs, self.machine, self._ready = 0, machine, None
        env = {**os.environ, **(settings or {}), **CACHE_SWITCHES, "PYTHONPATH": _import_path()}
        if machine is not None:
            machine.prepare()
            env.update(machine.environment())
        config = {"module": module, "headers": str(machine.headers) if machine else None}
        self.errors = self.folder / "server.err"  # a file, not a pipe: nothing the parent writes can fill it and stall
        with self.errors.open("w") as errors:
            self.process = subprocess.Popen([sys.executable, "-m", __name__, "--serve", json.dumps(config)], env=env,
                                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                                            start_new_session=True)
        self.stop = stop
        if stop is not None:
            stop.register(self.process.pid)

    def _reply(self, waiting_for: str) -> dict[str, Any]:
        reply = self.process.stdout.readline()
        if not reply and self.stop is not None:
            self.stop.check()  # a stop killed the parent: say so, not that it ended
        if not reply:
            why = (self.errors.read_text().strip().splitlines() or ["no message"])[-1]
            raise OptlabError(f"the fork server for {waiting_for} ended (exit {self.process.wait()}): {why}")
        return json.loads(reply)

    def ready(self) -> dict[str, Any]:
        """Wait for the parent's imports (and probe): its first answer, with ``probe_s`` (None where it probed
        nothing) and ``machine_files`` (the files its machine folder held then)."""
        if self._ready is None:
            self._ready = self._reply("its imports")
        return self._ready

    @property
    def probe_s(self) -> "float | None":
        """The seconds the parent's :func:`probe_machine` took (None without a machine folder)."""
        return self.ready()["probe_s"]

    def machine_untouched(self) -> bool:
        """Whether the machine folder holds the files it held after the probe: no child wrote there."""
        return self.machine is None or self.machine.files() == self.ready()["machine_files"]

    def run(self, function: str, kwargs: dict[str, Any], environment: dict[str, str]) -> tuple[int, str, str]:
        """``function`` with ``kwargs`` in a forked child whose environment is ``environment``: its exit status, its
        output and its error output."""
        self.ready()
        self.runs += 1
        out, err = self.folder / f"{self.runs}.out", self.folder / f"{self.runs}.err"
        request = {"function": function, "kwargs": kwargs, "environment": environment, "stdout": str(out),
                   "stderr": str(err)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return (self._reply(function)["returncode"], out.read_text() if out.exists() else "",
                err.read_text() if err.exists() else "")

    def close(self) -> None:
        """End the parent and remove the children's output."""
        with contextlib.suppress(BrokenPipeError):  # a parent that has ended already
            self.process.stdin.close()
        self.process.wait(timeout=TIMEOUT_S)
        self.process.stdout.close()
        if self.stop is not None:
            self.stop.unregister(self.process.pid)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_fresh(function: str, kwargs: dict[str, Any], cache: CacheFolder, cold: bool,
              settings: "dict[str, str] | None" = None, forks: "ForkServer | None" = None,
              stop: "Stop | None" = None) -> dict[str, Any]:
    """``function`` ("module:name") called with ``kwargs`` in a new process using ``cache``; its JSON answer, with
    ``cache_files_before``, ``cache_files_after`` and ``process_s`` (the whole process: the interpreter's start
    included, or the fork where ``forks`` starts it).

    ``cold`` requires the folder to be empty first: a start that finds files there is refused, not measured.
    ``settings``: more environment variables for the process (``TORCHINDUCTOR_COMPILE_THREADS``, say; a fork
    server's own must be the same). ``stop``: where it comes first, the process is killed (its group: a process
    of its own, with its children) and :class:`StartsStopped` raised."""
    if stop is not None:
        stop.check()
    before = cache.files()
    if cold and before:
        raise OptlabError(f"a cold start needs an empty cache folder; {cache.path} holds {before} files")
    cache.prepare()
    env = {**os.environ, **(settings or {}), **cache.environment(), "PYTHONPATH": _import_path()}
    started = time.perf_counter()
    if forks is None:
        returncode, stdout, stderr = _run_process([sys.executable, "-m", __name__, function, json.dumps(kwargs)], env,
                                                  stop or Stop())
    else:
        returncode, stdout, stderr = forks.run(function, kwargs, env)
    elapsed = time.perf_counter() - started
    answers = [line for line in stdout.splitlines() if line.startswith(ANSWER)]
    if returncode or not answers:
        last = (stderr.strip().splitlines() or ["no message"])[-1]
        raise OptlabError(f"the fresh process for {function} failed (exit {returncode}): {last}")
    answer = json.loads(answers[-1][len(ANSWER):])
    return {**answer, "cache_files_before": before, "cache_files_after": cache.files(), "process_s": elapsed}


def _run_process(command: list[str], env: dict[str, str], stop: Stop) -> tuple[int, str, str]:
    """``command`` in a process group of its own, killed by ``stop`` (or at its deadline, or after
    :data:`TIMEOUT_S`): its exit status, output and error output."""
    with subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True) as process:
        stop.register(process.pid)
        try:
            remaining = stop.remaining()
            stdout, stderr = process.communicate(timeout=TIMEOUT_S if remaining is None else min(remaining, TIMEOUT_S))
        except BaseException:  # the deadline, or a signal in this thread: the process goes with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            stop.check()
            raise
        finally:
            stop.unregister(process.pid)
    stop.check()  # killed by the stop: say so, not that it failed
    return process.returncode, stdout, stderr


def main(argv: list[str]) -> None:
    """The worker's side: call the named function with the JSON keyword arguments and print its answer."""
    module, name = argv[0].split(":")
    answer = getattr(importlib.import_module(module), name)(**json.loads(argv[1]))
    print(ANSWER + json.dumps(answer), flush=True)


def serve(config: dict[str, Any]) -> None:
    """The fork server's side: import ``config["module"]``, probe the machine where ``config["headers"]`` names the
    children's headers folder, answer that it is ready, then fork a child for each request read from standard input
    and answer each with the child's exit status."""
    importlib.import_module(config["module"])
    probe_s, machine_files = None, 0
    if config["headers"] is not None:
        probe_s = probe_machine()
        from torch._inductor import codecache

        if Path(codecache._HEADER_DIR).resolve() != Path(config["headers"]).resolve():
            raise OptlabError(f"Inductor's precompiled headers would go to {codecache._HEADER_DIR}, not to the "
                              f"children's {config['headers']}")
        machine_files = CacheFolder(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])).files()
    else:
        fixed = [name for name in IMPORT_FIXED if name in sys.modules]
        if fixed:
            raise OptlabError(f"importing {config['module']} imports {', '.join(fixed)}, which fixes its cache folders "
                              "when imported: forked starts would share them; start each in a process of its own")
    print(json.dumps({"probe_s": probe_s, "machine_files": machine_files}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        child = os.fork()
        if child == 0:
            _forked(request)
        _, status = os.waitpid(child, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def _forked(request: dict[str, Any]) -> None:
    """A forked child: its own output files and environment (its temporary folder read again), the call, the exit."""
    code = 1
    try:
        for stream, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), stream)
        sys.stdin = open(os.devnull)  # the parent's requests are the parent's
        os.environ.clear()
        os.environ.update(request["environment"])
        tempfile.tempdir = None  # read TMPDIR again, as a new process would
        main([request["function"], json.dumps(request["kwargs"])])
        code = 0
    except BaseException:  # noqa: BLE001  (whatever the call raised goes to its error output)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(json.loads(sys.argv[2]))
    else:
        main(sys.argv[1:])
