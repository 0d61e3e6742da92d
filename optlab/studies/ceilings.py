"""The machine's ceilings, measured: the best matmul rate per dtype over a sweep of shapes (MAMF, "maximum achievable
matmul FLOPS" as stas00's ml-engineering defines it), the memory bandwidth of a large copy and of a large read, and
the time to launch one small operation (eager; and inside a CUDA-graph replay on a GPU).

Every figure is a rate or a time from ``torch.utils.benchmark`` (synchronized on a GPU), given as the median over
its timed blocks (at least six) with a distribution-free 95 % order-statistic interval of that median
(``core.stats.order.median_interval``).
Work per run: a matmul of ``M x K`` by ``K x N`` is ``2 M N K`` FLOPs; a copy reads and writes its bytes
(``2 x bytes``); a read (a sum) reads them once; a launch is one operation. Sizes follow the device: a CPU's sweep
stays under a minute on two cores, a GPU's reaches the shapes where its tensor cores are busy.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
import torch
from torch.utils import benchmark

from ..core.errors import OptlabError, choice_error
from ..core.gpt.fp8 import ACTIVATION_DTYPE, OUT_DTYPE, column_major, fp8_support
from ..core.knobs.limits import check_count
from ..core.machine.device import resolve_device
from ..core.results import store
from ..core.results.published import published_figures
from ..core.stats.order import median_interval

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": ACTIVATION_DTYPE}
# (M, N, K) per device type: square sides around the sizes a model's layers use, then long thin ones
MATMUL_SHAPES = {
    "cpu": ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (256, 1024, 1024), (1024, 256, 1024)),
    "cuda": ((4096, 4096, 4096), (8192, 8192, 8192), (2048, 2048, 13312), (1024, 15360, 4096),
             (4096, 9216, 14336), (1280, 4096, 12032), (16384, 8192, 1024), (6144, 6144, 6144)),
}
BANDWIDTH_MIB = {"cpu": 256, "cuda": 4096}  # past every cache
MAX_MIB = 16384
MIN_RUN_TIME_S = {"cpu": 0.25, "cuda": 0.2}
MAX_MIN_RUN_TIME_S = 5.0
MIN_BLOCKS = 6  # timed blocks per figure at the least
GRAPH_OPS = 64  # tiny additions captured in the CUDA graph whose replay is timed
NAMES = ("matmul", "copy", "read", "launch")
UNITS = {"matmul": "TFLOP/s", "copy": "GB/s", "read": "GB/s", "launch": "µs"}
RECORD = "ceilings"  # results/live/ceilings.csv
Timer = Callable[[str, dict], Sequence[float]]  # a statement and its globals -> seconds per run, one per timed block


def benchmark_times(stmt: str, globals_: dict, min_run_time: float) -> list[float]:
    """``stmt``'s seconds per run, one figure per timed block of ``torch.utils.benchmark``: at least ``MIN_BLOCKS``
    blocks, however long one run takes, so that every figure has an interval."""
    timer = benchmark.Timer(stmt, globals=globals_, num_threads=torch.get_num_threads())
    times: list[float] = []
    while len(times) < MIN_BLOCKS:
        times += timer.blocked_autorange(min_run_time=min_run_time).times
    return times


def _row(name: str, dtype: str, detail: str, work: float, times: Sequence[float], scale: float) -> dict:
    """A rate row: ``work`` per run over each block's time, in units of ``scale``; for a launch, the time per
    operation in units of ``scale`` seconds."""
    values = [t / work / scale for t in times] if name == "launch" else [work / t / scale for t in times]
    median = float(pd.Series(values).median())
    low, high = median_interval(values)
    return {"ceiling": name, "dtype": dtype, "detail": detail, "value": median, "ci_low": low, "ci_high": high,
            "unit": UNITS[name], "blocks": len(times)}


def matmul_rows(device: torch.device, dtypes: Sequence[str], shapes: Sequence[tuple[int, int, int]],
                timer: Timer) -> list[dict]:
    """Every dtype's rate at every shape: ``2 M N K`` FLOPs per product."""
    rows = []
    for name in dtypes:
        for m, n, k in shapes:
            a = torch.randn(m, k, device=device)
            b = torch.randn(k, n, device=device)
            if name == "fp8":
                one = torch.ones((), device=device)
                stmt = "torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out)"
                globals_ = {"torch": torch, "a": a.to(ACTIVATION_DTYPE), "b": column_major(b.to(ACTIVATION_DTYPE)),
                            "one": one, "out": OUT_DTYPE}
            else:
                stmt, globals_ = "torch.mm(a, b)", {"torch": torch, "a": a.to(DTYPES[name]), "b": b.to(DTYPES[name])}
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"  # fp32 is plain fp32 arithmetic
            try:
                times = timer(stmt, globals_)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
            rows.append(_row("matmul", name, f"{m}x{n}x{k}", 2 * m * n * k, times, 1e12))
    return rows


