"""Throughput across batch sizes, and request latency: two numbers a server is asked for, measured apart.

**Throughput** (back-to-back): a doubling series 1, 2, 4, ... for each configuration, until memory runs out,
throughput stops rising or the largest batch asked for is reached. The inputs are already on the device and the calls
follow each other with no synchronisation in between, as a busy server's batches do: each batch size is prepared and
called untimed first (a compiled model compiles a new shape on its first call; that time is kept apart as
``first_call_s``), then called up to ``calls`` times (at least :data:`MIN_CALLS`, more while the point's time budget
lasts), and throughput is the batch over the median time per call. Throughput "stops rising" when
:data:`PLATEAU_DOUBLINGS` doublings in a row each fail to beat the best so far by more than :data:`PLATEAU_GAIN`.

**Request latency** (one request at a time, as MLPerf's single-stream scenario and optimum-benchmark time it): at
batch 1 and the batch sizes asked for, each request is the copy of its inputs to the device, the call, the copy of
its outputs back and a synchronisation, timed from the host. :data:`REQUEST_WARMUP` requests are untimed; then at
least :data:`MIN_REQUESTS` requests and at least ``seconds`` are timed (at most :data:`MAX_REQUESTS`), reported as
p50, p90, p99 and the spread (the interquartile range).

Only the configuration under test is on the device: each configuration is loaded, swept and released in turn, so an
out-of-memory point is the model's own. Running out of memory (``torch.OutOfMemoryError`` on a GPU, the CPU
allocator's ``RuntimeError``, also when raised inside graph capture or compilation: :func:`memory.is_out_of_memory`,
through :func:`~optlab.core.run.experiments.failure_status`) ends that configuration's series
at that point; the failed call's tensors are released (the error and its traceback dropped) before the cache is
emptied. With CUDA graphs, what the configuration's own graphs hold in the private pools is counted in the peak memory
(:class:`memory.GraphPoolTally`).
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from ...core.measuring import memory
from ...core.run.experiments import failure_status
from ...core.measuring.loops import Inputs, input_tensors
from ...core.measuring.timing import StepTimer
from ...core.run.progress import finish

PLATEAU_GAIN = 0.10  # a doubling must raise the best throughput so far by more than this to count as a gain
PLATEAU_DOUBLINGS = 2  # this many doublings in a row without a gain: throughput has stopped rising
MIN_CALLS = 5  # timed back-to-back calls per batch size, at least; more until ``calls`` or the point's time budget
REQUEST_WARMUP = 10  # untimed requests before the timed ones (optimum-benchmark, vLLM)
MIN_REQUESTS = 30  # timed requests, at least (vLLM's latency bench)
MAX_REQUESTS = 10_000  # and at most, however fast they are
REQUEST_SECONDS = 2.0  # timed for at least this long, by default (optimum-benchmark: 10 s)
MAX_REQUEST_SECONDS = 600.0
OUT_OF_MEMORY = "out of memory"  # failure_status's word for it
SWEEP_COLUMNS = ["config", "batch", "status", "calls", "call_ms", "samples_per_s", "peak_mem_mb", "graph_pool_mb",
                 "first_call_s"]
LATENCY_COLUMNS = ["config", "batch", "status", "requests", "seconds", "p50_ms", "p90_ms", "p99_ms", "iqr_ms"]


@dataclass
class Served:
    """One configuration loaded on the device: ``forward(inputs)`` runs the model on inputs already there,
    ``to_device(inputs)`` copies host inputs there (in its layout); ``holds`` is what it keeps on the device."""

    forward: Callable[[Inputs], Any]
    to_device: Callable[[Inputs], Inputs]
    holds: tuple = ()
    uses_graphs: bool = False  # replays CUDA graphs: their pool is counted in its memory
    graph_pool: memory.GraphPoolTally | None = None  # what its own graphs hold, over every batch size so far


@dataclass(frozen=True)
class SweepTarget:
    """One configuration in a sweep: ``load()`` puts it on the device (a fresh :class:`Served`), ``make_inputs(n)``
    gives a batch of ``n`` on the host."""

    load: Callable[[], Served]
    make_inputs: Callable[[int], Inputs]


def doubling_series(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch``."""
    sizes, batch = [], 1
    while batch <= max_batch:
        sizes.append(batch)
        batch *= 2
    return sizes


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose calls return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_out(output: Any) -> Any:
    """A model's output copied to the host: a tensor, or the tensors of a dict, tuple or list."""
    if isinstance(output, torch.Tensor):
        return output.to("cpu")
    if isinstance(output, dict):
        return {key: copy_out(value) for key, value in output.items()}
    if isinstance(output, (tuple, list)):
        return [copy_out(value) for value in output]
    return output


