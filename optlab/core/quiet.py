"""Less jitter in a timed window: a fixed, stated thread count, and no garbage collection while the clock runs.

``benchmarks/noise.py`` measures what each of them does to the round-level noise of an A/A comparison.
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator

import torch

from .limits import check_count, cpu_cores

THREADS_ENV = "OPTLAB_THREADS"


CPU_THREADS = 1  # a CPU run's default: on a busy 2-core machine two threads made rounds 8x slower and 10x noisier


def fix_threads(cuda: bool = False) -> int:
    """Set torch's intra-op thread count for the timed runs that follow and return it (the run's header line states
    it, the record's environment keeps it): ``$OPTLAB_THREADS`` if set (1 to this machine's cores), else
    :data:`CPU_THREADS` for a run on the CPU (threads that wait for cores other work holds spin, and a round's time
    then depends on that work) and torch's own default for a run on a GPU."""
    typed = os.environ.get(THREADS_ENV, "").strip()
    if typed:
        cores = cpu_cores()
        torch.set_num_threads(check_count(THREADS_ENV, int(typed) if typed.isdigit() else typed, 1, cores,
                                          f"one thread per core, {cores} here"))
    elif not cuda:
        torch.set_num_threads(CPU_THREADS)
    return torch.get_num_threads()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage now, then keep the collector off until the block ends (however it ends): a collection inside
    a timed window would charge one variant for every variant's garbage. The collector is left as it was found."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
