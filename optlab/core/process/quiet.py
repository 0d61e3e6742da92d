"""Less jitter in a timed window: a fixed, stated thread count.

``benchmarks/noise.py`` measures what it does to the round-level noise of an A/A comparison, beside other candidates
(garbage collection kept out of the timed window, a discarded first round) that did not lower it.
"""
from __future__ import annotations

import os

import torch

from ..knobs.limits import check_count, cpu_cores

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
