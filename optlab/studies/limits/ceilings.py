"""The machine's ceilings, measured: the best matmul rate per dtype over a sweep of shapes (MAMF, "maximum achievable
matmul FLOPS" as stas00's ml-engineering defines it), the memory bandwidth of a large copy and of a large read, and
the time to launch one small operation (eager; and inside a CUDA-graph replay on a GPU).

Every figure is a rate or a time from ``timeit`` blocks (synchronized on a GPU), timed in rounds across the whole
sweep (:mod:`.sweep`: one block per figure a round, its runs per block fixed once), given as the median of its
blocks with a distribution-free 95 % order-statistic interval of that median (``core.stats.order.median_interval``):
the interval covers what changed over the run, and a line warns when other work shared the machine meanwhile.
Work per run: a matmul of ``M x K`` by ``K x N`` is ``2 M N K`` FLOPs; a copy reads and writes its bytes
(``2 x bytes``); a read (a sum) reads them once; a launch is one operation. Sizes follow the device: a CPU's sweep
stays under a minute on two cores, a GPU's reaches the shapes where its tensor cores are busy, and the bandwidth
buffer is past every cache of the machine (STREAM's rule: at least 4x all last-level caches together).

The measured MAMF of a dtype (:func:`mamf`) is the one measured ceiling that every MFU against a measured ceiling
reads: the best over the sweep's shapes, kept with the machine's ceilings.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from ...core.errors import OptlabError, choice_error
from ...core.gpt.fp8 import ACTIVATION_DTYPE, OUT_DTYPE, column_major, fp8_support
from ...core.knobs.limits import check_count
from ...core.machine import machine_load
from ...core.machine.device import DeviceInfo, resolve_device
from ...core.results import store
from ...core.results.published import published_figures
from ...core.stats.order import median_interval
from ..serving.bandwidth import all_last_level_caches_bytes
from . import sweep

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": ACTIVATION_DTYPE}
# (M, N, K) per device type: square sides around the sizes a model's layers use, then ml-engineering's best shapes
# (its MAMF table, compute/accelerator/README.md, "Best Shape MxNxK"): H100 SXM bf16, GH200 SXM bf16, H100 SXM FP8,
# H200 SXM FP8, then a long thin one
MATMUL_SHAPES = {
    "cpu": ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (256, 1024, 1024), (1024, 256, 1024)),
    "cuda": ((4096, 4096, 4096), (8192, 8192, 8192), (2048, 2048, 13312), (1024, 15360, 4096),
             (1024, 9216, 14336), (1280, 4096, 12032), (16384, 8192, 1024), (6144, 6144, 6144)),
}
MIN_BANDWIDTH_MIB = {"cpu": 64, "cuda": 4096}  # the bandwidth buffer at the least, however small the caches
UNKNOWN_CACHES_MIB = {"cpu": 256, "cuda": 4096}  # where the machine does not say how large its caches are
CACHE_MULTIPLE = 4  # STREAM: each array at least 4x all last-level caches together (cs.virginia.edu/stream/ref.html)
MAX_MIB = 16384
MIN_RUN_TIME_S = {"cpu": 0.25, "cuda": 0.2}  # timed per figure, over all its rounds
MAX_MIN_RUN_TIME_S = 5.0
ROUNDS = 6  # one block per figure a round: the fewest whose median has a 95 % order-statistic interval
GRAPH_OPS = 64  # tiny additions captured in the CUDA graph whose replay is timed
UNITS = {"matmul": "TFLOP/s", "copy": "GB/s", "read": "GB/s", "launch": "µs"}
SCALES = {"matmul": 1e12, "copy": 1e9, "read": 1e9, "launch": 1e-6}
SWEEP_COLUMNS = ["device", "rounds", "sweep_s", "load_warning"]  # the same on every row: how the table was measured
RECORD = "ceilings"  # results/live/ceilings.csv


def bandwidth_mib(device: torch.device) -> int:
    """The bandwidth buffer for ``device``, in MiB: ``CACHE_MULTIPLE`` x every last-level cache of the machine
    together, at least ``MIN_BANDWIDTH_MIB`` of its kind and at most ``MAX_MIB`` (``UNKNOWN_CACHES_MIB`` where the
    machine does not say)."""
    caches = all_last_level_caches_bytes(device)
    if caches is None:
        return UNKNOWN_CACHES_MIB[device.type]
    return min(MAX_MIB, max(MIN_BANDWIDTH_MIB[device.type], math.ceil(CACHE_MULTIPLE * caches / 2**20)))


def _tf32(on: bool):
    """A switch that sets TF32 matmuls for one visit and restores them after."""
    @contextlib.contextmanager
    def switch():
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = on
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
    return switch


def matmul_figure(device: torch.device, name: str, m: int, n: int, k: int) -> sweep.Figure:
    """A product of ``M x K`` by ``K x N`` in dtype ``name`` (e4m3 ``torch._scaled_mm`` for fp8): ``2 M N K`` FLOPs."""
    def build() -> tuple[str, dict]:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        if name == "fp8":
            one = torch.ones((), device=device)
            return ("torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out)",
                    {"torch": torch, "a": a.to(ACTIVATION_DTYPE), "b": column_major(b.to(ACTIVATION_DTYPE)),
                     "one": one, "out": OUT_DTYPE})
        return "torch.mm(a, b)", {"torch": torch, "a": a.to(DTYPES[name]), "b": b.to(DTYPES[name])}
    return sweep.Figure("matmul", name, f"{m}x{n}x{k}", 2 * m * n * k, build, _tf32(name == "tf32"))


def bandwidth_figures(device: torch.device, mib: int) -> list[sweep.Figure]:
    """A copy of ``mib`` MiB into another tensor (its bytes read and written) and a sum over them (read once).

    On a CPU both figures share two buffers, made at the first visit and held until the sweep drops its figures: a
    fresh buffer there is new pages, each faulted in at its first touch, which cost several times the timed runs (two
    1920 MiB buffers: about a second a visit on a 2-core machine, 15 of its sweep's 17 s). A GPU's caching allocator
    hands a visit's memory straight back, so there each visit makes its own and none is held between visits."""
    nbytes = mib * 2**20 // 4 * 4
    kept: dict[str, torch.Tensor] = {}

    def buffers() -> dict[str, torch.Tensor]:
        if kept:
            return kept
        source = torch.ones(nbytes // 4, device=device)
        made = {"source": source, "target": torch.empty_like(source)}
        if device.type == "cpu":
            kept.update(made)
        return made

    def copy() -> tuple[str, dict]:
        return "target.copy_(source)", dict(buffers())

    def read() -> tuple[str, dict]:
        return "source.sum()", {"source": buffers()["source"]}
    return [sweep.Figure("copy", "fp32", f"{mib} MiB, read + written", 2 * nbytes, copy),
            sweep.Figure("read", "fp32", f"{mib} MiB, summed", nbytes, read)]


def captured_adds(device: torch.device) -> tuple[str, dict]:
    """``GRAPH_OPS`` tiny additions captured in one CUDA graph, and the statement that replays it."""
    x = torch.ones(1, device=device)
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
    return "graph.replay()", {"graph": graph, "inputs": x}


def launch_figures(device: torch.device, graph: bool) -> list[sweep.Figure]:
    """One tiny addition launched from Python (eager), and with ``graph`` (a GPU) each of ``GRAPH_OPS`` additions in
    one CUDA-graph replay (the replay's time over its operations)."""
    eager = sweep.Figure("launch", "fp32", "eager: one 1-element add", 1,
                         lambda: ("x + 1", {"x": torch.ones(1, device=device)}))
    if not graph:
        return [eager]
    return [eager, sweep.Figure("launch", "fp32", f"CUDA graph: one replay of {GRAPH_OPS} adds, per add", GRAPH_OPS,
                                lambda: captured_adds(device))]


def figures(device: torch.device, dtypes: Sequence[str], shapes: Sequence[tuple[int, int, int]], mib: int,
            graph: bool) -> list[sweep.Figure]:
    """Every figure of a sweep: each dtype at each shape, the copy and the read of ``mib`` MiB, the launches."""
    return ([matmul_figure(device, name, *shape) for name in dtypes for shape in shapes]
            + bandwidth_figures(device, mib) + launch_figures(device, graph))


def _row(timed: sweep.Timed) -> dict:
    """A rate row: work per run over each block's seconds per run, in the figure's unit; for a launch, the time per
    operation."""
    figure = timed.figure
    scale = SCALES[figure.name]
    values = ([t / figure.work / scale for t in timed.seconds] if figure.name == "launch"
              else [figure.work / t / scale for t in timed.seconds])
    low, high = median_interval(values)
    return {"ceiling": figure.name, "dtype": figure.dtype, "detail": figure.detail,
            "value": float(pd.Series(values).median()), "ci_low": low, "ci_high": high, "unit": UNITS[figure.name],
            "blocks": len(values), "runs_per_block": timed.runs}


def table_of(result: sweep.Sweep, device_name: str) -> pd.DataFrame:
    """One row per figure of a sweep, with the sweep's rounds, seconds and the machine-load warning (empty when the
    machine was quiet) on every row, so that a kept table says how it was measured."""
    warning = machine_load.warning(result.load) or ""
    return pd.DataFrame([_row(timed) for timed in result.timed]).assign(
        device=device_name, rounds=result.rounds, sweep_s=round(result.seconds, 1), load_warning=warning)


def available_dtypes(device: torch.device) -> tuple[str, ...]:
    """The dtypes whose matmul this device runs natively: fp32 and bf16 everywhere; fp16 on a GPU, TF32 on one of
    compute capability 8.0 or newer, fp8 on one of 8.9 or newer."""
    if device.type != "cuda":
        return ("fp32", "bf16")
    tf32 = ("tf32",) if torch.cuda.get_device_capability(device) >= (8, 0) else ()
    return ("fp32",) + tf32 + ("bf16", "fp16") + (("fp8",) if fp8_support(device) is None else ())


def _run_time(kind: str, min_run_time: float | None) -> float:
    run_time = MIN_RUN_TIME_S[kind] if min_run_time is None else min_run_time
    if isinstance(run_time, bool) or not isinstance(run_time, (int, float)) or not 0 < run_time <= MAX_MIN_RUN_TIME_S:
        raise OptlabError(f"min_run_time must be seconds above 0 and at most {MAX_MIN_RUN_TIME_S:g}, "
                          f"got {run_time!r}")
    return run_time


def measure(device: str = "auto", dtypes: Sequence[str] | None = None, mib: int | None = None,
            min_run_time: float | None = None, timer: sweep.BlockTimer | None = None) -> pd.DataFrame:
    """The ceilings of ``device``, one row per figure (matmul per dtype and shape, copy, read, launch) with its
    median, interval and unit; ``mib`` sizes the bandwidth tensors (default: past every cache,
    :func:`~optlab.studies.limits.ceilings.bandwidth_mib`), ``min_run_time`` the seconds timed per figure over all its rounds; ``timer`` replaces the benchmark's block (a
    test's fake clock)."""
    info = resolve_device(device)
    kind = info.device.type
    allowed = available_dtypes(info.device)
    dtypes = tuple(allowed if dtypes is None else dtypes)
    for name in dtypes:
        if name not in allowed:
            raise choice_error(f"dtype on {info.name}", name, allowed)
    mib = bandwidth_mib(info.device) if mib is None else check_count("bandwidth size (MiB)", mib, 1, MAX_MIB,
                                                                     "two tensors of it are allocated")
    block_s = _run_time(kind, min_run_time) / ROUNDS
    timer = timer or sweep.block_timer(sweep.device_clock(info.device))
    result = sweep.run(figures(info.device, dtypes, MATMUL_SHAPES[kind], mib, graph=kind == "cuda"), ROUNDS, block_s,
                       timer)
    return table_of(result, info.name)


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
    """The best figures as lines a person reads: what was swept, value, interval, unit and what reached it, and the
    machine-load warning where other work shared the machine."""
    first = table.iloc[0]
    lines = [f"ceilings of {first['device']}: {len(table)} figures in {first['rounds']} rounds across "
             f"{first['sweep_s']:g} s, one block per figure a round, its runs per block fixed once (median of the "
             "blocks, 95 % order-statistic interval of the median):"]
    for row in best(table).itertuples():
        what = f"MAMF {row.dtype}" if row.ceiling == "matmul" else row.ceiling
        lines.append(f"  {what:<12} {row.value:10.4g} {row.unit:<8} [{row.ci_low:.4g}, {row.ci_high:.4g}]  "
                     f"({'best shape ' if row.ceiling == 'matmul' else ''}{row.detail})")
    warning = first.get("load_warning")
    return "\n".join(lines + ([warning] if isinstance(warning, str) and warning else []))


def mamf(info: DeviceInfo, dtype: str, folder: str | Path | None = None) -> tuple[float, str]:
    """The measured MAMF of ``dtype`` on ``info``'s device in TFLOP/s, and where it comes from: the best matmul of
    the ceilings kept in ``folder`` (default: the live results, which the summary page reads) when they were
    measured on this device; else the ceilings (and a dtype they lack, its matmuls) are measured now and kept there.
    The one measured ceiling every MFU against a measured ceiling reads."""
    if dtype not in DTYPES:
        raise choice_error("dtype of a measured ceiling", dtype, tuple(DTYPES))
    kept = load(folder)
    if kept is None or (kept["device"] != info.name).any():  # none, or another machine's
        kept = measure(str(info.device))
        save(kept, folder)
    if dtype not in set(kept.loc[kept["ceiling"] == "matmul", "dtype"]):
        block_s = MIN_RUN_TIME_S[info.device.type] / ROUNDS
        timer = sweep.block_timer(sweep.device_clock(info.device))
        matmuls = [matmul_figure(info.device, dtype, *shape) for shape in MATMUL_SHAPES[info.device.type]]
        kept = pd.concat([kept, table_of(sweep.run(matmuls, ROUNDS, block_s, timer), info.name)], ignore_index=True)
        save(kept, folder)
    row = best(kept[(kept["ceiling"] == "matmul") & (kept["dtype"] == dtype)]).iloc[0]
    return float(row["value"]), (f"measured MAMF: the best {dtype} matmul of the ceilings sweep on {info.name} "
                                 f"({row['detail']}), kept in {RECORD}.csv")


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
