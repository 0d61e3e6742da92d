"""What this machine and the data set can hold: every size or count a user can type is checked here, before any
work starts, and refused with the limit in the message."""
from __future__ import annotations

import os
from typing import Any, Iterable

from .config import RunConfig
from ..errors import OptlabError
from ..workload import Workload, get_workload

WORKERS_PER_CORE = 4  # DataLoader workers beyond this only queue for the same cores
MAX_REPEATS = 100  # a paired t interval hardly narrows past this; more is a typo, not a plan
MAX_TIME_BUDGET_S = 86_400  # seconds one model's comparison may take: a day
MAX_STEPS = 100_000  # timed steps per repeat (CIFAR-10's train set holds 50,000 images: batch 1 needs 50,000)


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def max_workers() -> int:
    """The most DataLoader workers a user may ask for here: :data:`WORKERS_PER_CORE` per core (8 on 2 cores)."""
    return WORKERS_PER_CORE * cpu_cores()


def check_count(name: str, value: Any, minimum: int, maximum: int, why: str) -> int:
    """``value`` as an int within [minimum, maximum], or an error naming the bound and ``why`` it is there."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptlabError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise OptlabError(f"{name} must be at least {minimum}, got {value}")
    if value > maximum:
        raise OptlabError(f"{name} {value} is more than this run can use: at most {maximum} ({why})")
    return value


def check_overrides(overrides: dict[str, Any], workload: Workload | None = None) -> None:
    """The knobs a user typed for every variant: workers bounded by the cores, batch size by ``workload``'s test set
    (CIFAR-10's when none is given)."""
    if "num_workers" in overrides:
        cores = cpu_cores()
        check_count("num_workers", overrides["num_workers"], 0, max_workers(),
                    f"{WORKERS_PER_CORE} per CPU core, {cores} core{'s' if cores != 1 else ''} here")
    if "batch_size" in overrides:
        workload = workload or get_workload("cifar")
        check_count("batch_size", overrides["batch_size"], 1, workload.test_size,
                    f"the test set holds {workload.test_size:,} {workload.sample_name}")


def check_phase_sizes(configs: Iterable[RunConfig], phases: Iterable[str], warmup: int, steps: dict[str, int | None],
                      sizes: dict[str, int], sample_name: str = "images") -> None:
    """Every phase must get ``warmup`` + ``steps`` whole batches from its data set of ``sizes[phase]`` samples (timed
    loops drop the last, partial batch); a whole-epoch phase needs one warm-up batch and one timed batch more."""
    for config in configs:
        for phase in phases:
            first, timed = config.train_window(warmup, steps[phase]) if phase == "train" else (warmup, steps[phase])
            needed = first + (timed if timed is not None else 1)
            most = sizes[phase] // needed
            if config.samples_per_step > most:
                raise OptlabError(
                    f"batch of {config.samples_per_step} {sample_name} is too large for the {phase} phase: its data set "
                    f"holds {sizes[phase]:,} {sample_name} and the run needs {needed} batches of it, so at most {most} "
                    f"{sample_name} a batch")
