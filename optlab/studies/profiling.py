"""Where a training step's time goes: a few steps of the measured loop under ``torch.profiler``.

The profiled steps run the same code as the timed loops (``variants.build_state``, ``loops.train_step``). A
schedule leaves the first steps unrecorded (loader start-up, autotuning, compilation), then records ``steps`` warm
ones. The breakdown is read from the exported Chrome trace (the file a reader opens in Perfetto): each recorded
step is split along the CPU's timeline into data wait (the loader's ``__next__`` ranges), CUDA launch calls,
synchronisation waits and the rest (framework and Python), and on a GPU the device's busy time is the union of its
kernel, copy and memset intervals. The top ops or kernels come from ``key_averages()``.
"""
from __future__ import annotations

import gzip
import json
import math
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule
from torch.utils.data import DataLoader

from ..core.cifar import data
from ..core.results import store
from ..core.knobs.config import RunConfig
from ..core.machine.device import DeviceInfo, effective_config, resolve_device
from ..core.errors import OptlabError
from ..core.techniques.registry import get_experiment
from ..core.run.variants import VariantState, build_state
from ..core.measuring.loops import backend_flags, train_step
from ..core.knobs.profiles import Profile, get_profile
from ..core.measuring.timing import summarize

STEPS = 5  # recorded steps
WARMUP = 3  # unrecorded steps first; the last of them warms the profiler up
TOP = 10  # rows of the top ops table
TABLES = ("profiling-breakdown", "profiling-top-ops")  # the stored GPU reference tables of run_reference
TRACE_SUFFIXES = (".json", ".json.gz")
DATA_RANGE = "enumerate("  # DataLoader's range: "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})  # the trace's device work
LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"})
UNION = "union of kernel, copy and memset intervals"
KERNEL_SUM = "sum of kernel durations (the profile has no kernel intervals)"
NO_GPU = "no GPU"
NO_DEVICE_EVENTS = "no device activity recorded (is CUPTI available?)"
CPU_PARTS = ("data_wait_ms", "launch_ms", "sync_ms", "cpu_other_ms")  # they add up to wall_ms
STEP_COLUMNS = ("step", "wall_ms", *CPU_PARTS, "device_busy_ms")


@dataclass(frozen=True)
class Span:
    """One interval of the profile that the breakdown counts: a step, data wait, launch, sync or device work."""

    kind: str  # "step", "data", "launch", "sync" or "device"
    start_us: float
    end_us: float


@dataclass
class ProfileResult:
    """A profiled configuration: per-step parts, their one-row breakdown, the trace's path, and the top ops."""

    label: str
    config: RunConfig  # as it ran on this device
    device: str
    steps: pd.DataFrame  # one row per recorded step (STEP_COLUMNS)
    breakdown: pd.DataFrame  # one row: the mean of each part per step, the wall's median and IQR, the shares
    trace: Path | None
    notes: list[str]
    profiler: profile = field(repr=False)

    def top_ops(self, limit: int = TOP) -> pd.DataFrame:
        """The ``limit`` largest kernels (when the trace has them) or CPU ops, per step, with a ``config`` column."""
        on_device = self.breakdown["device_busy_method"].iloc[0] == UNION
        frame = top_table(self.profiler.key_averages(), on_device, len(self.steps),
                        float(self.breakdown["wall_ms"].iloc[0]), limit)
        return frame.assign(config=self.label)


def classify(name: str, category: str) -> str | None:
    """The kind of span a trace event is (by its name and its trace category), or None if the breakdown does not
    count it."""
    if category in DEVICE_CATEGORIES:
        return "device"
    if category.startswith("gpu_"):  # other rows of the device timeline, such as gpu_user_annotation
        return None
    if name.startswith("ProfilerStep"):
        return "step"
    if name.startswith(DATA_RANGE):
        return "data"
    if name.startswith(LAUNCH_PREFIXES):
        return "launch"
    return "sync" if name in SYNC_CALLS else None


def read_trace(path: str | Path) -> dict:
    """A Chrome trace written by ``export_chrome_trace``, gzipped (``.gz``) or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def spans_from_trace(trace: dict) -> list[Span]:
    """The counted spans among the trace's complete events (``"ph": "X"``, times in microseconds)."""
    spans = []
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        kind = classify(event.get("name", ""), event.get("cat") or "")
        if kind is not None:
            spans.append(Span(kind, float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))))
    return spans


