"""``optlab tune --inference``: the inference stack, one step at a time, on the reader's model, then its batch sizes.

The starting point is the model as most code first serves it: ``model.eval()``, fp32, eager, autograd on. ``eval()``
is always on, not a step: dropout and batch statistics would change the answers, so it is a matter of correctness,
never of speed. Each step is tried on top of the configuration kept so far and timed against it with the training
tune's machinery (the two take turns, repeat after repeat; the speed-up, its interval and verdict follow the same
rule), and kept only if it was faster and left the outputs where they were: on the same inputs, its outputs against
the starting point's (fp32 eager), within a tolerance per precision, and for scores over classes (a classifier's, or
a token model's per token) their top-1 choices. The inputs are of any kind (:mod:`.examples`). The kept steps are
then timed afresh against the starting point, and both configurations are swept over batch sizes for their
throughput and timed one request at a time for their request latency (:mod:`.batch_sweep`). A compiled model's
first call (its compilation) is timed apart, never inside the comparison.
"""
from __future__ import annotations

import gc
import itertools
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from ...core.machine import compiler, machine_load
from ...core.measuring import loops
from ...core.results import store
from ...core.knobs.config import RunConfig, apply_changes
from ...core.measuring.loops import Inputs
from ...core.machine.device import (
    TORCH_DTYPES, DeviceInfo, effective_config, native_bf16, native_fp16, resolve_device,
)
from ...core.machine.environment import capture
from ...core.errors import OptlabError, choice_error
from ...core.run.experiments import failure_status, interleave, stopping_rule
from ...core.run.progress import finish, progress_bar
from ...core.knobs.limits import MAX_STEPS, check_count
from ...core.measuring.memory import memory_kind
from ...core.knobs.profiles import Profile, get_profile
from ...core.measuring.samples import failed_row
from ...core.stats.summary import summarize_runs
from ...core.measuring.timing import INTERVAL, interval_text
from .batch_sweep import (
    MAX_REQUEST_SECONDS, MIN_REQUESTS, OUT_OF_MEMORY, PLATEAU_DOUBLINGS, PLATEAU_GAIN, REQUEST_SECONDS,
    REQUEST_WARMUP, LATENCY_COLUMNS, Served, SweepTarget, doubling_series, sweep,
)
from .examples import Examples, examples_from
from .recommendation import (
    AFRESH, FINAL, NOTHING_KEPT, START, Recommendation, decision_before_the_check, json_rows, recommendation_record,
)
from .output_check import (
    OUTPUT_TOLERANCE, OutputFn, output_change, pick_output, precision, tolerance, within_tolerance,
)
from .examples import MAX_CLASSES, describe_inputs
from .inputs import (
    POOL_BATCHES, POOL_BYTES, ModelFn, batch_does_not_fit, batch_limit, build_model, check_batch,
    check_seconds, describe_error, first_inputs, model_name,
)

TECHNIQUE = "tune-inference"
PHASE = "test"
INFERENCE_MODE, AUTOCAST, CHANNELS_LAST, COMPILE, CUDA_GRAPHS = (
    "+ torch.inference_mode", "+ 16-bit autocast", "+ channels_last", "+ torch.compile",
    "+ CUDA graphs (reduce-overhead)")
STEP_LABELS = (INFERENCE_MODE, AUTOCAST, CHANNELS_LAST, COMPILE, CUDA_GRAPHS)
AMP_CHOICES = ("auto", "bf16", "fp16", "none")
DEFAULT_MAX_BATCH = 1024
MAX_REQUEST_BATCHES = 8  # batch sizes whose request latency is timed
SWEEP_CALLS = 10  # timed calls per batch size, at most, or 5 per timed step of the profile if that is more
SWEEP_SECONDS_PER_CALL = 0.05  # a batch size's time budget: 0.5 s for 10 calls (at least 5 calls are timed)
STEP_COLUMNS = ["step", "precision", "decision", "speedup", "ci_low", "ci_high", "verdict", "max_error",
                "tolerance", "top1_agreement", "before_ms", "after_ms", "first_call_s", "reason"]

