"""A training step against the machine's ceilings: its FLOPs, its bytes, its operations, and what bounds it.

- **FLOPs**: counted by ``torch.utils.flop_counter`` (``config_step_flops``: 3 x the forward's count).
- **Bytes**, a stated model of the least a step must move: every weight read in the forward and in the backward and
  its gradient written (3 passes of fp32 weights), the optimizer reading weight, gradient and each state tensor and
  writing weight and states (2 + 2 x states passes: SGD with momentum keeps one state, Adam and AdamW two), every
  activation autograd saves written in the forward and read in the backward (2 passes, in the autocast dtype), and
  the batch read once. Temporaries and re-reads that a cache misses are left out: the true traffic is higher.
- **Operations**: every aten operator one step dispatches (forward, loss, backward, optimizer step, ``zero_grad``),
  counted by a ``TorchDispatchMode`` on two samples, on the CPU (the meta device for a model too large to run
  there). A compiled step is counted eager: its count is an upper bound, since compiled kernels fuse operators.

Three lower bounds on a step's time follow: FLOPs over the measured matmul ceiling of its precision (compute),
bytes over the measured bandwidth (memory), and operations times the measured launch overhead (launch). A step whose
launches alone fill at least ``LAUNCH_SHARE`` of its time is launch-bound (its time is close to its operation count
times the launch overhead); any other is bound by the largest of the three. The bound's share of the measured step
time is the fraction of that ceiling the step reached. A share above 100 % means the ceiling was measured at
another moment than the step, under other load (a shared machine): the figure then says so rather than a bound.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, replace
from functools import lru_cache

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...core.knobs.config import RunConfig
from ...core.knobs.limits import check_count
from ...core.machine.device import TORCH_DTYPES, resolve_device
from ...core.measuring.flops import config_step_flops
from ...core.measuring.loops import (
    backend_flags, call_model, input_tensors, make_optimizer, make_scaler, prepare_model, train_step,
)
from ...core.measuring.timing import summarize
from ...core.workload import get_workload
from .ceilings import Roofs
from .peaks import datasheet_peak, precision_of
from ..serving.bandwidth import datasheet_peak as datasheet_bandwidth

COUNT_BATCH = 2  # samples in the counted step; saved activations and the batch scale linearly to the real batch
BOUNDS = ("compute", "memory", "launch")
OPTIMIZER_STATES = {"sgd": 1, "adam": 2, "adamw": 2}
WEIGHT_BYTES = 4  # fp32 weights (autocast keeps them so)
LAUNCH_SHARE = 0.5
MAX_TIMED_STEPS = 100
UNEXPLAINED_SHARE = 0.25
UNEXPLAINED = ("no ceiling explains most of this step: its time goes elsewhere (Python, traffic beyond the byte "
               "model, other work on the machine)")
CPU_COUNT_FLOPS = 2e10  # a counted step below this many FLOPs runs on the CPU (a second or so), above on meta


@dataclass(frozen=True)
class StepCost:
    """What one training step of a config costs: FLOPs, bytes by the stated model (weights, activations, batch),
    dispatched operators, and the precision most FLOPs run in."""

    flops: int
    weight_bytes: int
    activation_bytes: int
    input_bytes: int
    ops: int
    precision: str

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.input_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes


class OpCounter(TorchDispatchMode):
    """Counts every aten operator dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _shape_knobs(config: RunConfig) -> RunConfig:
    """``config`` with only what changes a step's counts kept (how it is loaded and timed dropped)."""
    return RunConfig(workload=config.workload, model=config.model, model_variant=config.model_variant,
                     width=config.width, batch_size=config.batch_size, batch_offset=config.batch_offset,
                     amp_dtype=config.amp_dtype, optimizer=config.optimizer, optimizer_impl=config.optimizer_impl,
                     **get_workload(config.workload).knobs_of(config))


