"""This process's place in a torchrun job: joining and leaving the process group, timeouts, gathering to every rank."""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ...core.machine.device import DeviceInfo, resolve_device
from ...core.errors import OptlabError
from ...core.knobs.limits import check_count, cpu_cores

TIMEOUT_ENV = "OPTLAB_DDP_TIMEOUT_S"

DEFAULT_TIMEOUT_S = 600.0  # how long a rank waits in a collective for the others before it raises
STARTUP_TIMEOUT_S = 600.0  # joining the job (imports, rendezvous, the data check) may take minutes on a loaded machine

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Group:
    """This process's place in the job: its ranks, the job's size, the backend and its own device."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    info: DeviceInfo
    collectives: Any = None  # the process group of the timed work, whose collectives give up after timeout_s()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    def describe(self) -> str:
        return (f"distributed: {self.world_size} process(es) on {self.nnodes} node(s), backend {self.backend}, "
                f"{torch.get_num_threads()} thread(s) per process")


def timeout_s() -> float:
    """Seconds a collective waits for the other ranks: ``$OPTLAB_DDP_TIMEOUT_S``, else 600."""
    text = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise OptlabError(f"{TIMEOUT_ENV} must be a number of seconds above 0, got {text!r}")
    return value


def check_world_size(local_world_size: int, cuda: bool) -> None:
    """One process per GPU, or at most one per CPU core: more would only queue for the same device."""
    if cuda:
        check_count("processes per node", local_world_size, 1, torch.cuda.device_count(),
                    "one per GPU on this node")
    else:
        cores = cpu_cores()
        check_count("processes per node", local_world_size, 1, cores, f"one per CPU core, {cores} here")


def rank_device(device: str, local_rank: int) -> DeviceInfo:
    """This rank's device: ``cuda:LOCAL_RANK`` for ``auto`` on a machine with CUDA and for any ``cuda`` or ``cuda:N``
    (made current before any other CUDA call, so no rank opens a context on GPU 0 first), else ``device``."""
    base = device.split(":")[0]
    if base == "cuda" or (base == "auto" and torch.cuda.is_available()):
        return resolve_device(f"cuda:{local_rank}")
    return resolve_device(device)


@contextlib.contextmanager
def process_group(device: str = "auto") -> Iterator[Group]:
    """Join the job torchrun started and leave it on exit: NCCL on CUDA, where each process takes the GPU of its
    LOCAL_RANK (whatever index ``device`` names), gloo on the CPU."""
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise OptlabError(f"a distributed run must be started by torchrun ({', '.join(missing)} not set); launch it as "
                          "torchrun --nproc-per-node N -m optlab run TECHNIQUE --distributed")
    local_rank = int(os.environ["LOCAL_RANK"])
    info = rank_device(device, local_rank)
    check_world_size(int(os.environ["LOCAL_WORLD_SIZE"]), info.is_cuda)
    backend = "nccl" if info.is_cuda else "gloo"
    # Two groups: the default one, for joining the job, waits as long as a slow start may take; the timed work's
    # collectives (DDP's all-reduce, the per-phase barrier and gathers) give up after OPTLAB_DDP_TIMEOUT_S.
    dist.init_process_group(backend, timeout=timedelta(seconds=max(STARTUP_TIMEOUT_S, timeout_s())),
                            device_id=info.device if info.is_cuda else None)
    try:
        collectives = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s()))
        yield Group(dist.get_rank(), local_rank, dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"]),
                    backend, info, collectives)
    finally:
        dist.destroy_process_group()


TIMEOUT_WORDS = re.compile(r"timed out|timeout", re.IGNORECASE)


@contextlib.contextmanager
def explain_timeouts(group: Group) -> Iterator[None]:
    """Turn a collective's timeout into an error that names the setting and the likely cause."""
    try:
        yield
    except RuntimeError as error:  # gloo raises a RuntimeError (DistBackendError); NCCL's watchdog ends the process
        if not TIMEOUT_WORDS.search(str(error)):
            raise
        raise OptlabError(f"rank {group.rank} waited {timeout_s():g} s ({TIMEOUT_ENV}) for the other ranks in a "
                          f"collective and gave up: another rank died or hangs, and its own messages say why "
                          f"({str(error).splitlines()[0]})") from error


def gather(value: Any, group: Group, at_start: bool = False) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank. ``at_start``: while the job is still starting, with the
    start-up's patience rather than the timed work's timeout."""
    values: list[Any] = [None] * group.world_size
    dist.all_gather_object(values, value, group=None if at_start else group.collectives)
    return values


def barrier(group: Group) -> None:
    """Wait for every rank, with the timed work's timeout."""
    dist.barrier(group=group.collectives)