def measure(served: Served, inputs: Inputs, device: torch.device, calls: int, warmup: int,
            budget_s: float = float("inf")) -> dict:
    """Throughput at one batch size: untimed first calls, then ``calls`` back-to-back calls on inputs already on the
    device, or fewer (never under :data:`MIN_CALLS`) once they have taken ``budget_s`` seconds; on the CPU one more,
    untimed, under the profiler gives the peak memory (:func:`memory.cpu_step_increase_mb`)."""
    resident = memory.resident_mb(served.holds, device)
    if served.graph_pool is None:
        served.graph_pool = memory.GraphPoolTally(device, served.uses_graphs)
    start_bytes = memory.phase_start(device)
    on_device = served.to_device(inputs)
    with served.graph_pool.run():  # a new batch size records new graphs in its first calls
        started = time.perf_counter()
        served.forward(on_device)
        synchronize(device)
        first_call_s = time.perf_counter() - started
        for _ in range(max(0, warmup - 1)):
            served.forward(on_device)
        timer = StepTimer(device)
        timer.start()
        began, done = time.perf_counter(), 0
        while done < calls and (done < MIN_CALLS or time.perf_counter() - began < budget_s):
            served.forward(on_device)
            timer.mark()
            done += 1
        times, _ = timer.finish()
    median = float(np.median(times))
    pool = served.graph_pool.mb
    increase_mb = (memory.cpu_step_increase_mb(lambda: served.forward(on_device)) if device.type == "cpu"
                   else math.nan)  # one untimed call
    return {"status": "ok", "calls": len(times), "call_ms": 1e3 * median,
            "samples_per_s": len(input_tensors(inputs)[0]) / median,
            "peak_mem_mb": memory.phase_peak_mb(device, start_bytes, resident, increase_mb) + pool, "graph_pool_mb": pool,
            "first_call_s": first_call_s}