def step_cost(config: RunConfig, tf32: bool = False) -> StepCost:
    """The counts of one training step of ``config`` (``tf32``: whether its device has TF32 tensor cores)."""
    ops, saved, batch = _counted(_shape_knobs(config))
    samples = config.samples_per_step
    parameters = _parameter_count(_shape_knobs(config))
    passes = 3 + 2 + 2 * OPTIMIZER_STATES.get(config.optimizer, 1)
    return StepCost(flops=config_step_flops(config, train=True), weight_bytes=parameters * WEIGHT_BYTES * passes,
                    activation_bytes=2 * saved * samples // COUNT_BATCH, input_bytes=batch * samples // COUNT_BATCH,
                    ops=ops, precision=precision_of(config, tf32))


@lru_cache(maxsize=None)
def _parameter_count(config: RunConfig) -> int:
    with torch.device("meta"):
        model = get_workload(config.workload).build(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@lru_cache(maxsize=None)
def _counted(config: RunConfig) -> tuple[int, int, int]:
    """Operators of one step at ``COUNT_BATCH`` samples, the bytes autograd saved, and the batch's bytes: on the CPU
    for a model whose counted step is small (autocast applies there), else on the meta device (activations at
    fp32, an upper bound under autocast, which the meta device does not apply)."""
    spec = get_workload(config.workload)
    amp = TORCH_DTYPES[config.amp_dtype]
    device = "cpu" if config_step_flops(config, train=True) / config.samples_per_step * COUNT_BATCH < CPU_COUNT_FLOPS \
        else "meta"
    with torch.device(device):
        torch.manual_seed(0)
        model = spec.build(config)
        inputs = spec.input_for(COUNT_BATCH, config)
    optimizer = make_optimizer(model, replace(config, optimizer_impl="foreach")
                               if device == "meta" and config.optimizer_impl == "fused" else config)
    saved: dict[int, int] = {}
    parameters = {id(p) for p in model.parameters()} | {id(t) for t in input_tensors(inputs)}  # counted apart

    def pack(saved_one: torch.Tensor) -> torch.Tensor:
        base = saved_one._base if saved_one._base is not None else saved_one
        if id(base) not in parameters:  # a view keeps its whole base: each base once
            saved[id(base)] = base.numel() * base.element_size()
        return saved_one

    counter = OpCounter()
    kept = []  # the saved tensors stay alive until the count ends, so that no id is reused
    with counter, torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or pack(t), lambda t: t):
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None and device == "cpu"):
            output = call_model(model, inputs)
            targets = torch.zeros(output.shape[:-1], dtype=torch.long, device=device)
            loss = spec.loss(output, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    batch = sum(t.numel() * t.element_size() for t in (*input_tensors(inputs), targets))
    return sum(counter.counts.values()), sum(saved.values()), batch


def bound_times(cost: StepCost, roofs: Roofs) -> dict[str, float]:
    """The three lower bounds on the step's time in seconds: compute, memory, launch (NaN where no roof was
    measured for the step's precision)."""
    rate = roofs.flops_per_s.get(cost.precision) or roofs.flops_per_s.get("fp32" if cost.precision == "tf32" else "")
    return {"compute": cost.flops / rate if rate else float("nan"),
            "memory": cost.bytes / roofs.bytes_per_s,
            "launch": cost.ops * roofs.launch_s}


def bound_of(times: dict[str, float], step_s: float) -> str:
    """``launch`` where the launches fill at least ``LAUNCH_SHARE`` of ``step_s``, else the largest of the three
    (a bound without a measured roof, NaN, is never the largest)."""
    if times["launch"] >= LAUNCH_SHARE * step_s:
        return "launch"
    known = {name: t for name, t in times.items() if t == t}
    return max(known, key=known.get)


def limit_row(cost: StepCost, step_s: float, roofs: Roofs, gpu_name: str = "") -> dict:
    """One step against the ceilings: achieved rates, each fraction, the bound and the share of the step it
    explains; MFU and MBU against the datasheet too where ``gpu_name``'s peaks are known."""
    times = bound_times(cost, roofs)
    bound = bound_of(times, step_s)
    datasheet = datasheet_peak(gpu_name, cost.precision) if gpu_name else None
    hbm = datasheet_bandwidth(gpu_name) if gpu_name else None
    achieved = cost.flops / step_s
    return {
        "precision": cost.precision, "step ms": 1e3 * step_s, "TFLOP/s": achieved / 1e12,
        "MFU % of measured MAMF": 100 * times["compute"] / step_s,
        "MFU % of datasheet": 100 * achieved / (datasheet.tflops * 1e12) if datasheet else float("nan"),
        "GB/s (byte model)": cost.bytes / step_s / 1e9, "MBU % of measured": 100 * times["memory"] / step_s,
        "MBU % of datasheet": 100 * cost.bytes / step_s / hbm.bytes_per_s if hbm else float("nan"),
        "operators": cost.ops, "operators x launch ms": 1e3 * times["launch"],
        "bound": bound, "% of that ceiling": 100 * times[bound] / step_s,
        "note": "; ".join([f"{name} above its measured ceiling: measured under other load"
                           for name, t in times.items() if t > step_s]
                          + ([UNEXPLAINED] if times[bound] < UNEXPLAINED_SHARE * step_s else [])),
        "FLOP/byte": cost.intensity,
    }


def limits_table(points: pd.DataFrame, roofs: Roofs) -> pd.DataFrame:
    """:func:`limit_row` for every row of ``points`` (columns ``config``: a RunConfig, ``step_ms``, optional
    ``gpu_name``), the rows' other columns kept in front."""
    rows = []
    for point in points.to_dict("records"):
        config = point.pop("config")
        step_ms = point.pop("step_ms")
        gpu = point.pop("gpu_name", "") or ""
        cost = step_cost(config, tf32=bool(gpu) and datasheet_peak(gpu, "tf32") is not None)
        rows.append(point | limit_row(cost, step_ms / 1e3, roofs, gpu))
    return pd.DataFrame(rows)


DETAIL_COLUMNS = ["TFLOP/s", "MFU % of datasheet", "GB/s (byte model)", "MBU % of datasheet", "operators",
                  "operators x launch ms", "FLOP/byte"]  # in a page's "all columns" block
LABEL_COLUMNS = ["label", "source", "workload", "model", "best"]  # what names a row, repeated in that block


def for_page(table: pd.DataFrame) -> pd.DataFrame:
    """A :func:`optlab.book.limits.limits_table` as a page shows it: the bound, its share and the fractions of the
    measured ceilings first; the achieved rate, the datasheet's fractions and the counts behind them in the collapsed
    "all columns" block (so that the table fits the article column)."""
    shown = table.copy()
    names = [*shown.index.names, *shown.columns]
    shown.attrs.update(keys=[c for c in LABEL_COLUMNS if c in names], details=DETAIL_COLUMNS)
    return shown


def time_steps(config: RunConfig, device: str = "auto", steps: int = 5, warmup: int = 2) -> float:
    """The median seconds of ``steps`` training steps of ``config`` after ``warmup``, on one batch of the workload's
    example input kept on the device (no loader: the roofline is about the step's own work), synchronized on a GPU."""
    check_count("timed steps", steps, 1, MAX_TIMED_STEPS, "a median of a few steps is what the roofline needs")
    check_count("warm-up steps", warmup, 1, MAX_TIMED_STEPS, "the first steps allocate, tune and compile")
    info = resolve_device(device)
    spec = get_workload(config.workload)
    torch.manual_seed(0)
    model = prepare_model(spec.build(config), config, info.device)
    optimizer, scaler = make_optimizer(model, config), make_scaler(config, info.device)
    inputs = spec.input_for(config.samples_per_step, config)
    with torch.no_grad():
        shape = call_model(spec.build(config), inputs).shape[:-1]  # the targets: one class per output row
    batch = (inputs, torch.zeros(shape, dtype=torch.long))
    times = []
    with backend_flags(config):
        for index in range(warmup + steps):
            start = time.perf_counter()
            train_step(model, batch, optimizer, scaler, config, info.device, 0)
            if info.is_cuda:
                torch.cuda.synchronize(info.device)
            times.append(time.perf_counter() - start)
    return summarize(times[warmup:]).median