def decide(verdict: str, error: float, top1: float | None, limit: float, before_failed: str = "",
           after_failed: str = "") -> tuple[str, str]:
    """Whether a measured step is kept, and why not: only if its verdict is "faster" and its outputs are within
    ``limit`` of the starting point's."""
    if (undecided := decision_before_the_check(verdict, before_failed, after_failed)) is not None:
        return undecided
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


def probe(model_fn: ModelFn, inputs: Inputs, output_fn: OutputFn | None, num_classes: int | None,
          device: torch.device, seed: int) -> InferenceProbe:
    """Build the model, put it in eval mode and run it on two samples, counting the FLOPs; every way this can fail
    is one OptlabError."""
    model = build_model(model_fn, seed)
    try:
        model.eval()
    except Exception as error:  # noqa: BLE001  (the user's model: its error, in one line)
        raise OptlabError(f"the model cannot run in eval mode: model.eval() failed: {describe_error(error)}") from None
    model = model.to(device)
    sample = loops.inputs_to(loops.map_inputs(lambda t: t[:2], inputs), device)
    samples = len(loops.input_tensors(sample)[0])
    shape = str(list(sample.shape)) if isinstance(sample, torch.Tensor) else describe_inputs(sample)
    from torch.utils.flop_counter import FlopCounterMode  # on first use: it imports triton, 0.4 s a process

    try:
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            raw = loops.call_model(model, sample)
    except Exception as error:  # noqa: BLE001
        raise OptlabError(f"the model failed a forward pass in eval mode on inputs of shape {shape}: "
                          f"{describe_error(error)}") from None
    output = pick_output(raw, output_fn)
    if not output.is_floating_point():
        raise OptlabError(f"the output to compare is a tensor of {output.dtype}; outputs are compared within a "
                          "tolerance, so give the floating-point one (logits, not classes), with output_fn if needed")
    if output.dim() == 0 or output.shape[0] != samples:
        raise OptlabError(f"the output's first dimension must be the batch: {samples} samples gave an output of "
                          f"shape {list(output.shape)}")
    if num_classes is not None and output.dim() == 2 and output.shape[1] != num_classes:
        raise OptlabError(f"the model gives {output.shape[1]} outputs per sample, but num_classes is {num_classes}: "
                          "pass the model's own (or leave it out)")
    return InferenceProbe(counter.get_total_flops() / samples, sum(p.numel() for p in model.parameters()),
                          any(isinstance(m, nn.Conv2d) for m in model.modules()),
                          loops.input_tensors(sample)[0].dim(), tuple(output.shape[1:]))


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


def call_code(inputs: Inputs) -> str:
    """How a reader's code calls the model on inputs of this kind."""
    if isinstance(inputs, dict):
        return "model(**inputs)"
    return "model(*inputs)" if isinstance(inputs, (tuple, list)) else "model(inputs)"


def code_lines(recommended: RunConfig, device: torch.device, call: str = "model(inputs)") -> list[str]:
    """The lines of serving code for ``recommended``, runnable as they stand where ``model`` and ``inputs`` (on the
    device) are your own: those run once, then one forward (``call``), inside the context managers it needs."""
    once = ["model.eval()  # always: dropout off, batch-norm statistics frozen"]
    if recommended.channels_last:
        once.append("model = model.to(memory_format=torch.channels_last)")
    if recommended.compile_mode == "default":
        once.append("model = torch.compile(model)")
    elif recommended.compile_mode == "reduce-overhead":
        once.append('model = torch.compile(model, mode="reduce-overhead")  # CUDA graphs')
    contexts = []
    if recommended.eval_grad_mode == "inference_mode":
        contexts.append("with torch.inference_mode():")
    if recommended.amp_dtype != "none":
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[recommended.amp_dtype]
        contexts.append(f'with torch.autocast("{device.type}", dtype=torch.{dtype}):')
    body = []
    if recommended.channels_last:
        body.append("inputs = inputs.contiguous(memory_format=torch.channels_last)")
    if recommended.compile_mode == "reduce-overhead":
        body.append(f"outputs = {call}.clone()  # a CUDA graph reuses its output memory on the next call")
    else:
        body.append(f"outputs = {call}")
    forward = [f"{'    ' * depth}{line}" for depth, line in enumerate(contexts)] + \
        [f"{'    ' * len(contexts)}{line}" for line in body]
    return ["# once, where the model is made:", *once, "# every forward:", *forward]


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