def request_latency(served: Served, inputs: Inputs, device: torch.device, seconds: float = REQUEST_SECONDS,
                    min_requests: int = MIN_REQUESTS, warmup: int = REQUEST_WARMUP) -> dict:
    """One request at a time: each one's copy in, call, copy out and synchronisation, timed on the host clock.
    ``warmup`` untimed requests, then at least ``min_requests`` and at least ``seconds`` (at most
    :data:`MAX_REQUESTS`): the count, the seconds they took, p50, p90, p99 and the interquartile range, in ms."""
    def one_request() -> float:
        started = time.perf_counter()
        copy_out(served.forward(served.to_device(inputs)))
        synchronize(device)
        return time.perf_counter() - started

    for _ in range(warmup):
        one_request()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < MAX_REQUESTS and (len(times) < min_requests or time.perf_counter() - began < seconds):
        times.append(one_request())
    p25, p50, p75, p90, p99 = 1e3 * np.percentile(times, [25, 50, 75, 90, 99])
    return {"status": "ok", "requests": len(times), "seconds": time.perf_counter() - began, "p50_ms": p50,
            "p90_ms": p90, "p99_ms": p99, "iqr_ms": p75 - p25}


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _series(label: str, served: Served, target: SweepTarget, device: torch.device, max_batch: int, calls: int,
            warmup: int, budget_s: float, bar: tqdm | None) -> tuple[list[dict], str]:
    """One configuration's throughput at 1, 2, 4, ...: its rows and why the series ended (``bar`` counts the
    points)."""
    rows: list[dict] = []
    best, gained_at, misses = 0.0, 1, 0
    for batch in doubling_series(max_batch):
        if bar is not None:
            bar.update()
        status = None
        try:
            point = measure(served, target.make_inputs(batch), device, calls, warmup, budget_s)
        except Exception as error:  # noqa: BLE001  (recorded: the other configurations go on)
            status = failure_status(error)
        if status is not None:  # out of the except block: the error, its traceback and the call's tensors are gone
            _release(device)
            rows.append({"config": label, "batch": batch, "status": status})
            return rows, (f"out of memory at batch {batch}" if status == OUT_OF_MEMORY else f"batch {batch} {status}")
        rows.append({"config": label, "batch": batch, **point})
        throughput = point["samples_per_s"]
        if throughput > best * (1 + PLATEAU_GAIN):
            gained_at, misses = batch, 0
        else:
            misses += 1
        best = max(best, throughput)
        if misses >= PLATEAU_DOUBLINGS:
            return rows, (f"throughput stopped rising: the {PLATEAU_DOUBLINGS} doublings after batch {gained_at} "
                          f"each gained {round(100 * PLATEAU_GAIN)} % or less")
    return rows, f"reached the largest batch asked for ({max_batch})"


def _latencies(label: str, served: Served, target: SweepTarget, device: torch.device, batches: Sequence[int],
               seconds: float) -> list[dict]:
    rows = []
    for batch in batches:
        status = None
        try:
            rows.append({"config": label, "batch": batch,
                         **request_latency(served, target.make_inputs(batch), device, seconds)})
        except Exception as error:  # noqa: BLE001  (recorded: the other batch sizes go on)
            status = failure_status(error)
        if status is not None:
            _release(device)
            rows.append({"config": label, "batch": batch, "status": status})
    return rows


def sweep(targets: dict[str, SweepTarget], device: torch.device, max_batch: int, calls: int, warmup: int,
          budget_s: float = float("inf"), bar: tqdm | None = None,
          request_batches: Sequence[int] = (), request_seconds: float = REQUEST_SECONDS,
          ) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """Each configuration in turn, alone on the device: its throughput at 1, 2, 4, ... (each point timed by
    :func:`measure`) and its request latency at ``request_batches`` (:func:`request_latency`). One row per
    configuration and batch size, why each series ended, and one row per configuration and request batch size.
    ``bar`` (a total of ``len(doubling_series(max_batch))`` points a configuration) counts the points; a series that
    ends early moves it past the points it left out, saying why."""
    planned = len(doubling_series(max_batch))
    rows: list[dict] = []
    latency: list[dict] = []
    ended: dict[str, str] = {}
    for label, target in targets.items():
        status = None
        try:
            served = target.load()
        except Exception as error:  # noqa: BLE001  (recorded: the other configurations go on)
            status = failure_status(error)
        if status is not None:
            _release(device)
            rows.append({"config": label, "batch": 1, "status": status})
            ended[label] = f"loading it failed: {status}"
            if bar is not None:
                finish(bar, planned, 0, f"{label}: {ended[label]}")
            continue
        series, ended[label] = _series(label, served, target, device, max_batch, calls, warmup, budget_s, bar)
        if bar is not None:
            finish(bar, planned, len(series), f"{label}: {ended[label]}" if len(series) < planned else None)
        rows += series
        latency += _latencies(label, served, target, device, request_batches, request_seconds)
        del served  # released before the next configuration is loaded
        _release(device)
    return (pd.DataFrame(rows, columns=SWEEP_COLUMNS), ended, pd.DataFrame(latency, columns=LATENCY_COLUMNS))
