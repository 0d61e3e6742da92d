"""``optlab tune --inference``: the inference stack, one step at a time, on the reader's model, then its batch sizes.

The starting point is the model as most code first serves it: ``model.eval()``, fp32, eager, autograd on. ``eval()``
is always on, not a step: dropout and batch statistics would change the answers, so it is a matter of correctness,
never of speed. Each step is tried on top of the configuration kept so far and timed against it with the training
tune's machinery (the two take turns, repeat after repeat; the speed-up, its interval and verdict follow the same
rule), and kept only if it was faster and left the outputs where they were: on the same inputs, its outputs against
the starting point's (fp32 eager), within a tolerance per precision, and for a classifier its top-1 classes. The kept
steps are then timed afresh against the starting point, and both configurations are swept over batch sizes
(:mod:`optlab.studies.tune.batch_sweep`). A compiled model's first call (its compilation) is timed apart, never inside
the comparison.
"""
from __future__ import annotations

import gc
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import pandas as pd
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from ...core import compiler, loops, store
from ...core.config import RunConfig, apply_changes
from ...core.device import TORCH_DTYPES, DeviceInfo, effective_config, native_bf16, native_fp16, resolve_device
from ...core.environment import capture
from ...core.errors import OptlabError, choice_error
from ...core.experiments import failure_status, interleave, stopping_rule
from ...core.limits import MAX_STEPS, check_count
from ...core.memory import memory_kind
from ...core.profiles import Profile, get_profile
from ...core.samples import failed_row
from ...core.summary import summarize_runs
from ...core.timing import FASTER, INTERVAL
from .batch_sweep import PLATEAU_DOUBLINGS, PLATEAU_GAIN, SweepTarget, sweep
from .output_check import (OUTPUT_TOLERANCE, OutputFn, output_change, pick_output, precision, tolerance,
                           within_tolerance)
from .inputs import (MAX_BATCH_ELEMENTS, MAX_BATCH_SIZE, MAX_CLASSES, POOL_BATCHES, ModelFn, build_model,
                          check_shape, describe_error, model_name)

START = "starting point"
FINAL = "recommended"
TECHNIQUE = "tune-inference"
PHASE = "test"
AFRESH = "all kept steps, against the starting point"
INFERENCE_MODE, AUTOCAST, CHANNELS_LAST, COMPILE, CUDA_GRAPHS = (
    "+ torch.inference_mode", "+ 16-bit autocast", "+ channels_last", "+ torch.compile",
    "+ CUDA graphs (reduce-overhead)")
STEP_LABELS = (INFERENCE_MODE, AUTOCAST, CHANNELS_LAST, COMPILE, CUDA_GRAPHS)
AMP_CHOICES = ("auto", "bf16", "fp16", "none")
DEFAULT_MAX_BATCH = 1024
SWEEP_CALLS = 10  # timed calls per batch size, at most, or 5 per timed step of the profile if that is more
SWEEP_SECONDS_PER_CALL = 0.05  # a batch size's time budget: 0.5 s for 10 calls (at least 5 calls are timed)
STEP_COLUMNS = ["step", "precision", "decision", "speedup", "ci_low", "ci_high", "verdict", "max_error",
                "tolerance", "top1_agreement", "before_ms", "after_ms", "first_call_s", "reason"]

def decide(verdict: str, error: float, top1: float | None, limit: float, before_failed: str = "",
           after_failed: str = "") -> tuple[str, str]:
    """Whether a measured step is kept, and why not: only if its verdict is "faster" and its outputs are within
    ``limit`` of the starting point's."""
    if before_failed:
        return "not decided", f"the configuration before it failed: {before_failed}"
    if after_failed:
        return "failed", after_failed
    if verdict != FASTER:
        return "not kept", ""
    if not within_tolerance(error, top1, limit):
        moved = f"relative error {error:.2g}" + (f", top-1 agreement {100 * top1:.3g} %" if top1 is not None else "")
        return "not kept: outputs changed", (f"faster, but its outputs moved from the starting point's ({moved}), "
                                             f"beyond the {limit:g} tolerance")
    return "kept", ""