@dataclass(kw_only=True)
class InferenceResult(Recommendation):
    """What ``tune(..., inference=True)`` returns (:class:`~optlab.studies.tune.recommendation.Recommendation`): one
    row per step, the comparisons' samples and summaries, the kept steps and the recommended configuration with its
    speed-up measured afresh; then the throughput of the starting point and the recommendation across batch sizes
    (``sweep``, with why each series ended in ``sweep_ends``) and their request latency (``latency``)."""

    sweep: pd.DataFrame
    sweep_ends: dict[str, str]
    latency: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=LATENCY_COLUMNS))

    def table(self) -> pd.DataFrame:
        """The steps as a reader sees them: precision, speed-up over the configuration before, interval, verdict,
        the outputs' change against the tolerance, median call times, the first call (compilation), decision, reason."""
        table = self.steps.copy()
        table[INTERVAL] = [interval_text(low, high) for low, high in zip(table["ci_low"], table["ci_high"])]
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
        """Throughput per configuration and batch size: back-to-back calls on inputs already on the device."""
        table = self.sweep.rename(columns={"call_ms": "ms per call, back-to-back",
                                           "samples_per_s": "throughput, samples/s", "peak_mem_mb": "peak MiB",
                                           "graph_pool_mb": "graph pool MiB", "first_call_s": "first call s"})
        floats = {"ms per call, back-to-back": 2, "throughput, samples/s": 1, "peak MiB": 0, "graph pool MiB": 0,
                  "first call s": 2}
        table = table.astype({key: float for key in floats}).round(floats).astype(object).fillna("")
        table.attrs.update(keys=["model", "config", "batch"], details=["calls", "graph pool MiB", "first call s"])
        return table

    def latency_table(self) -> pd.DataFrame:
        """Request latency per configuration and batch size: one request at a time, its copy in, call, copy out and
        synchronisation, as p50, p90, p99 and the spread (interquartile range), in ms."""
        table = self.latency.rename(columns={"p50_ms": "request p50 ms", "p90_ms": "request p90 ms",
                                             "p99_ms": "request p99 ms", "iqr_ms": "spread (IQR) ms",
                                             "seconds": "timed s"})
        floats = {"request p50 ms": 3, "request p90 ms": 3, "request p99 ms": 3, "spread (IQR) ms": 3, "timed s": 1}
        table = table.astype({key: float for key in floats}).round(floats).astype(object).fillna("")
        table.attrs.update(keys=["model", "config", "batch"], details=["requests", "timed s"])
        return table

    def describe(self) -> str:
        """The recommendation in words, the request latency at batch 1, where each batch-size series ended, and the
        lines of code."""
        head = self.headline("recommendation: no step was clearly faster with unchanged outputs on this model at "
                             "this batch size; serve it in eval mode", "More timed calls or repeats would tell")
        single = self.latency[(self.latency["batch"] == 1) & (self.latency["status"] == "ok")]
        latency = [f"request latency at batch 1, {row.config}: p50 {row.p50_ms:.3g} ms, p90 {row.p90_ms:.3g} ms, "
                   f"p99 {row.p99_ms:.3g} ms ({row.requests} requests, one at a time, copy in and out included)"
                   for row in single.itertuples()]
        ends = [f"throughput across batch sizes, {label}: {end}" for label, end in self.sweep_ends.items()]
        return "\n".join([head, *latency, *ends, *self.code_block("the lines to add:")])


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
    inputs: list[Inputs]  # a few batches of the model's inputs, on the host
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
    forward: Callable[[Inputs], Any]
    inputs: list[Inputs]
    first_call_s: float = math.nan
    outputs: torch.Tensor | None = None


def _forward(model: nn.Module, config: RunConfig, device: torch.device) -> Callable[[Inputs], Any]:
    amp = TORCH_DTYPES[config.amp_dtype]

    def forward(inputs: Inputs) -> Any:
        with loops.backend_flags(config), loops.grad_mode(config.eval_grad_mode), \
                torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            if config.compile_mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            return loops.call_model(model, inputs)
    return forward


def _on_device(inputs: Inputs, config: RunConfig, device: torch.device) -> Inputs:
    return loops.inputs_to(inputs, device, config.channels_last)