def bandwidth_rows(device: torch.device, mib: int, timer: Timer) -> list[dict]:
    """A copy of ``mib`` MiB into another tensor (its bytes read and written) and a sum over them (read once)."""
    source = torch.ones(mib * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    nbytes = source.numel() * source.element_size()
    return [_row("copy", "fp32", f"{mib} MiB, read + written", 2 * nbytes,
                 timer("target.copy_(source)", {"target": target, "source": source}), 1e9),
            _row("read", "fp32", f"{mib} MiB, summed", nbytes, timer("source.sum()", {"source": source}), 1e9)]


def launch_rows(device: torch.device, timer: Timer) -> list[dict]:
    """One tiny addition launched from Python (eager), and on a GPU each of ``GRAPH_OPS`` additions in one CUDA-graph
    replay (the replay's time over its operations)."""
    x = torch.ones(1, device=device)
    rows = [_row("launch", "fp32", "eager: one 1-element add", 1, timer("x + 1", {"x": x}), 1e-6)]
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            y = x + 1  # warm-up outside the capture
            with torch.cuda.graph(graph):
                y = x
                for _ in range(GRAPH_OPS):
                    y = y + 1
        torch.cuda.current_stream().wait_stream(stream)
        rows.append(_row("launch", "fp32", f"CUDA graph: one replay of {GRAPH_OPS} adds, per add", GRAPH_OPS,
                         timer("graph.replay()", {"graph": graph}), 1e-6))
    return rows


def available_dtypes(device: torch.device) -> tuple[str, ...]:
    """The dtypes whose matmul this device runs natively: fp32 and bf16 everywhere; fp16 on a GPU, TF32 on one of
    compute capability 8.0 or newer, fp8 on one of 8.9 or newer."""
    if device.type != "cuda":
        return ("fp32", "bf16")
    tf32 = ("tf32",) if torch.cuda.get_device_capability(device) >= (8, 0) else ()
    return ("fp32",) + tf32 + ("bf16", "fp16") + (("fp8",) if fp8_support(device) is None else ())


def measure(device: str = "auto", dtypes: Sequence[str] | None = None, mib: int | None = None,
            min_run_time: float | None = None, timer: Timer | None = None) -> pd.DataFrame:
    """The ceilings of ``device``, one row per figure (matmul per dtype and shape, copy, read, launch) with its
    median, interval and unit; ``mib`` sizes the bandwidth tensors, ``min_run_time`` each timing; ``timer`` replaces
    the benchmark (a test's fake clock)."""
    info = resolve_device(device)
    kind = info.device.type
    allowed = available_dtypes(info.device)
    dtypes = tuple(allowed if dtypes is None else dtypes)
    for name in dtypes:
        if name not in allowed:
            raise choice_error(f"dtype on {info.name}", name, allowed)
    mib = BANDWIDTH_MIB[kind] if mib is None else check_count("bandwidth size (MiB)", mib, 1, MAX_MIB,
                                                              "two tensors of it are allocated")
    run_time = MIN_RUN_TIME_S[kind] if min_run_time is None else min_run_time
    if isinstance(run_time, bool) or not isinstance(run_time, (int, float)) or not 0 < run_time <= MAX_MIN_RUN_TIME_S:
        raise OptlabError(f"min_run_time must be seconds above 0 and at most {MAX_MIN_RUN_TIME_S:g}, "
                          f"got {run_time!r}")
    timer = timer or (lambda stmt, globals_: benchmark_times(stmt, globals_, run_time))
    rows = (matmul_rows(info.device, dtypes, MATMUL_SHAPES[kind], timer) + bandwidth_rows(info.device, mib, timer)
            + launch_rows(info.device, timer))
    return pd.DataFrame(rows).assign(device=info.name)


def best(table: pd.DataFrame) -> pd.DataFrame:
    """One row per figure: each dtype's best matmul (MAMF, with the shape that reached it), copy, read and launch."""
    matmul = table[table["ceiling"] == "matmul"]
    matmul = matmul.loc[matmul.groupby("dtype", sort=False)["value"].idxmax()]
    rest = table[table["ceiling"] != "matmul"]
    return pd.concat([matmul, rest], ignore_index=True)


@dataclass(frozen=True)
class Roofs:
    """What a roofline needs from a ceilings table: peak FLOP/s per dtype, bytes/s, seconds per launch."""

    flops_per_s: dict[str, float]
    bytes_per_s: float
    launch_s: float
    device: str

    @classmethod
    def from_table(cls, table: pd.DataFrame) -> "Roofs":
        rows = best(table)
        matmul = rows[rows["ceiling"] == "matmul"]
        bandwidth = rows.loc[rows["ceiling"].isin(["copy", "read"]), "value"].max() * 1e9
        eager = rows[(rows["ceiling"] == "launch") & rows["detail"].str.startswith("eager")]["value"].iloc[0]
        return cls(dict(zip(matmul["dtype"], matmul["value"] * 1e12)), float(bandwidth), float(eager) * 1e-6,
                   str(rows["device"].iloc[0]))


def save(table: pd.DataFrame, folder: str | Path | None = None) -> Path:
    """Keep ``table`` as ``<folder>/ceilings.csv`` (default: the live results the summary page reads)."""
    return store.save_table(table, store.LIVE_DIR if folder is None else folder, RECORD)


def load(folder: str | Path | None = None) -> pd.DataFrame | None:
    """The ceilings kept in ``folder`` (default: the live results), None when none were measured there."""
    path = Path(store.LIVE_DIR if folder is None else folder) / f"{RECORD}.csv"
    return pd.read_csv(path) if path.exists() else None


def describe(table: pd.DataFrame) -> str:
    """The best figures as lines a person reads: value, interval, unit and what reached it."""
    lines = [f"ceilings of {table['device'].iloc[0]} "
             "(median of timed blocks, 95 % order-statistic interval of the median):"]
    for row in best(table).itertuples():
        what = f"MAMF {row.dtype}" if row.ceiling == "matmul" else row.ceiling
        lines.append(f"  {what:<12} {row.value:10.4g} {row.unit:<8} [{row.ci_low:.4g}, {row.ci_high:.4g}]  "
                     f"({'best shape ' if row.ceiling == 'matmul' else ''}{row.detail})")
    return "\n".join(lines)


def published() -> pd.DataFrame:
    """Others' measured MAMF (A100, H100, H200 from stas00's ml-engineering), each with the datasheet peak, the share
    of it reached, the shape, the torch version and a link to its source (the ``ceilings`` rows of the published
    figures, :func:`optlab.core.results.published.published_figures`)."""
    rows = published_figures("ceilings")
    table = pd.DataFrame({
        "accelerator": rows["hardware"], "dtype": rows["metric"].str.split().str[0], "mamf_tflops": rows["after"],
        "datasheet_tflops": rows["before"], "best_shape": rows["model"].str.removeprefix("matmul, best shape "),
        "torch": rows["software"].str.removeprefix("torch "), "notes": rows["note"], "source": rows["source"],
        "url": rows["url"]})
    return table.assign(**{"% of datasheet": 100 * table["mamf_tflops"] / table["datasheet_tflops"]})


def run_reference(out: str | Path, device: str = "cuda") -> list[Path]:
    """The reference run's part: this GPU's ceilings, kept as ``<out>/ceilings.csv`` beside its records."""
    return [save(measure(device), out)]