def autocast_dtype(amp_dtype: str, info: DeviceInfo) -> tuple[str | None, str | None]:
    """The 16-bit dtype the autocast step uses here (bf16 first for ``auto``), or None and why it is skipped."""
    if amp_dtype not in AMP_CHOICES:
        raise choice_error("autocast dtype", amp_dtype, AMP_CHOICES)
    if amp_dtype == "none":
        return None, "not asked for (autocast dtype 'none')"
    candidates = ("bf16", "fp16") if amp_dtype == "auto" else (amp_dtype,)
    native = {"bf16": native_bf16, "fp16": native_fp16}
    for dtype in candidates:
        if native[dtype](info):
            return dtype, None
    return None, f"no native {' or '.join(candidates)} on {info.name}: autocast would convert around every kernel"


def stack_changes(dtype: str | None) -> list[tuple[str, dict[str, Any]]]:
    """Each step's knob changes from the configuration before it (the autocast step with ``dtype``)."""
    return [(INFERENCE_MODE, {"eval_grad_mode": "inference_mode"}), (AUTOCAST, {"amp_dtype": dtype or "bf16"}),
            (CHANNELS_LAST, {"channels_last": True}), (COMPILE, {"compile_mode": "default"}),
            (CUDA_GRAPHS, {"compile_mode": "reduce-overhead"})]


@dataclass(frozen=True)
class InferenceProbe:
    """What one forward on two samples in eval mode showed."""

    forward_flops_per_sample: float
    parameters: int
    has_conv2d: bool
    input_dims: int
    output_shape: tuple[int, ...]  # one sample's


def probe(model_fn: ModelFn, inputs: torch.Tensor, output_fn: OutputFn | None, num_classes: int | None,
          device: torch.device, seed: int) -> InferenceProbe:
    """Build the model, put it in eval mode and run it on two samples, counting the FLOPs; every way this can fail
    is one OptlabError."""
    model = build_model(model_fn, seed)
    try:
        model.eval()
    except Exception as error:  # noqa: BLE001  (the user's model: its error, in one line)
        raise OptlabError(f"the model cannot run in eval mode: model.eval() failed: {describe_error(error)}") from None
    model = model.to(device)
    sample = inputs[:2].to(device)
    try:
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            raw = model(sample)
    except Exception as error:  # noqa: BLE001
        raise OptlabError(f"the model failed a forward pass in eval mode on inputs of shape {list(sample.shape)}: "
                          f"{describe_error(error)}") from None
    output = pick_output(raw, output_fn)
    if not output.is_floating_point():
        raise OptlabError(f"the output to compare is a tensor of {output.dtype}; outputs are compared within a "
                          "tolerance, so give the floating-point one (logits, not classes), with output_fn if needed")
    if output.dim() == 0 or output.shape[0] != len(sample):
        raise OptlabError(f"the output's first dimension must be the batch: {len(sample)} samples gave an output of "
                          f"shape {list(output.shape)}")
    if num_classes is not None and output.dim() == 2 and output.shape[1] != num_classes:
        raise OptlabError(f"the model gives {output.shape[1]} outputs per sample, but num_classes is {num_classes}: "
                          "pass the model's own (or leave it out)")
    return InferenceProbe(counter.get_total_flops() / len(sample), sum(p.numel() for p in model.parameters()),
                          any(isinstance(m, nn.Conv2d) for m in model.modules()), sample.dim(),
                          tuple(output.shape[1:]))


def skip_reason(label: str, changes: dict[str, Any], info: DeviceInfo, facts: InferenceProbe,
                autocast_skip: str | None) -> str | None:
    """Why a step does not apply to this device and model; None if it does."""
    if label == AUTOCAST:
        return autocast_skip
    if label == CHANNELS_LAST:
        if not facts.has_conv2d:
            return "the model has no 2-D convolutions, and channels_last changes only their layout"
        if facts.input_dims != 4:
            return f"inputs have {facts.input_dims} dimensions; channels_last is for 4-D images (N, C, H, W)"
    if label == CUDA_GRAPHS and not info.is_cuda:
        return "CUDA graphs exist only on CUDA"
    if changes.get("compile_mode", "none") != "none":
        try:
            compiler.require_compiler([RunConfig(compile_mode=changes["compile_mode"])], info)
        except OptlabError as error:
            return str(error)
    return None