def _prepare(run: _Run, config: RunConfig, check: bool = True) -> _Prepared:
    """A fresh model (the same weights for every config) in eval mode, laid out and compiled as ``config`` asks, its
    first call timed apart (a compiled model compiles there) and, if ``check``, its outputs on every input batch."""
    device = run.info.device
    model = build_model(run.model_fn, run.seed)
    model.eval()
    model = loops.prepare_model(model, config, device)
    prepared = _Prepared(model, _forward(model, config, device), [_on_device(x, config, device) for x in run.inputs])
    outputs = []
    with loops.graph_pool_tally(model, config, device).run():  # the first calls record the config's graphs
        for index, inputs in enumerate(prepared.inputs if check else prepared.inputs[:1]):
            started = time.perf_counter()
            output = pick_output(prepared.forward(inputs), run.output_fn)
            outputs.append(output.detach().to("cpu", torch.float32, copy=True))  # a CUDA graph reuses its memory
            if index == 0:
                prepared.first_call_s = time.perf_counter() - started
    prepared.outputs = torch.cat(outputs)
    return prepared


def _reference_outputs(run: _Run, start: RunConfig) -> torch.Tensor:
    """The starting point's outputs on every input batch (its untimed warm-up too); a batch that does not fit, or
    a model that fails at this batch size, ends the tune in one line: every step is timed against it."""
    batch = len(loops.input_tensors(run.inputs[0])[0])
    try:
        return _prepare(run, start).outputs
    except Exception as error:  # noqa: BLE001  (the user's model at this batch size: one line)
        failure = describe_error(error)
    _clean_up(run.info, [start])  # out of the except block: the error's frames and the batch's tensors are gone
    if failure == OUT_OF_MEMORY:
        raise batch_does_not_fit("the starting point", batch, run.info.device)
    raise OptlabError(f"the starting point failed at batch {batch}: {failure}")


def _runner(prepared: _Prepared, config: RunConfig, device: torch.device):
    def run_phase(phase: str, profile: Profile, phase_seed: int) -> loops.PhaseResult:
        calls = itertools.islice(itertools.cycle(prepared.inputs), profile.warmup_steps + profile.steps)

        def step(inputs: Inputs, index: int) -> None:
            prepared.forward(inputs)  # the output is dropped: a CUDA graph's would be overwritten by the next call

        pool = loops.graph_pool_tally(prepared.model, config, device)
        with pool.run():
            result, _ = loops.run_timed(step, calls, device, profile.steps, profile.warmup_steps, (prepared.model,))
        return loops.count_graph_pool(result, pool)  # recorded in the first calls, replayed in every repeat
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
    runners = {label: _runner(state, configs[label], run.info.device) for label, state in prepared.items()}
    images = {PHASE: len(loops.input_tensors(run.inputs[0])[0]) * run.profile.steps}
    first, *others = configs
    rule = stopping_rule(run.profile, {label: first for label in others}, (PHASE,))
    started = run.bar.n
    rows += interleave(runners, configs, (PHASE,), run.profile, run.info, TECHNIQUE, run.name, images, run.seed,
                       run.bar, rule, run.flops).rows
    # a config that failed to start ran no rounds: the bar moves past them
    finish(run.bar, len(configs) * (run.profile.warmup_repeats + run.profile.max_repeats), run.bar.n - started)
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
                 max_batch: int | None, examples: Examples, device: torch.device,
                 num_classes: int | None) -> tuple[int, int, int]:
    """Refuse at once what a user typed out of bounds, or a batch beyond what ``device`` can hold
    (:func:`~.inputs.batch_limit`); return the batch size, timed calls and the largest batch."""
    for label in techniques or ():
        if label not in STEP_LABELS:
            raise choice_error("inference step", label, STEP_LABELS)
    most, why = batch_limit(examples, device)
    batch = check_batch("batch_size", batch_size, examples, device) if batch_size is not None else \
        min(prof.batch_size, most)
    timed = steps if steps is not None else prof.steps
    if timed is None:
        raise OptlabError(f"profile {prof.name} times whole epochs; tune times a fixed number of calls: pass steps "
                          "(--steps) or use the smoke or quick profile")
    check_count("steps", timed, 1, MAX_STEPS, "timed calls per repeat")
    if max_batch is None:
        max_batch = 1 << (min(DEFAULT_MAX_BATCH, most).bit_length() - 1)  # the largest power of 2 within both
    check_count("max_batch", max_batch, 1, most, why)
    if num_classes is not None:
        check_count("num_classes", num_classes, 2, MAX_CLASSES, "outputs per sample")
    return batch, timed, max_batch


