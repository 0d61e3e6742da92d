"""Launching torchrun from Python (notebooks, tests, the parity check): the command line, and a run that ends."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Sequence

from ...core.errors import OptlabError

def torchrun_command(args: Sequence[str], nproc: int) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N ARGS``: one node, a free rendezvous port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def launch(command: Sequence[str], timeout: float, threads: int | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` (a torchrun line) to the end and return its output; raise OptlabError if it fails or overruns.

    ``threads`` sets OMP_NUM_THREADS for every process. On a timeout the whole process group (torchrun and its
    workers) is killed.
    """
    environment = {**os.environ, **(env or {})}
    if threads is not None:
        environment["OMP_NUM_THREADS"] = str(threads)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise OptlabError(f"{' '.join(command[:8])} ... did not finish within {timeout:.0f} s and was stopped") from None
    if process.returncode != 0:
        raise OptlabError(f"{' '.join(command[:8])} ... failed with exit status {process.returncode}: "
                          + "; ".join(_failure_lines(stderr)))
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


FAILURE_LINE = re.compile(r"^(\[rank\d+\]: )?(optlab: error: .*|[\w.]*(Error|Exception)\b: .*)$")


def _failure_lines(stderr: str) -> list[str]:
    """The workers' error messages (not their tracebacks), each once; the last lines of stderr if none is found."""
    lines = stderr.strip().splitlines()
    found = [line for line in lines if FAILURE_LINE.match(line) and "ChildFailedError" not in line]
    return list(dict.fromkeys(found)) or lines[-10:]
