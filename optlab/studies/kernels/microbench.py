"""Micro-benchmarks on ``torch.utils.benchmark``: host-to-device copies and square matmuls, as tidy DataFrames.

``Timer`` synchronizes the accelerator around each block of runs, and ``adaptive_autorange`` keeps timing blocks
(at least four) until their spread is under 10 % of the median or the time limit is reached. We report the median
and interquartile range per run, and the rate computed from the median.
Stored GPU results live beside the training references: ``results/reference/<machine>/microbench-<kind>.csv``.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import torch
from torch.utils import benchmark

from ...core.results import store
from ...core.machine.device import TORCH_DTYPES, resolve_device
from ...core.errors import OptlabError, choice_error

KINDS = ("copy", "matmul")
COPY_SOURCES = ("pageable", "pinned", "pinned per copy")  # the last calls pin_memory() before every copy
MIN_RUN_TIME_S = 0.2  # timed before the spread is checked
MAX_RUN_TIME_S = 2.0  # per measurement, whatever the spread
GPU_MATMUL_SIZES = (4095, 4096, 4097)
CPU_MATMUL_SIZES = (511, 512, 513)


def _positive_ints(name: str, values: Iterable[int]) -> tuple[int, ...]:
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise OptlabError(f"{name} must be a non-empty list of positive integers, got {values!r}")
    return values


def _measure(stmt: str, globals_: dict, min_run_time: float) -> benchmark.Measurement:
    """``stmt`` timed in blocks, on as many threads as the training loops use (Timer's own default is one)."""
    timer = benchmark.Timer(stmt=stmt, globals=globals_, num_threads=torch.get_num_threads())
    return timer.adaptive_autorange(threshold=0.1, min_run_time=min_run_time,
                                    max_run_time=max(min_run_time, MAX_RUN_TIME_S))


def _stats(measurement: benchmark.Measurement) -> dict[str, float | int]:
    return {"median_s": measurement.median, "iqr_s": measurement.iqr, "runs": len(measurement.times)}


def copy_benchmark(device: "str | torch.device" = "cuda", sizes_mib: Iterable[int] = (1, 16, 64),
                   min_run_time: float = MIN_RUN_TIME_S) -> pd.DataFrame:
    """Host-to-device copy time and GB/s for every size, source memory and ``non_blocking`` setting.

    Sources: ``pageable`` (an ordinary tensor), ``pinned`` (pinned once, as a DataLoader with ``pin_memory=True``
    hands it over) and ``pinned per copy`` (``pin_memory()`` right before each copy). Needs a CUDA device.
    """
    if str(device).split(":")[0] != "cuda" or not torch.cuda.is_available():
        raise OptlabError(f"copy_benchmark times host-to-device copies and needs a CUDA device; got {str(device)!r} "
                          f"on a machine where CUDA is {'' if torch.cuda.is_available() else 'not '}available. "
                          "Run it on a GPU machine, or read the stored GPU result with stored('copy').")
    info = resolve_device(str(device))
    rows = []
    for size in _positive_ints("sizes_mib", sizes_mib):
        pageable = torch.empty(size * 2**20, dtype=torch.uint8).random_()
        tensors = {"pageable": pageable, "pinned": pageable.pin_memory(), "pinned per copy": pageable}
        for source in COPY_SOURCES:
            pin = ".pin_memory()" if source == "pinned per copy" else ""
            for non_blocking in (False, True):
                stmt = f"x{pin}.to(device, non_blocking={non_blocking})"
                measurement = _measure(stmt, {"x": tensors[source], "device": info.device}, min_run_time)
                stats = _stats(measurement)
                rows.append({"device": info.name, "size_mib": size, "source": source,
                             "non_blocking": non_blocking, **stats, "gb_per_s": size * 2**20 / stats["median_s"] / 1e9})
    return pd.DataFrame(rows)


def matmul_benchmark(device: "str | torch.device" = "cpu", sizes: Iterable[int] = CPU_MATMUL_SIZES,
                     dtype: torch.dtype = torch.float32, min_run_time: float = MIN_RUN_TIME_S) -> pd.DataFrame:
    """Time ``a @ b`` for square ``n x n`` matrices of every size; TFLOP/s is ``2 n^3`` over the median time."""
    info = resolve_device(str(device))
    if not dtype.is_floating_point:
        raise OptlabError(f"matmul_benchmark needs a floating-point dtype, got {dtype}")
    rows = []
    for n in _positive_ints("sizes", sizes):
        a, b = (torch.randn(n, n, device=info.device).to(dtype) for _ in range(2))
        stats = _stats(_measure("a @ b", {"a": a, "b": b}, min_run_time))
        rows.append({"device": info.name, "dtype": str(dtype).removeprefix("torch."), "n": n, "multiple_of_8": n % 8 == 0,
                     **stats, "tflops": 2 * n**3 / stats["median_s"] / 1e12})
    return pd.DataFrame(rows)


def save(frame: pd.DataFrame, folder: "str | Path", kind: str) -> Path:
    """Write a micro-benchmark table as ``folder/microbench-<kind>.csv`` (atomically) and return the path."""
    if kind not in KINDS:
        raise choice_error("micro-benchmark", kind, KINDS)
    path = store.writable_dir(folder) / f"microbench-{kind}.csv"
    store.atomic_write_text(path, frame.to_csv(index=False))
    return path


def stored(kind: str, reference_dir: "str | Path | None" = None) -> pd.DataFrame | None:
    """Every stored ``microbench-<kind>.csv`` under the reference folder (one folder per machine), or None."""
    if kind not in KINDS:
        raise choice_error("micro-benchmark", kind, KINDS)
    root = Path(reference_dir) if reference_dir is not None else store.REFERENCE_DIR
    paths = sorted(root.glob(f"*/microbench-{kind}.csv"))
    return pd.concat([pd.read_csv(p) for p in paths], ignore_index=True) if paths else None


def run_reference(out: "str | Path", device: str = "cuda") -> list[Path]:
    """The GPU reference: copies, and matmuls around 4096 in every 16-bit dtype the device has, saved under ``out``."""
    info = resolve_device(device)
    dtypes = [TORCH_DTYPES[name] for name in info.amp_dtypes if name != "none"]
    matmuls = pd.concat([matmul_benchmark(info.device, GPU_MATMUL_SIZES, dtype) for dtype in dtypes], ignore_index=True)
    return [save(copy_benchmark(info.device), out, "copy"), save(matmuls, out, "matmul")]