def _check_request_batches(batches: Sequence[int], examples: Examples, device: torch.device) -> list[int]:
    """The batch sizes whose request latency is timed, each within bounds, in order, without repeats."""
    batches = sorted(set(batches))
    if not 1 <= len(batches) <= MAX_REQUEST_BATCHES:
        raise OptlabError(f"request_batches must name 1 to {MAX_REQUEST_BATCHES} batch sizes, got {len(batches)}")
    for batch in batches:
        check_batch("each request batch size", batch, examples, device)
    return batches


def _inputs(examples: Examples, batch: int) -> list[Inputs]:
    """A few batches of inputs, made once: every configuration gets the same ones."""
    count = max(1, min(POOL_BATCHES, POOL_BYTES // (batch * examples.bytes_per_sample)))
    return [examples.make(batch, index)[0] for index in range(count)]


def _sweep_targets(run: _Run, configs: dict[str, RunConfig], examples: Examples) -> dict[str, SweepTarget]:
    """Each configuration as the sweep loads it: a fresh model on the device, alone there while it is swept."""
    def target(config: RunConfig) -> SweepTarget:
        def load() -> Served:
            model = loops.prepare_model(build_model(run.model_fn, run.seed).eval(), config, run.info.device)
            return Served(_forward(model, config, run.info.device),
                          lambda inputs: _on_device(inputs, config, run.info.device), (model,),
                          run.info.is_cuda and compiler.uses_cuda_graphs(config))
        return SweepTarget(load, lambda batch: examples.make(batch, 0)[0])
    return {label: target(config) for label, config in configs.items()}


@dataclass
class _Walk:
    """The walk up the inference stack: the table's rows, every comparison's samples and summary, the kept steps, the
    configuration they make, and the kept steps measured afresh against the starting point."""

    current: tuple[str, RunConfig]
    table: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    summaries: list[pd.DataFrame] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=lambda: {"speedup": 1.0, "ci_low": 1.0, "ci_high": 1.0,
                                                           "verdict": "baseline"})


def _walk(run: _Run, plan: list[tuple[str, dict[str, Any], str | None]], start: RunConfig,
          notes: list[str]) -> _Walk:
    """The starting point's outputs (:func:`_reference_outputs`), then each step of ``plan`` on top of the
    configuration kept so far (skipped with its reason, or timed and checked), then the kept steps afresh."""
    run.reference = _reference_outputs(run, start)
    if bool((run.reference == run.reference[:1]).all()):
        notes.append("the starting point gives every input the same output (a head initialised at zero?), so the "
                     "output check cannot see a change: build the model with trained weights, or a random head")
    _clean_up(run.info, [start])
    walk = _Walk((START, start))
    for label, changes, reason in plan:
        if reason:
            walk.table.append({"step": label, "decision": "skipped", "reason": reason})
            continue
        candidate, candidate_notes = effective_config(apply_changes(walk.current[1], changes), run.info)
        notes += candidate_notes
        row, step_rows, summary = _try_step(run, walk.current, (label, candidate))
        walk.table.append(row)
        walk.rows += step_rows
        walk.summaries.append(summary)
        if row["decision"] == "kept":
            walk.kept.append(label)
            walk.current = (label, candidate)
    if walk.kept:
        afresh_rows, _ = _compare(run, {START: start, FINAL: walk.current[1]}, FINAL)
        summary = summarize_runs(pd.DataFrame(afresh_rows), START).assign(comparison=FINAL)
        walk.rows += afresh_rows
        walk.summaries.append(summary)
        found, failed = _outcome(summary, afresh_rows, FINAL)
        walk.final = {key: found.get(key, math.nan) for key in walk.final} | ({"verdict": failed} if failed else {})
    return walk


def tune_inference(
    model_fn: ModelFn,
    *,
    input_shape: Sequence[int] | None = None,
    inputs: Any = None,
    data: DataLoader | Dataset | None = None,
    num_classes: int | None = None,
    output_fn: OutputFn | None = None,
    request_seconds: float = REQUEST_SECONDS,
    request_batches: Sequence[int] = (1,),
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

    The inputs: ``input_shape``, one input's shape without the batch dimension (random normal); or ``inputs``, an
    example batch (a tensor, a tuple of tensors, a dict of keyword tensors) or descriptions such as
    ``"tokens:32000:128:mask"``; or the first batch of ``data`` (a DataLoader or a map-style dataset). A batch size
    scales the example's first dimension. ``output_fn(output)`` picks the tensor to compare from a model that returns
    something else (default: a dict's ``logits``, a tuple's first tensor); ``num_classes``, if given, is checked
    against a classifier's outputs. ``batch_size`` (the comparisons') and ``steps`` (timed calls per repeat) default
    to the profile's; ``max_batch`` bounds the batch-size series (default 1024); ``amp_dtype`` is
    ``auto`` (bf16 where native, else fp16), ``bf16``, ``fp16`` or ``none``; ``techniques`` names the steps to try.
    The sweep runs the recommendation without ``torch.compile`` unless ``sweep_compile``: a compiled model compiles
    every new batch size again (tens of seconds each on a CPU). Request latency (one request at a time, at batch 1
    and each of ``request_batches``) is timed for at least ``request_seconds`` and 30 requests. ``out``: a folder
    for the record. A batch the starting point runs out of memory on, or fails on, ends the tune in one
    :class:`~optlab.OptlabError`; a step, or a point of the sweep, that runs out of memory is recorded as such.
    """
    info = resolve_device(device)
    prof = get_profile(profile, info.is_cuda)
    if data is not None:
        if input_shape is not None or inputs is not None:
            raise OptlabError("give data= or input_shape or inputs, not more than one")
        inputs = first_inputs(data, prof.batch_size)
    examples = examples_from(inputs, None, input_shape, None, seed)
    batch, timed, max_batch = _check_sizes(prof, techniques, batch_size, steps, max_batch, examples, info.device,
                                           num_classes)
    check_seconds("request_seconds", request_seconds, MAX_REQUEST_SECONDS)
    request_batches = _check_request_batches(request_batches, examples, info.device)
    dtype, autocast_skip = autocast_dtype(amp_dtype, info)
    if output_fn is not None and not callable(output_fn):
        raise OptlabError(f"output_fn must be a function of the model's output, got a {type(output_fn).__name__}")
    out_dir = store.writable_dir(out) if out is not None else None
    name = name or model_name(model_fn)
    pool = _inputs(examples, batch)
    facts = probe(model_fn, pool[0], output_fn, num_classes, info.device, seed)
    prof = replace(prof, models=(name,), batch_size=batch, steps=timed, test_steps=timed, num_workers=0)
    start, notes = effective_config(RunConfig(batch_size=batch, num_workers=0, pin_memory=False,
                                              eval_grad_mode="grad"), info)
    plan = [(label, changes, skip_reason(label, changes, info, facts, autocast_skip)
             if techniques is None or label in techniques else "not among the techniques asked for")
            for label, changes in stack_changes(dtype)]
    measured = sum(1 for _, _, reason in plan if reason is None)
    bar = progress_bar(2 * (prof.warmup_repeats + prof.max_repeats) * (measured + 1), f"tune --inference {name}",
                       progress)
    run = _Run(name, model_fn, output_fn, pool, prof, info, int(facts.forward_flops_per_sample * batch), seed, bar)
    description = f"{examples.description}: {len(pool)} batches of {batch}, made once"
    _print_header(run, facts, description, max_batch, request_batches, request_seconds)
    try:  # a line that ends the run is not printed on the bar's
        walked = _walk(run, plan, start, notes)
        if not walked.kept:
            finish(bar, bar.total, bar.n, NOTHING_KEPT)
    finally:
        bar.close()
    table, rows, summaries, kept, final = walked.table, walked.rows, walked.summaries, walked.kept, walked.final
    recommended = walked.current[1]

    swept = {START: start}
    if kept:
        if recommended.compile_mode != "none" and not sweep_compile:
            swept[f"{FINAL} without torch.compile"] = replace(recommended, compile_mode="none")
            notes.append("the batch-size sweep runs the recommendation without torch.compile: a compiled model "
                         "compiles every new batch size again (sweep_compile=True, --sweep-compile, includes it)")
        else:
            swept[FINAL] = recommended
    # each configuration to the largest batch: a series that stops early says why on the bar
    sweep_bar = progress_bar(len(swept) * len(doubling_series(max_batch)), "batch sizes", progress)
    calls = max(SWEEP_CALLS, 5 * timed)
    try:
        sweep_rows, ends, latency = sweep(_sweep_targets(run, swept, examples), info.device, max_batch, calls,
                                          max(2, prof.warmup_steps), SWEEP_SECONDS_PER_CALL * calls,
                                          sweep_bar, request_batches, request_seconds)
    finally:
        sweep_bar.close()
    _clean_up(info, swept.values())
    timed_calls = [t for row in rows if row.get("status") == "ok" for t in row["step_times_s"]]
    notes += [note] if (note := machine_load.tick_note(timed_calls)) else []
    notes = sorted(set(notes))
    for note in notes:
        print(f"note: {note}")

    result = InferenceResult(
        model=name, steps=pd.DataFrame(table, columns=STEP_COLUMNS), samples=pd.DataFrame(rows),
        summary=pd.concat(summaries, ignore_index=True) if summaries else pd.DataFrame(), kept=kept, start=start,
        recommended=recommended, speedup=float(final["speedup"]), ci_low=float(final["ci_low"]),
        ci_high=float(final["ci_high"]), verdict=str(final["verdict"]), sweep=sweep_rows, sweep_ends=ends,
        latency=latency, code=code_lines(recommended, info.device, call_code(pool[0])))
    result.record = _record(result, prof, info, description, facts, notes, max_batch, request_seconds)
    if out_dir is not None:
        result.path = store.save_record(result.record, out_dir)
        print(f"wrote {store.display_path(result.path)}")
    return result


def _print_header(run: _Run, facts: InferenceProbe, description: str, max_batch: int, request_batches: list[int],
                  request_seconds: float) -> None:
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
    print(f"throughput (back-to-back calls, inputs on the device) at batch sizes 1, 2, 4, ... up to {max_batch}, "
          f"until memory runs out or {PLATEAU_DOUBLINGS} doublings in a row gain {round(100 * PLATEAU_GAIN)} % or less")
    print(f"request latency (one request at a time: copy in, call, copy out, synchronise) at batch "
          f"{', '.join(str(b) for b in request_batches)}: {REQUEST_WARMUP} untimed, then at least "
          f"{MIN_REQUESTS} requests and {request_seconds:g} s; p50, p90, p99 and the spread")


def _knobs(config: RunConfig) -> dict[str, Any]:
    """The knobs inference reads (the training ones and optlab's own model fields left out)."""
    keys = ("batch_size", "eval_grad_mode", "amp_dtype", "channels_last", "compile_mode", "cudnn_tf32", "matmul_tf32")
    return {key: getattr(config, key) for key in keys}


def _record(result: InferenceResult, prof: Profile, info: DeviceInfo, description: str, facts: InferenceProbe,
            notes: list[str], max_batch: int, request_seconds: float) -> dict[str, Any]:
    """The run as a record that the store saves and ``load_samples`` reads back."""
    return {
        **recommendation_record(
            result, _knobs, schema_version=store.SCHEMA_VERSION, technique=TECHNIQUE,
            title=f"optlab tune --inference: the inference stack, one step at a time, on {result.model}",
            model=result.model, profile=store.profile_record(prof),
            environment=capture(info, description, prof.name), device_state=device_state(info),
            parameters=facts.parameters, forward_flops_per_sample=facts.forward_flops_per_sample,
            output_shape=list(facts.output_shape), output_tolerance=OUTPUT_TOLERANCE, notes=notes,
            memory_kind=memory_kind(info.device)),
        "sweep": {"max_batch": max_batch, "plateau_gain": PLATEAU_GAIN, "plateau_doublings": PLATEAU_DOUBLINGS,
                  "ends": result.sweep_ends, "rows": json_rows(result.sweep)},
        "request_latency": {"warmup_requests": REQUEST_WARMUP, "min_requests": MIN_REQUESTS,
                            "min_seconds": request_seconds, "rows": json_rows(result.latency)},
    }
