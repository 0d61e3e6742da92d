"""Latency and throughput across batch sizes: a doubling series 1, 2, 4, ... for each configuration, until memory
runs out, throughput stops rising or the largest batch asked for is reached.

Each batch size is prepared and called untimed first (a compiled model compiles a new shape on its first call; that
time is kept apart as ``first_call_s``), then called up to ``calls`` times (at least :data:`MIN_CALLS`, more while
the point's time budget lasts), each call timed on its own: the median, p90
and p99 latency per batch come from those calls, and throughput is the batch over the median latency (samples per
second in the steady state: one stray slow call moves p99, not the throughput the series stops on). The
configurations take turns at each batch size, in an order that rotates from one batch size to the next.

Throughput "stops rising" when :data:`PLATEAU_DOUBLINGS` doublings in a row each fail to beat the best throughput so
far by more than :data:`PLATEAU_GAIN`: a smaller gain is within what two timings on a busy machine differ by, and it
would cost twice the latency. Running out of memory (``torch.OutOfMemoryError`` on a GPU, the CPU allocator's
``RuntimeError``) is recorded as the out-of-memory point of that configuration, not raised.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
import torch

from ...core import memory
from ...core.experiments import failure_status, visit_order
from ...core.timing import StepTimer

PLATEAU_GAIN = 0.10  # a doubling must raise the best throughput so far by more than this to count as a gain
PLATEAU_DOUBLINGS = 2  # this many doublings in a row without a gain: throughput has stopped rising
MIN_CALLS = 5  # timed calls per batch size, at least; more until ``calls`` or the point's time budget
OUT_OF_MEMORY = "out of memory"
SWEEP_COLUMNS = ["config", "batch", "status", "calls", "median_ms", "p90_ms", "p99_ms", "samples_per_s",
                 "peak_mem_mb", "first_call_s"]


@dataclass(frozen=True)
class SweepTarget:
    """One configuration in a sweep: ``make_call(batch)`` returns a function that runs one forward on a batch of that
    size (its inputs made once); ``holds`` is what the configuration keeps on the device (its model), for memory."""

    make_call: Callable[[int], Callable[[], object]]
    holds: tuple = ()


def doubling_series(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch``."""
    sizes, batch = [], 1
    while batch <= max_batch:
        sizes.append(batch)
        batch *= 2
    return sizes


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU's ``OutOfMemoryError``, or the CPU allocator's failure (a RuntimeError "can't allocate memory")."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text))


def measure(target: SweepTarget, batch: int, device: torch.device, calls: int, warmup: int,
            budget_s: float = float("inf")) -> dict:
    """One batch size of one configuration: untimed first calls, then ``calls`` timed calls, or fewer (never under
    :data:`MIN_CALLS`) once they have taken ``budget_s`` seconds."""
    resident = memory.resident_mb(target.holds, device)
    start_bytes = memory.phase_start(device)
    call = target.make_call(batch)
    started = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_call_s = time.perf_counter() - started
    for _ in range(max(0, warmup - 1)):
        call()
    timer = StepTimer(device)
    timer.start()
    began, done = time.perf_counter(), 0
    while done < calls and (done < MIN_CALLS or time.perf_counter() - began < budget_s):
        call()
        timer.mark()
        done += 1
    times, _ = timer.finish()
    median, p90, p99 = np.percentile(times, [50, 90, 99])
    return {"batch": batch, "status": "ok", "calls": len(times), "median_ms": 1e3 * median, "p90_ms": 1e3 * p90,
            "p99_ms": 1e3 * p99, "samples_per_s": batch / median,
            "peak_mem_mb": memory.phase_peak_mb(device, start_bytes, resident), "first_call_s": first_call_s}


def sweep(targets: dict[str, SweepTarget], device: torch.device, max_batch: int, calls: int, warmup: int,
          budget_s: float = float("inf"), on_point: Callable[[], None] | None = None) -> tuple[pd.DataFrame, dict]:
    """Every configuration at 1, 2, 4, ... samples a batch, each point timed by :func:`measure`: one row per
    configuration and batch size, and why each configuration's series ended."""
    rows: list[dict] = []
    ended: dict[str, str] = {}
    best: dict[str, float] = {}  # each configuration's highest throughput so far
    gained_at: dict[str, int] = {}  # the batch of its last gain beyond PLATEAU_GAIN
    misses = {label: 0 for label in targets}
    for index, batch in enumerate(doubling_series(max_batch)):
        for label in visit_order([label for label in targets if label not in ended], index):
            if on_point is not None:
                on_point()
            try:
                point = measure(targets[label], batch, device, calls, warmup, budget_s)
            except Exception as error:  # noqa: BLE001  (recorded: the other configurations go on)
                status = OUT_OF_MEMORY if is_out_of_memory(error) else failure_status(error)
                rows.append({"config": label, "batch": batch, "status": status})
                ended[label] = (f"out of memory at batch {batch}" if status == OUT_OF_MEMORY
                                else f"batch {batch} {status}")
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            rows.append({"config": label, **point})
            throughput = point["samples_per_s"]
            if label not in best or throughput > best[label] * (1 + PLATEAU_GAIN):
                gained_at[label], misses[label] = batch, 0
            else:
                misses[label] += 1
            best[label] = max(best.get(label, 0.0), throughput)
            if misses[label] >= PLATEAU_DOUBLINGS:
                ended[label] = (f"throughput stopped rising: the {PLATEAU_DOUBLINGS} doublings after batch "
                                f"{gained_at[label]} each gained {round(100 * PLATEAU_GAIN)} % or less")
        if len(ended) == len(targets):
            break
    for label in targets:
        ended.setdefault(label, f"reached the largest batch asked for ({max_batch})")
    order = {label: index for index, label in enumerate(targets)}
    rows.sort(key=lambda row: (order[row["config"]], row["batch"]))
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS), ended
