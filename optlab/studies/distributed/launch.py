"""Launching torchrun from Python (notebooks, tests, the parity check): the command line, a run that ends, and a job
of one process that needs no launcher."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from typing import Iterator, Sequence

import torch

from ...core.errors import OptlabError
from ...core.process.children import child_environment

def torchrun_command(args: Sequence[str], nproc: int) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N ARGS``: one node, a free rendezvous port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def launch(command: Sequence[str], timeout: float, threads: int | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` (a torchrun line) to the end and return its output; raise OptlabError if it fails or overruns.

    ``threads`` sets OMP_NUM_THREADS for every process. On a timeout the whole process group (torchrun and its
    workers) is killed.
    """
    environment = child_environment(env)  # an absolute import path: the workers run from any folder
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


@contextlib.contextmanager
def job_of_one(threads: int | None = None) -> Iterator[None]:
    """This process as the only rank of a job on this host: the variables ``torchrun --nproc-per-node 1`` gives its
    rank (rendezvous on a free local port), and ``threads`` torch threads; both are restored on exit. A world of one
    needs no launcher, so a notebook runs it in its own kernel instead of starting Python and importing everything
    again."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    values = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port)}
    before = {name: os.environ.get(name) for name in values}
    threads_before = torch.get_num_threads()
    os.environ.update(values)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)
        for name, value in before.items():
            os.environ.pop(name) if value is None else os.environ.update({name: value})