def covered_us(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Microseconds of ``[start, end)`` inside at least one interval; overlapping intervals count once."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    total, reach = 0.0, start
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def step_breakdown(spans: list[Span], device_intervals: bool) -> pd.DataFrame:
    """One row per recorded step, in milliseconds. A step runs from its ``ProfilerStep`` range to the next one's.

    Along the CPU's timeline the step is split into disjoint parts: data wait, then launch calls outside it, then
    sync waits outside both, then the rest. ``device_busy_ms`` is the union of device intervals in the step (NaN
    when ``device_intervals`` is False: no GPU was profiled, or it left no intervals).
    """
    steps = sorted((s for s in spans if s.kind == "step"), key=lambda s: s.start_us)
    if not steps:
        raise OptlabError("the profile holds no ProfilerStep ranges: call prof.step() after every step, and record "
                          "at least one step (schedule active >= 1)")
    bounds = [s.start_us for s in steps] + [steps[-1].end_us]
    of = {kind: [(s.start_us, s.end_us) for s in spans if s.kind == kind]
          for kind in ("data", "launch", "sync", "device")}
    rows = []
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        waits = covered_us(of["data"], start, end)
        launches = covered_us(of["data"] + of["launch"], start, end) - waits
        syncs = covered_us(of["data"] + of["launch"] + of["sync"], start, end) - waits - launches
        device = covered_us(of["device"], start, end) if device_intervals else math.nan
        wall = end - start
        rows.append(dict(zip(STEP_COLUMNS, (index, wall, waits, launches, syncs, wall - waits - launches - syncs,
                                            device))))
    frame = pd.DataFrame(rows, columns=list(STEP_COLUMNS))
    frame[list(STEP_COLUMNS[1:])] /= 1e3
    return frame


def summary_row(steps: pd.DataFrame, label: str, config: RunConfig, device: str, method: str,
                device_busy_ms: float | None = None) -> pd.DataFrame:
    """The one-row breakdown: the mean per step of every part (so the parts add up to ``wall_ms``), the wall's
    median and IQR over the steps, and the shares of the wall. ``device_busy_ms`` overrides the steps' mean."""
    wall = summarize(steps["wall_ms"])
    means = steps[list(STEP_COLUMNS[1:])].mean()
    busy = means["device_busy_ms"] if device_busy_ms is None else device_busy_ms
    row = {"config": label, "model": config.model, "device": device, "steps": wall.n, "wall_ms": means["wall_ms"],
           "wall_median_ms": wall.median, "wall_iqr_ms": wall.iqr, **{part: means[part] for part in CPU_PARTS},
           "device_busy_ms": busy, "device_busy_share": busy / means["wall_ms"],
           "data_wait_share": means["data_wait_ms"] / means["wall_ms"], "device_busy_method": method}
    return pd.DataFrame([row])


def top_table(averages: Iterable, on_device: bool, steps: int, wall_ms: float, limit: int = TOP) -> pd.DataFrame:
    """The ``limit`` largest rows of ``prof.key_averages()``: device kernels and copies by self device time when
    ``on_device``, otherwise CPU ops by self CPU time (the ``ProfilerStep`` ranges are left out), per step."""
    rows = []
    for average in averages:
        if on_device != (average.device_type != DeviceType.CPU) or average.key.startswith("ProfilerStep"):
            continue
        self_us = average.self_device_time_total if on_device else average.self_cpu_time_total
        rows.append({"op": average.key, "calls_per_step": average.count / steps,
                     "self_ms_per_step": self_us / 1e3 / steps})
    frame = pd.DataFrame(rows, columns=["op", "calls_per_step", "self_ms_per_step"])
    frame = frame.sort_values("self_ms_per_step", ascending=False, ignore_index=True).head(limit)
    frame["share_of_wall"] = frame["self_ms_per_step"] / wall_ms
    frame["measure"] = "self device time" if on_device else "self CPU time"
    return frame


def _recorded(iterator: Iterator, name: str) -> Iterator:
    """The batches of ``iterator``, each fetched inside a profiler range called ``name``."""
    while True:
        with record_function(name):
            batch = next(iterator, None)
        if batch is None:
            return
        yield batch


def batches(loader: Iterable) -> Iterator:
    """Iterate ``loader`` with its data wait visible to the profiler: a DataLoader records its own ``__next__``
    range; any other loader (the device-resident one) is wrapped in a range named the same way."""
    if isinstance(loader, DataLoader):
        return iter(loader)
    return _recorded(iter(loader), f"{DATA_RANGE}{type(loader).__name__})#__next__")


def profiled_steps(state: VariantState, info: DeviceInfo, steps: int, warmup: int) -> profile:
    """Run ``warmup`` unrecorded, then ``steps`` recorded training steps of ``state`` under torch.profiler.

    On CUDA the device is synchronized at the end of the last unrecorded and the last recorded step, so that the
    recorded window holds exactly the recorded steps' device work."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.is_cuda else [])
    stream = batches(state.loaders["train"])  # worker start-up happens here, before the profiler starts
    state.model.train()
    state.optimizer.zero_grad(set_to_none=state.config.set_to_none)
    plan = schedule(wait=warmup - 1, warmup=1, active=steps, repeat=1)
    with backend_flags(state.config), profile(activities=activities, schedule=plan) as prof:
        for index in range(warmup + steps):
            train_step(state.model, next(stream), state.optimizer, state.scaler, state.config, info.device, index)
            if info.is_cuda and index in (warmup - 1, warmup + steps - 1):
                torch.cuda.synchronize(info.device)
            prof.step()
    return prof


def device_measure(has_intervals: bool, cuda: bool, kernel_us: Callable[[], float],
                   steps: int) -> tuple[str, float | None]:
    """How the device's busy time is measured, and its value per step when it is not the steps' mean (None).

    With kernel intervals in the trace: their union. On CUDA without them: the sum of kernel durations that
    ``kernel_us()`` reads from the profiler's averages, if there are any. Otherwise NaN, saying why."""
    if has_intervals:
        return UNION, None
    if not cuda:
        return NO_GPU, math.nan
    total = kernel_us()
    return (KERNEL_SUM, total / 1e3 / steps) if total > 0 else (NO_DEVICE_EVENTS, math.nan)


def _check_sizes(steps: int, warmup: int, trace: Path | None) -> None:
    for name, value in (("steps", steps), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptlabError(f"{name} must be an integer >= 1, got {value!r}")
    if trace is not None and not str(trace).endswith(TRACE_SUFFIXES):
        raise OptlabError(f"trace {str(trace)!r} must end with one of: {', '.join(TRACE_SUFFIXES)} "
                          "(.json.gz is written gzipped)")


def profile_training(config: RunConfig, device: str = "auto", steps: int = STEPS, warmup: int = WARMUP,
                     trace: str | Path | None = None, label: str | None = None, seed: int = 0) -> ProfileResult:
    """Profile ``steps`` training steps of ``config`` (as it runs on ``device``) after ``warmup`` unrecorded ones;
    write a Chrome trace to ``trace`` (``.json`` or ``.json.gz``) if given."""
    trace = Path(trace) if trace is not None else None
    _check_sizes(steps, warmup, trace)
    info = resolve_device(device)
    effective, notes = effective_config(config, info)
    train_set, test_set = data.datasets(data.find_source())
    state = build_state(effective, info, train_set, test_set, seed)
    prof = profiled_steps(state, info, steps, warmup)
    with tempfile.TemporaryDirectory(prefix="optlab-trace-") as scratch:
        path = trace or Path(scratch) / "trace.json"
        store.writable_dir(path.parent)
        prof.export_chrome_trace(str(path))
        spans = spans_from_trace(read_trace(path))
    has_intervals = any(s.kind == "device" for s in spans)
    per_step = step_breakdown(spans, has_intervals)
    def kernel_us() -> float:  # read only when the trace has no kernel intervals: key_averages parses every event
        return sum(a.self_device_time_total for a in prof.key_averages() if a.device_type == DeviceType.CPU)

    method, busy = device_measure(has_intervals, info.is_cuda, kernel_us, len(per_step))
    label = label or effective.model
    breakdown = summary_row(per_step, label, effective, info.name, method, busy)
    return ProfileResult(label, effective, info.name, per_step, breakdown, trace, notes, prof)


def profile_configs(configs: dict[str, RunConfig], device: str = "auto", steps: int = STEPS, warmup: int = WARMUP,
                    trace_dir: str | Path | None = None) -> dict[str, ProfileResult]:
    """Profile every labelled config; with ``trace_dir``, write each trace there as :func:`trace_name` says."""
    return {label: profile_training(config, device, steps, warmup, label=label,
                                    trace=None if trace_dir is None else Path(trace_dir) / trace_name(label))
            for label, config in configs.items()}


def trace_name(label: str) -> str:
    """The trace file of a label: ``profile-<label>.json.gz``, the label in lower-case letters, digits and dashes."""
    slug = "-".join("".join(c if c.isalnum() else " " for c in label.lower()).split())
    return f"profile-{slug or 'config'}.json.gz"


def breakdown_table(results: dict[str, ProfileResult]) -> pd.DataFrame:
    """The breakdown rows of several profiles, one per config."""
    return pd.concat([r.breakdown for r in results.values()], ignore_index=True)


def top_ops_table(results: dict[str, ProfileResult], limit: int = TOP) -> pd.DataFrame:
    """The top ops of several profiles, with a ``config`` column."""
    return pd.concat([r.top_ops(limit) for r in results.values()], ignore_index=True)


def before_after(model: str = "resnet18", profile: str | Profile | None = None,
                 cuda: bool = False) -> dict[str, RunConfig]:
    """The seed's baseline and the last, most optimized variant of ``all_together``, as the profile sizes them."""
    configs = get_experiment("all_together").configs(model, get_profile(profile, cuda))
    labels = list(configs)
    return {"before": configs[labels[0]], "after": configs[labels[-1]]}


def run_reference(out: str | Path, device: str = "cuda") -> list[Path]:
    """The GPU reference: before/after breakdowns of ResNet18 at the quick size and their top kernels, saved as
    ``profiling-breakdown.csv`` and ``profiling-top-ops.csv`` under ``out``."""
    results = profile_configs(before_after("resnet18", "quick"), device)
    return [store.save_table(breakdown_table(results), out, TABLES[0]),
            store.save_table(top_ops_table(results), out, TABLES[1])]