def code_lines(recommended: RunConfig, device: torch.device) -> list[str]:
    """The lines of serving code for ``recommended``: those run once, then those around every forward."""
    once = ["model.eval()  # always: dropout off, batch-norm statistics frozen"]
    if recommended.channels_last:
        once.append("model = model.to(memory_format=torch.channels_last)")
    if recommended.compile_mode == "default":
        once.append("model = torch.compile(model)")
    elif recommended.compile_mode == "reduce-overhead":
        once.append('model = torch.compile(model, mode="reduce-overhead")  # CUDA graphs')
    each = []
    if recommended.eval_grad_mode == "inference_mode":
        each.append("with torch.inference_mode():  # around the forward")
    if recommended.amp_dtype != "none":
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[recommended.amp_dtype]
        each.append(f'with torch.autocast("{device.type}", dtype=torch.{dtype}):  # around the forward')
    if recommended.channels_last:
        each.append("inputs = inputs.contiguous(memory_format=torch.channels_last)")
    if recommended.compile_mode == "reduce-overhead":
        each.append("outputs = model(inputs).clone()  # a CUDA graph reuses its output memory on the next call")
    return ["# once, where the model is made:", *once] + (["# around every forward:", *each] if each else [])


def device_state(info: DeviceInfo) -> dict[str, Any]:
    """What the device was doing when the run started: threads, the machine's load, on a GPU its free memory and
    the precision switches that fp32 kernels obey."""
    state: dict[str, Any] = {"torch_threads": torch.get_num_threads(),
                             "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                             "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if info.is_cuda:
        free, total = torch.cuda.mem_get_info(info.device)
        state |= {"memory_free_mb": free / 2**20, "memory_total_mb": total / 2**20,
                  "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                  "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32}
    return state


@dataclass
class InferenceResult:
    """What ``tune(..., inference=True)`` returns: one row per step (``steps``), the comparisons' samples and
    summaries, the kept steps and the recommended configuration with its speed-up measured afresh, and the batch-size
    sweep of the starting point and the recommendation (``sweep``, with why each series ended in ``sweep_ends``)."""

    model: str
    steps: pd.DataFrame
    samples: pd.DataFrame
    summary: pd.DataFrame
    kept: list[str]
    start: RunConfig
    recommended: RunConfig
    speedup: float
    ci_low: float
    ci_high: float
    verdict: str
    sweep: pd.DataFrame
    sweep_ends: dict[str, str]
    code: list[str]
    record: dict[str, Any] = field(default_factory=dict)
    path: Any = None

    def table(self) -> pd.DataFrame:
        """The steps as a reader sees them: precision, speed-up over the configuration before, interval, verdict,
        the outputs' change against the tolerance, median call times, the first call (compilation), decision, reason."""
        table = self.steps.copy()
        table[INTERVAL] = ["" if pd.isna(low) else f"{low:.2f}-{high:.2f}" for low, high in zip(table["ci_low"],
                                                                                          table["ci_high"])]
        table["max error"] = [_number(value) for value in table["max_error"]]
        table["top-1"] = ["" if pd.isna(value) else f"{100 * value:.3g} %" for value in table["top1_agreement"]]
        table = table.rename(columns={"speedup": "speed-up", "before_ms": "ms before", "after_ms": "ms after",
                                      "first_call_s": "first call s"})
        columns = ["step", "precision", "speed-up", INTERVAL, "verdict", "max error", "tolerance", "top-1", "ms before",
                   "ms after", "first call s", "decision", "reason"]
        floats = {"speed-up": 2, "ms before": 2, "ms after": 2, "first call s": 2}
        table = table[columns].astype({key: float for key in floats}).round(floats).astype(object).fillna("")
        table.attrs.update(keys=["model", "step"], details=["precision", "tolerance", "ms before", "ms after",
                                                              "first call s"])  # a page collapses these
        return table

    def sweep_table(self) -> pd.DataFrame:
        """Latency and throughput per configuration and batch size."""
        table = self.sweep.rename(columns={"median_ms": "median ms", "p90_ms": "p90 ms", "p99_ms": "p99 ms",
                                           "samples_per_s": "samples/s", "peak_mem_mb": "peak MiB",
                                           "first_call_s": "first call s"})
        floats = {"median ms": 2, "p90 ms": 2, "p99 ms": 2, "samples/s": 1, "peak MiB": 0, "first call s": 2}
        table = table.astype({key: float for key in floats}).round(floats).astype(object).fillna("")
        table.attrs.update(keys=["model", "config", "batch"], details=["calls", "p90 ms", "first call s"])
        return table

    def speedups(self) -> pd.DataFrame:
        """One row per measured step, then the kept steps afresh: ``model``, ``step``, ``speedup``, ``ci_low``,
        ``ci_high``, ``verdict`` (the shape of the training tune's, for the same figure)."""
        columns = ["step", "speedup", "ci_low", "ci_high", "verdict"]
        rows = self.steps.loc[self.steps["speedup"].notna(), columns]
        if self.kept:
            rows = pd.concat([rows, pd.DataFrame([[AFRESH, self.speedup, self.ci_low, self.ci_high, self.verdict]],
                                                 columns=columns)], ignore_index=True)
        return rows.assign(model=self.model)[["model", *columns]].reset_index(drop=True)

    def describe(self) -> str:
        """The recommendation in words, where each batch-size series ended, and the lines of code."""
        if not self.kept:
            head = ("recommendation: no step was clearly faster with unchanged outputs on this model at this batch "
                    "size; serve it in eval mode")
        elif self.verdict == FASTER:
            head = (f"recommendation: {', '.join(self.kept)}: {self.speedup:.2f}x faster than the starting point "
                    f"({INTERVAL} {self.ci_low:.2f}-{self.ci_high:.2f}; measured afresh, all together)")
        else:
            head = (f"recommendation, not confirmed: {', '.join(self.kept)} each looked faster than the step before, "
                    f"but measured afresh against the starting point: {self.speedup:.2f}x ({INTERVAL} {self.ci_low:.2f}-"
                    f"{self.ci_high:.2f}): {self.verdict}. More timed calls or repeats would tell")
        ends = [f"batch sizes, {label}: {end}" for label, end in self.sweep_ends.items()]
        return "\n".join([head, *ends, "the lines to add:", *(f"    {line}" for line in self.code)])


def _number(value: Any) -> str:
    if value is None or pd.isna(value):
        return ""
    return "not finite" if math.isinf(value) else "0" if value == 0 else f"{value:.2g}"


@dataclass
class _Run:
    """What every comparison of one run shares."""

    name: str
    model_fn: ModelFn
    output_fn: OutputFn | None
    inputs: torch.Tensor  # POOL_BATCHES batches of one input shape, on the host
    profile: Profile
    info: DeviceInfo
    flops: int  # one call's forward FLOPs
    seed: int
    bar: tqdm
    reference: torch.Tensor | None = None  # the starting point's outputs on every input batch, on the host


@dataclass
class _Prepared:
    """A configuration ready to time: its model, a forward on a batch on the device, its inputs there, and what its
    first calls showed."""

    model: nn.Module
    forward: Callable[[torch.Tensor], Any]
    inputs: list[torch.Tensor]
    first_call_s: float = math.nan
    outputs: torch.Tensor | None = None


def _forward(model: nn.Module, config: RunConfig, device: torch.device) -> Callable[[torch.Tensor], Any]:
    amp = TORCH_DTYPES[config.amp_dtype]

    def forward(inputs: torch.Tensor) -> Any:
        with loops.backend_flags(config), loops.grad_mode(config.eval_grad_mode), \
                torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            if config.compile_mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            return model(inputs)
    return forward


def _on_device(inputs: torch.Tensor, config: RunConfig, device: torch.device) -> torch.Tensor:
    layout = torch.channels_last if config.channels_last else torch.contiguous_format
    return inputs.to(device).contiguous(memory_format=layout)


def _prepare(run: _Run, config: RunConfig, check: bool = True) -> _Prepared:
    """A fresh model (the same weights for every config) in eval mode, laid out and compiled as ``config`` asks, its
    first call timed apart (a compiled model compiles there) and, if ``check``, its outputs on every input batch."""
    device = run.info.device
    model = build_model(run.model_fn, run.seed)
    model.eval()
    model = loops.prepare_model(model, config, device)
    prepared = _Prepared(model, _forward(model, config, device), [_on_device(x, config, device) for x in run.inputs])
    outputs = []
    for index, inputs in enumerate(prepared.inputs if check else prepared.inputs[:1]):
        started = time.perf_counter()
        output = pick_output(prepared.forward(inputs), run.output_fn)
        outputs.append(output.detach().to("cpu", torch.float32, copy=True))  # a CUDA graph reuses its memory
        if index == 0:
            prepared.first_call_s = time.perf_counter() - started
    prepared.outputs = torch.cat(outputs)
    return prepared


def _runner(prepared: _Prepared, device: torch.device):
    def run_phase(phase: str, profile: Profile, phase_seed: int) -> loops.PhaseResult:
        calls = itertools.islice(itertools.cycle(prepared.inputs), profile.warmup_steps + profile.steps)
        def step(inputs: torch.Tensor, index: int) -> None:
            prepared.forward(inputs)  # the output is dropped: a CUDA graph's would be overwritten by the next call

        result, _ = loops.run_timed(step, calls, device, profile.steps, profile.warmup_steps, (prepared.model,))
        return result
    return run_phase


def _compare(run: _Run, configs: dict[str, RunConfig], comparison: str,
             checked: str | None = None) -> tuple[list[dict], dict[str, _Prepared]]:
    """Every repeat of each config, taking turns: the tidy rows, and each config's first call (and the outputs of
    ``checked``). A config that raises (out of memory, a compile that fails) is recorded, and the other goes on."""
    rows: list[dict[str, Any]] = []
    prepared: dict[str, _Prepared] = {}
    for label, config in configs.items():
        try:
            prepared[label] = _prepare(run, config, check=label == checked)
        except Exception as error:  # noqa: BLE001  (recorded, and the run goes on)
            rows.append(failed_row(TECHNIQUE, run.name, label, 0, PHASE, config, failure_status(error)))
    runners = {label: _runner(state, run.info.device) for label, state in prepared.items()}
    images = {PHASE: len(run.inputs[0]) * run.profile.steps}
    first, *others = configs
    rule = stopping_rule(run.profile, {label: first for label in others}, (PHASE,))
    rows += interleave(runners, configs, (PHASE,), run.profile, run.info, TECHNIQUE, run.name, images, run.seed,
                       run.bar, rule, run.flops).rows
    checks = {label: replace(state, model=None, forward=None, inputs=[]) for label, state in prepared.items()}
    prepared.clear()  # free the models before the next comparison builds its own
    _clean_up(run.info, configs.values())
    return [{**row, "comparison": comparison} for row in rows], checks


def _clean_up(info: DeviceInfo, configs) -> None:
    gc.collect()
    if any(config.compile_mode != "none" for config in configs):
        torch._dynamo.reset()  # the next comparison compiles from a clean slate, with Dynamo's whole recompile limit
    if info.is_cuda:
        torch.cuda.empty_cache()


def _outcome(summary: pd.DataFrame, rows: list[dict[str, Any]], label: str) -> tuple[dict[str, Any], str]:
    """A config's summary row in a comparison, and its failure ("" if it ran every repeat)."""
    failures = [row["status"] for row in rows if row["variant"] == label and row["status"] != "ok"]
    found = summary[(summary["variant"] == label) & (summary["n"] > 0)]
    return (found.iloc[0].to_dict() if len(found) else {}), (failures[0] if failures else "")


def _try_step(run: _Run, before: tuple[str, RunConfig], step: tuple[str, RunConfig]) -> tuple[dict, list, pd.DataFrame]:
    """Time ``step`` against the configuration ``before`` it: the step's row of the table, the samples, the summary."""
    (before_label, before_config), (label, config) = before, step
    rows, checks = _compare(run, {before_label: before_config, label: config}, label, checked=label)
    summary = summarize_runs(pd.DataFrame(rows), before_label).assign(comparison=label)
    (base, base_failed), (after, after_failed) = (_outcome(summary, rows, x) for x in (before_label, label))
    limit = tolerance(config, run.info)
    error, top1 = math.nan, None
    if label in checks:
        error, top1 = output_change(run.reference, checks[label].outputs)
    decision, reason = decide(after.get("verdict", ""), error, top1, limit, base_failed, after_failed)
    row = {"step": label, "precision": precision(config, run.info), "decision": decision,
           "speedup": after.get("speedup"), "ci_low": after.get("ci_low"), "ci_high": after.get("ci_high"),
           "verdict": after_failed or after.get("verdict"), "max_error": error, "tolerance": limit,
           "top1_agreement": top1, "before_ms": base.get("step_ms"), "after_ms": after.get("step_ms"),
           "first_call_s": checks[label].first_call_s if label in checks else None, "reason": reason}
    return row, rows, summary


def _check_sizes(prof: Profile, techniques: Sequence[str] | None, batch_size: int | None, steps: int | None,
                 max_batch: int | None, shape: tuple[int, ...], num_classes: int | None) -> tuple[int, int, int]:
    """Refuse at once what a user typed out of bounds; return the batch size, timed calls and the largest batch."""
    for label in techniques or ():
        if label not in STEP_LABELS:
            raise choice_error("inference step", label, STEP_LABELS)
    per_input = math.prod(shape)
    most = min(MAX_BATCH_SIZE, MAX_BATCH_ELEMENTS // per_input)
    why = f"{MAX_BATCH_ELEMENTS:,} input values a batch: {most} inputs of {list(shape)}"
    batch = check_count("batch_size", batch_size, 1, most, why) if batch_size is not None else \
        min(prof.batch_size, most)
    timed = steps if steps is not None else prof.steps
    if timed is None:
        raise OptlabError(f"profile {prof.name} times whole epochs; tune times a fixed number of calls: pass steps "
                          "(--steps) or use the smoke or quick profile")
    check_count("steps", timed, 1, MAX_STEPS, "timed calls per repeat")
    if max_batch is None:
        max_batch = 2 ** int(math.log2(min(DEFAULT_MAX_BATCH, most)))
    check_count("max_batch", max_batch, 1, most, why)
    if num_classes is not None:
        check_count("num_classes", num_classes, 2, MAX_CLASSES, "outputs per sample")
    return batch, timed, max_batch


def _inputs(shape: tuple[int, ...], batch: int, seed: int) -> torch.Tensor:
    """A few batches of random inputs, made once: every configuration gets the same ones."""
    count = max(1, min(POOL_BATCHES, MAX_BATCH_ELEMENTS // (batch * math.prod(shape))))
    return torch.randn(count, batch, *shape, generator=torch.Generator().manual_seed(seed))


def _sweep_targets(run: _Run, configs: dict[str, RunConfig], shape: tuple[int, ...]) -> dict[str, SweepTarget]:
    targets = {}
    for label, config in configs.items():
        model = loops.prepare_model(build_model(run.model_fn, run.seed).eval(), config, run.info.device)
        forward = _forward(model, config, run.info.device)

        def make_call(batch: int, forward=forward, config=config) -> Callable[[], object]:
            generator = torch.Generator().manual_seed(run.seed + batch)
            inputs = _on_device(torch.randn(batch, *shape, generator=generator), config, run.info.device)

            def call() -> None:
                forward(inputs)
            return call
        targets[label] = SweepTarget(make_call, (model,))
    return targets


def tune_inference(
    model_fn: ModelFn,
    *,
    input_shape: Sequence[int] | None,
    num_classes: int | None = None,
    output_fn: OutputFn | None = None,
    batch_size: int | None = None,
    max_batch: int | None = None,
    amp_dtype: str = "auto",
    sweep_compile: bool = False,
    device: str = "auto",
    profile: str | Profile | None = None,
    steps: int | None = None,
    techniques: Sequence[str] | None = None,
    name: str | None = None,
    out: Any = None,
    seed: int = 0,
    progress: bool = True,
) -> InferenceResult:
    """The inference stack on the model that ``model_fn`` builds, one step at a time, then its batch sizes.

    ``input_shape``: one input's shape, without the batch dimension (inputs are random normal). ``output_fn(output)``
    picks the tensor to compare from a model that returns something else (a dict, a tuple); ``num_classes``, if
    given, is checked against a classifier's outputs. ``batch_size`` (the comparisons') and ``steps`` (timed calls per
    repeat) default to the profile's; ``max_batch`` bounds the batch-size series (default 1024); ``amp_dtype`` is
    ``auto`` (bf16 where native, else fp16), ``bf16``, ``fp16`` or ``none``; ``techniques`` names the steps to try.
    The sweep runs the recommendation without ``torch.compile`` unless ``sweep_compile``: a compiled model compiles
    every new batch size again (tens of seconds each on a CPU). ``out``: a folder for the record.
    """
    info = resolve_device(device)
    prof = get_profile(profile, info.is_cuda)
    if input_shape is None:
        raise OptlabError("give input_shape, one input's shape without the batch dimension, such as (3, 224, 224)")
    shape = check_shape(input_shape)
    batch, timed, max_batch = _check_sizes(prof, techniques, batch_size, steps, max_batch, shape, num_classes)
    dtype, autocast_skip = autocast_dtype(amp_dtype, info)
    if output_fn is not None and not callable(output_fn):
        raise OptlabError(f"output_fn must be a function of the model's output, got a {type(output_fn).__name__}")
    out_dir = store.writable_dir(out) if out is not None else None
    name = name or model_name(model_fn)
    inputs = _inputs(shape, batch, seed)
    facts = probe(model_fn, inputs[0], output_fn, num_classes, info.device, seed)
    prof = replace(prof, models=(name,), batch_size=batch, steps=timed, test_steps=timed, num_workers=0)
    start, notes = effective_config(RunConfig(batch_size=batch, num_workers=0, pin_memory=False,
                                              eval_grad_mode="grad"), info)
    plan = [(label, changes, skip_reason(label, changes, info, facts, autocast_skip)
             if techniques is None or label in techniques else "not among the techniques asked for")
            for label, changes in stack_changes(dtype)]
    measured = sum(1 for _, _, reason in plan if reason is None)
    bar = tqdm(total=2 * (prof.warmup_repeats + prof.repeats) * (measured + 1), desc=f"tune --inference {name}",
               disable=not progress, file=sys.stderr, leave=False)
    run = _Run(name, model_fn, output_fn, inputs, prof, info, int(facts.forward_flops_per_sample * batch), seed, bar)
    description = f"synthetic inputs: {len(inputs)} batches of {batch} x {list(shape)} (random normal), made once"
    _print_header(run, facts, description, max_batch)
    run.reference = _prepare(run, start).outputs  # the starting point's outputs; also its untimed warm-up
    if bool((run.reference == run.reference[:1]).all()):
        notes.append("the starting point gives every input the same output (a head initialised at zero?), so the "
                     "output check cannot see a change: build the model with trained weights, or a random head")
    _clean_up(info, [start])

    table, rows, summaries, kept, current = [], [], [], [], (START, start)
    for label, changes, reason in plan:
        if reason:
            table.append({"step": label, "decision": "skipped", "reason": reason})
            continue
        candidate, candidate_notes = effective_config(apply_changes(current[1], changes), info)
        notes += candidate_notes
        row, step_rows, summary = _try_step(run, current, (label, candidate))
        table.append(row)
        rows += step_rows
        summaries.append(summary)
        if row["decision"] == "kept":
            kept.append(label)
            current = (label, candidate)
    recommended = current[1]
    final = {"speedup": 1.0, "ci_low": 1.0, "ci_high": 1.0, "verdict": "baseline"}
    if kept:
        afresh_rows, _ = _compare(run, {START: start, FINAL: recommended}, FINAL)
        summary = summarize_runs(pd.DataFrame(afresh_rows), START).assign(comparison=FINAL)
        rows += afresh_rows
        summaries.append(summary)
        found, failed = _outcome(summary, afresh_rows, FINAL)
        final = {key: found.get(key, math.nan) for key in final} | ({"verdict": failed} if failed else {})
    bar.close()

    swept = {START: start}
    if kept:
        if recommended.compile_mode != "none" and not sweep_compile:
            swept[f"{FINAL} without torch.compile"] = replace(recommended, compile_mode="none")
            notes.append("the batch-size sweep runs the recommendation without torch.compile: a compiled model "
                         "compiles every new batch size again (sweep_compile=True, --sweep-compile, includes it)")
        else:
            swept[FINAL] = recommended
    sweep_bar = tqdm(desc="batch sizes", disable=not progress, file=sys.stderr, leave=False)
    calls = max(SWEEP_CALLS, 5 * timed)
    sweep_rows, ends = sweep(_sweep_targets(run, swept, shape), info.device, max_batch, calls,
                             max(2, prof.warmup_steps), SWEEP_SECONDS_PER_CALL * calls, sweep_bar.update)
    sweep_bar.close()
    _clean_up(info, swept.values())
    notes = sorted(set(notes))
    for note in notes:
        print(f"note: {note}")

    result = InferenceResult(
        model=name, steps=pd.DataFrame(table, columns=STEP_COLUMNS), samples=pd.DataFrame(rows),
        summary=pd.concat(summaries, ignore_index=True) if summaries else pd.DataFrame(), kept=kept, start=start,
        recommended=recommended, speedup=float(final["speedup"]), ci_low=float(final["ci_low"]),
        ci_high=float(final["ci_high"]), verdict=str(final["verdict"]), sweep=sweep_rows, sweep_ends=ends,
        code=code_lines(recommended, info.device))
    result.record = _record(result, prof, info, description, facts, notes, max_batch)
    if out_dir is not None:
        result.path = store.save_record(result.record, out_dir)
        print(f"wrote {store.display_path(result.path)}")
    return result


def _print_header(run: _Run, facts: InferenceProbe, description: str, max_batch: int) -> None:
    prof = run.profile
    print(f"optlab tune --inference {run.name}: {facts.parameters / 1e6:.3g} M parameters, "
          f"{facts.forward_flops_per_sample / 1e9:.3g} GFLOP per sample, outputs of {list(facts.output_shape)} "
          "per sample")
    print(f"profile {prof.name}: batch {prof.batch_size}; {prof.warmup_steps} warm-up + {prof.steps} timed calls; "
          f"{prof.describe_repeats()} per configuration, taking turns")
    print(f"device: {run.info.describe()}")
    print(f"data: {description}")
    print(f"starting point: model.eval(), fp32, eager, autograd on. Output check against its outputs on the same "
          f"inputs: relative error within {OUTPUT_TOLERANCE['fp32']:g} in fp32, {OUTPUT_TOLERANCE['tf32']:g} with "
          f"TF32, {OUTPUT_TOLERANCE['16-bit']:g} in 16-bit, and the top-1 class changed on no larger a share")
    print(f"peak memory: the {memory_kind(run.info.device)}")
    print(f"batch sizes: 1, 2, 4, ... up to {max_batch}, until memory runs out or {PLATEAU_DOUBLINGS} doublings in a "
          f"row gain {round(100 * PLATEAU_GAIN)} % or less in throughput")


def _knobs(config: RunConfig) -> dict[str, Any]:
    """The knobs inference reads (the training ones and optlab's own model fields left out)."""
    keys = ("batch_size", "eval_grad_mode", "amp_dtype", "channels_last", "compile_mode", "cudnn_tf32", "matmul_tf32")
    return {key: getattr(config, key) for key in keys}


def _json_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return json.loads(frame.to_json(orient="records")) if not frame.empty else []


def _record(result: InferenceResult, prof: Profile, info: DeviceInfo, description: str, facts: InferenceProbe,
            notes: list[str], max_batch: int) -> dict[str, Any]:
    """The run as a record that the store saves and ``load_samples`` reads back."""
    return {
        "schema_version": store.SCHEMA_VERSION,
        "technique": TECHNIQUE,
        "title": f"optlab tune --inference: the inference stack, one step at a time, on {result.model}",
        "model": result.model,
        "profile": store.profile_record(prof),
        "environment": capture(info, description, prof.name),
        "device_state": device_state(info),
        "parameters": facts.parameters,
        "forward_flops_per_sample": facts.forward_flops_per_sample,
        "output_shape": list(facts.output_shape),
        "output_tolerance": OUTPUT_TOLERANCE,
        "notes": notes,
        "memory_kind": memory_kind(info.device),
        "start": _knobs(result.start),
        "recommended": _knobs(result.recommended),
        "kept": result.kept,
        "speedup": {"ratio": result.speedup, "ci_low": result.ci_low, "ci_high": result.ci_high,
                    "verdict": result.verdict},
        "code": result.code,
        "steps": _json_rows(result.steps),
        "samples": _json_rows(result.samples),
        "summary": _json_rows(result.summary),
        "sweep": {"max_batch": max_batch, "plateau_gain": PLATEAU_GAIN, "plateau_doublings": PLATEAU_DOUBLINGS,
                  "ends": result.sweep_ends, "rows": _json_rows(result.sweep)},
    }
