"""``optlab tune``: the book's stack of techniques, one step at a time, measured on the reader's own model.

Each step of the all-together stack is tried on top of the configuration kept so far, timed against it (the two
take turns, in mirrored rounds until the answer is clear) and kept only if it was clearly faster and left its
first two training losses where they were. A step that does not apply to this device, model or data is skipped with
the reason. The kept steps are then measured afresh, all together, against the starting point: they were chosen for
being faster, so the product of their own speed-ups would flatter them.
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from ...core.machine import compiler
from ...core.measuring import loops
from ...core.results import store
from ...core.knobs.config import RunConfig, apply_changes, changed_knobs
from ...core.machine.device import DeviceInfo, effective_config, native_bf16, resolve_device
from ...core.machine.environment import capture
from ...core.errors import OptlabError, choice_error
from ...core.run.experiments import failure_status, interleave, stopping_rule
from ...core.run.progress import finish, progress_bar
from ...core.measuring.flops import TRAIN_TO_FORWARD
from ...core.knobs.limits import MAX_STEPS, check_count, cpu_cores
from ...core.measuring.memory import is_out_of_memory, memory_kind
from ...core.knobs.profiles import Profile, get_profile
from ...core.measuring.samples import failed_row
from ...core.stats.summary import summarize_runs
from ...core.techniques.cnn import ALL_TOGETHER
from ...core.measuring.timing import INTERVAL, interval_text
from ..kernels.compile_cost import LOSS_RTOL
from .batch_sweep import REQUEST_SECONDS
from .inference import InferenceResult, OutputFn, tune_inference
from .examples import examples_from
from .recommendation import (
    AFRESH, FINAL, NOTHING_KEPT, START, Recommendation, check_something_measured, decision_before_the_check,
    json_rows, recommendation_record,
)
from .inputs import (
    MAX_BATCH_SIZE, Batches, LossFn, ModelFn, Probe, batch_does_not_fit, batch_limit, build_model,
    check_batch, cross_entropy, dataset_batches, loader_batches, model_name, probe, synthetic_batches,
)

TECHNIQUE = "tune"
STEP_COLUMNS = ["step", "decision", "speedup", "ci_low", "ci_high", "verdict", "loss_change", "loss_tolerance",
                "before_ms", "after_ms", "reason"]


def stack_steps() -> list[tuple[str, dict[str, Any]]]:
    """The stack's steps after its baseline, each with the knobs it changes from the step before."""
    steps, before = [], ALL_TOGETHER.variants[0][1]
    for label, cumulative in ALL_TOGETHER.variants[1:]:
        steps.append((label, {k: v for k, v in cumulative.items() if before.get(k) != v}))
        before = cumulative
    return steps


@dataclass(kw_only=True)
class TuneResult(Recommendation):
    """What ``tune`` returns (:class:`~optlab.studies.tune.recommendation.Recommendation`): one row per step of the
    stack (``steps``), every comparison's samples and summaries, the kept steps, the recommended configuration, its
    speed-up over the starting point measured afresh, and the lines of training code that make it."""

    def table(self) -> pd.DataFrame:
        """The steps as a reader sees them: speed-up over the configuration before the step, its interval and
        verdict, the change of the first two losses, the median step times, the decision and the reason."""
        table = self.steps.copy()
        table[INTERVAL] = [interval_text(low, high) for low, high in zip(table["ci_low"], table["ci_high"])]
        table["loss change"] = [percent(change) for change in table["loss_change"]]
        table = table.rename(columns={"speedup": "speed-up", "before_ms": "ms before", "after_ms": "ms after"})
        columns = ["step", "speed-up", INTERVAL, "verdict", "loss change", "ms before", "ms after", "decision",
                   "reason"]
        return table[columns].astype({"speed-up": float, "ms before": float, "ms after": float}) \
            .round({"speed-up": 2, "ms before": 1, "ms after": 1}).astype(object).fillna("")

    def describe(self) -> str:
        """The recommendation in words, then the lines of code that make it."""
        head = self.headline("recommendation: keep your configuration; no step of the stack was clearly faster on "
                             "this model at this size",
                             "More timed steps or repeats (steps=, max_repeats=, the quick profile) would tell")
        return "\n".join([head, *self.code_block("the lines to add to your training:")])


def percent(value: float | None) -> str:
    """A relative change for a table: ``0.1 %``; empty when there is none."""
    if value is None or pd.isna(value):
        return ""
    if math.isinf(value):
        return "not finite"
    return "0 %" if value == 0 else f"{100 * value:.2g} %"


OPTIMIZER_CODE = {"sgd": "torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, fused=True)",
                  "adam": "torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4, fused=True)",
                  "adamw": "torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, "
                           "fused=True)"}


def code_lines(start: RunConfig, recommended: RunConfig, device: torch.device) -> list[str]:
    """The lines of training code that turn ``start`` into ``recommended``: only the lines that change, those run once,
    then those of every training step, where ``model``, ``optimizer``, ``loss_fn``, ``device``, ``inputs`` and
    ``targets`` (and, for a loader or the data set on the device, ``dataset`` or ``images`` and ``labels``) are your
    own. A line the starting point already has (its ``optimizer.zero_grad(set_to_none=False)``, its
    ``loss.backward()``) is not one to add; autocast's block holds the loss line it wraps."""
    changes = changed_knobs(start, recommended)
    once: list[str] = []
    if ("num_workers" in changes or "pin_memory" in changes) and recommended.num_workers > 0:
        once.append(f"loader = torch.utils.data.DataLoader(dataset, batch_size={recommended.batch_size}, shuffle=True, "
                    f"num_workers={recommended.num_workers}, pin_memory={recommended.pin_memory})")
    if "data_on_device" in changes:
        once.append("images, labels = images.to(device), labels.to(device)  # the whole data set; index batches there")
    if "channels_last" in changes:
        once.append("model = model.to(memory_format=torch.channels_last)")
    if "compile_mode" in changes:
        once.append("model = torch.compile(model)")
    if "optimizer_impl" in changes:
        once.append(f"optimizer = {OPTIMIZER_CODE[recommended.optimizer]}  # or your own settings, fused")
    if "amp_dtype" in changes and recommended.amp_dtype == "fp16":
        once.append(f'scaler = torch.amp.GradScaler("{device.type}")  # fp16 gradients need their loss scaled')
    step: list[str] = []
    if "non_blocking" in changes:
        step.append("inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)")
    if "channels_last" in changes:
        step.append("inputs = inputs.contiguous(memory_format=torch.channels_last)")
    if "set_to_none" in changes:
        step.append(f"optimizer.zero_grad(set_to_none={recommended.set_to_none})")
    if "amp_dtype" in changes and recommended.amp_dtype != "none":
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[recommended.amp_dtype]
        step += [f'with torch.autocast("{device.type}", dtype=torch.{dtype}):  # the forward and the loss',
                 "    loss = loss_fn(model(inputs), targets)"]
        if recommended.amp_dtype == "fp16":  # in place of loss.backward() and optimizer.step()
            step += ["scaler.scale(loss).backward()", "scaler.step(optimizer)", "scaler.update()"]
    return ((["# once, where the model, optimizer and loader are made:"] + once) if once else []) + \
        ((["# every training step:"] + step) if step else [])


def sized_workers(label: str, changes: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A step's loader workers sized by this machine: at most one per CPU core (more would only queue for the same
    cores, and torch warns at every loader it starts), with a note when that changes the step."""
    workers, cores = changes.get("num_workers", 0), cpu_cores()
    if workers <= cores:
        return changes, []
    return {**changes, "num_workers": cores}, [f"{label}: {cores} loader worker{'s' if cores != 1 else ''} here, one "
                                               f"per CPU core (more would only queue for this machine's {cores})"]


def skip_reason(changes: dict[str, Any], info: DeviceInfo, batches: Batches, facts: Probe) -> str | None:
    """Why a step with these knob changes does not apply to this device, model and data; None if it does."""
    if changes.get("data_on_device"):
        if not info.is_cuda:
            return "no CUDA: on the CPU the batches already are in the device's memory"
        if batches.kind != "synthetic":
            return "needs the whole data set as one tensor on the GPU; yours comes through a DataLoader"
    elif changes.get("num_workers", 0) > 0 or changes.get("pin_memory"):
        if batches.kind == "synthetic":
            return ("synthetic batches are made once, in memory (pinned and copied non_blocking on CUDA): nothing to "
                    "load (pass data= to time your loading)")
        if batches.kind == "loader":
            return "your DataLoader keeps its own workers and pinning (pass its dataset to time these)"
    if changes.get("amp_dtype") == "bf16" and not native_bf16(info):
        return f"no native bf16 on {info.name}: autocast would convert around every kernel"
    if changes.get("channels_last"):
        if not facts.has_conv2d:
            return "the model has no 2-D convolutions, and channels_last changes only their layout"
        if facts.input_dims != 4:
            return f"inputs have {facts.input_dims} dimensions; channels_last is for 4-D images (N, C, H, W)"
    if changes.get("compile_mode", "none") != "none":
        try:
            compiler.require_compiler([RunConfig(compile_mode=changes["compile_mode"])], info)
        except OptlabError as error:
            return str(error)
    return None


def decide(verdict: str, change: float, tolerance: float, before_failed: str = "",
           after_failed: str = "") -> tuple[str, str]:
    """Whether a measured step is kept, and why not: kept only if its verdict is "faster" and its first losses moved by
    at most ``tolerance``. ``before_failed`` and ``after_failed`` are the failures (out of memory, an error) of the
    configuration before the step and of the step itself."""
    if (undecided := decision_before_the_check(verdict, before_failed, after_failed)) is not None:
        return undecided
    if not change <= tolerance:  # NaN too
        return "not kept: loss changed", (f"faster, but its first losses moved by {percent(change) or 'nan'}, "
                                          f"beyond the {percent(tolerance)} tolerance")
    return "kept", ""


def loss_change(before: Sequence[float], after: Sequence[float]) -> float:
    """The largest relative difference between two configs' first two training losses, from the same weights on the
    same batches: the first shows the forward's numerics, the second also one update's (a model whose head starts at
    zero gives every config the same first loss). Later losses drift apart as training from scratch amplifies
    rounding, so they are left out. NaN if a loss is not a number, or none was recorded."""
    pairs = list(zip(before[:2], after[:2]))
    changes = [abs(b - a) / abs(a) if a else (0.0 if b == a else math.inf) for a, b in pairs]
    return math.nan if not changes or any(math.isnan(c) for c in changes) else max(changes)


@dataclass
class _Run:
    """What every comparison of one tune run shares."""

    name: str
    model_fn: ModelFn
    loss_fn: LossFn
    batches: Batches
    profile: Profile
    info: DeviceInfo
    flops: int
    seed: int
    bar: tqdm


def _state(run: _Run, config: RunConfig) -> tuple:
    """A fresh model (the same weights for every config), its loader, optimizer and scaler, as ``config`` asks."""
    device = run.info.device
    model = loops.prepare_model(build_model(run.model_fn, run.seed), config, device)
    return (model, run.batches.loader(config, device), loops.make_optimizer(model, config),
            loops.make_scaler(config, device))


def _warm_up(run: _Run, config: RunConfig) -> None:
    """One untimed pass of ``config``: the process's first training steps (allocator, kernel libraries, caches) run
    slower than any after, and would count against whichever config the first comparison timed first. The starting
    point's batch running out of memory ends the tune here, in one line: every step is timed against it."""
    fits = True
    try:
        loops.train_phase(*_state(run, config), config, run.info.device, run.profile.steps,
                          run.profile.warmup_steps, loss_fn=run.loss_fn)
    except Exception as error:  # noqa: BLE001  (the comparisons time this config again and record what it raises)
        fits = not is_out_of_memory(error)
    gc.collect()  # out of the except block: the error's frames and the batch's tensors are gone
    if not fits:
        raise batch_does_not_fit("the starting point", config.batch_size, run.info.device)


def _compare(run: _Run, configs: dict[str, RunConfig],
             comparison: str) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Every repeat of each config, taking turns: the tidy rows, and each config's first training losses (from the
    same weights, on the same batches). A config that raises (out of memory, a compile that fails) is recorded, and
    the other goes on."""
    rows: list[dict[str, Any]] = []
    first_losses: dict[str, list[float]] = {}
    states: dict[str, tuple] = {}
    prof, device = run.profile, run.info.device
    for label, config in configs.items():
        try:
            states[label] = _state(run, config)
        except Exception as error:  # noqa: BLE001  (recorded, and the run goes on)
            rows.append(failed_row(TECHNIQUE, run.name, label, 0, "train", config, failure_status(error)))

    def runner(label: str):
        def run_phase(phase: str, profile: Profile, phase_seed: int) -> loops.PhaseResult:
            torch.manual_seed(phase_seed)  # the same shuffling and dropout for every config
            return loops.train_phase(*states[label], configs[label], device, profile.steps, profile.warmup_steps,
                                     loss_fn=run.loss_fn)
        return run_phase

    def keep_first_losses(label: str, repeat: int, result: loops.PhaseResult) -> None:
        if repeat == 0:
            first_losses[label] = result.warmup_losses + result.losses

    first, *others = configs
    rule = stopping_rule(prof, {label: first for label in others}, ("train",))
    started = run.bar.n
    rows += interleave({label: runner(label) for label in states}, configs, ("train",), prof, run.info, TECHNIQUE,
                       run.name, {"train": run.batches.epoch_images}, run.seed, run.bar, rule, run.flops,
                       keep_first_losses).rows
    # a config that failed to start ran no rounds: the bar moves past them
    finish(run.bar, len(configs) * (run.profile.warmup_repeats + run.profile.max_repeats), run.bar.n - started)
    states.clear()  # free the models before the next comparison builds its own
    gc.collect()
    if any(config.compile_mode != "none" for config in configs.values()):
        torch._dynamo.reset()  # the next comparison compiles from a clean slate, with Dynamo's whole recompile limit
    if run.info.is_cuda:
        torch.cuda.empty_cache()
    return [{**row, "comparison": comparison} for row in rows], first_losses


def _outcome(summary: pd.DataFrame, rows: list[dict[str, Any]], label: str) -> tuple[dict[str, Any], str]:
    """A config's summary row in a comparison, and its failure ("" if it ran every repeat)."""
    failures = [row["status"] for row in rows if row["variant"] == label and row["status"] != "ok"]
    found = summary[(summary["variant"] == label) & (summary["n"] > 0)]
    return (found.iloc[0].to_dict() if len(found) else {}), (failures[0] if failures else "")


def _try_step(run: _Run, before: tuple[str, RunConfig], step: tuple[str, RunConfig],
              loss_tolerance: float | None) -> tuple[dict[str, Any], list[dict[str, Any]], pd.DataFrame]:
    """Time ``step`` against the configuration ``before`` it: the step's row of the table, the samples, the summary."""
    (before_label, before_config), (label, config) = before, step
    rows, first_losses = _compare(run, {before_label: before_config, label: config}, label)
    summary = summarize_runs(pd.DataFrame(rows), before_label).assign(comparison=label)
    (base, base_failed), (after, after_failed) = (_outcome(summary, rows, x) for x in (before_label, label))
    change = loss_change(first_losses.get(before_label, []), first_losses.get(label, []))
    tolerance = loss_tolerance if loss_tolerance is not None else LOSS_RTOL[config.amp_dtype]
    decision, reason = decide(after.get("verdict", ""), change, tolerance, base_failed, after_failed)
    row = {"step": label, "decision": decision, "speedup": after.get("speedup"), "ci_low": after.get("ci_low"),
           "ci_high": after.get("ci_high"), "verdict": after_failed or after.get("verdict"), "loss_change": change,
           "loss_tolerance": tolerance, "before_ms": base.get("step_ms"), "after_ms": after.get("step_ms"),
           "reason": reason}
    return row, rows, summary


def _batches(data, examples: dict[str, Any], batch_size: int | None, default_size: int, steps_per_run: int,
             seed: int, device: torch.device) -> Batches:
    """The batches a run is given: made from ``examples`` (input_shape, inputs, targets, num_classes:
    :func:`~.examples.examples_from`) within the size ``device`` can hold (:func:`~.inputs.batch_limit`), or the
    reader's dataset or DataLoader."""
    if data is None:
        made = examples_from(**examples, seed=seed)
        size = check_batch("batch_size", batch_size, made, device) if batch_size is not None else \
            min(default_size, batch_limit(made, device)[0])
        return synthetic_batches(made, size, steps_per_run)
    if any(value is not None for value in examples.values()):
        given = ", ".join(key for key, value in examples.items() if value is not None)
        raise OptlabError(f"give either data= or {given}, not both")
    if isinstance(data, DataLoader):
        return loader_batches(data, batch_size, steps_per_run)
    return dataset_batches(data, batch_size or default_size, steps_per_run, seed)


def _print_header(run: _Run, facts: Probe, loss_tolerance: float | None) -> None:
    prof = run.profile
    print(f"optlab tune {run.name}: {facts.parameters / 1e6:.3g} M parameters, "
          f"{facts.forward_flops_per_image / 1e9:.3g} GFLOP per sample forward")
    print(f"profile {prof.name}: batch {prof.batch_size}; {prof.warmup_steps} warm-up + {prof.steps} timed steps; "
          f"{prof.describe_repeats()} per configuration, taking turns")
    print(f"device: {run.info.describe()}")
    print(f"data: {run.batches.description}")
    tolerance = (percent(loss_tolerance) if loss_tolerance is not None else
                 f"{percent(LOSS_RTOL['none'])} in fp32, {percent(LOSS_RTOL['bf16'])} in fp16 or bf16")
    print(f"loss check: the first two training losses (same weights, same batches) within {tolerance} of the "
          "configuration before the step")


def _check_sizes(prof: Profile, techniques: Sequence[str] | None, batch_size: int | None, steps: int | None,
                 loss_tolerance: float | None) -> int:
    """Refuse at once what a user typed out of bounds; return the timed steps per repeat."""
    labels = [label for label, _ in stack_steps()]
    for label in techniques or ():
        if label not in labels:
            raise choice_error("stack step", label, labels)
    if batch_size is not None:
        check_count("batch_size", batch_size, 1, MAX_BATCH_SIZE, "images per batch")
    timed = steps if steps is not None else prof.steps
    if timed is None:
        raise OptlabError(f"profile {prof.name} times whole epochs; tune times a fixed number of steps: pass steps "
                          "(--steps) or use the smoke or quick profile")
    check_count("steps", timed, 1, MAX_STEPS, "timed steps per repeat")
    if loss_tolerance is not None and not (isinstance(loss_tolerance, (int, float)) and 0 <= loss_tolerance < math.inf):
        raise OptlabError(f"loss_tolerance must be a number >= 0, got {loss_tolerance!r}")
    return timed


@dataclass
class _Walk:
    """The walk up the stack so far: the table's rows, every comparison's samples and summary, the kept steps and
    the configuration they make."""

    current: tuple[str, RunConfig]
    notes: list[str]
    table: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    summaries: list[pd.DataFrame] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def _walk(run: _Run, plan: list[tuple[str, dict[str, Any], str | None]], start: RunConfig, notes: list[str],
          loss_tolerance: float | None) -> _Walk:
    """Each step of ``plan`` on top of the configuration kept so far: skipped with its reason, or timed and kept only
    if it was faster and kept its losses."""
    walk = _Walk((START, start), list(notes))
    for label, changes, reason in plan:
        if reason:
            walk.table.append({"step": label, "decision": "skipped", "reason": reason})
            continue
        candidate, candidate_notes = effective_config(apply_changes(walk.current[1], changes), run.info)
        walk.notes += candidate_notes
        row, rows, summary = _try_step(run, walk.current, (label, candidate), loss_tolerance)
        walk.table.append(row)
        walk.rows += rows
        walk.summaries.append(summary)
        if row["decision"] == "kept":
            walk.kept.append(label)
            walk.current = (label, candidate)
    return walk


def _afresh(run: _Run, start: RunConfig, walk: _Walk) -> dict[str, Any]:
    """The kept steps, all together, timed anew against the starting point (they were chosen for being faster):
    the speed-up, its interval and verdict. Nothing kept: 1, with the verdict "baseline"."""
    final = {"speedup": 1.0, "ci_low": 1.0, "ci_high": 1.0, "verdict": "baseline"}
    if not walk.kept:
        return final
    rows, _ = _compare(run, {START: start, FINAL: walk.current[1]}, FINAL)
    summary = summarize_runs(pd.DataFrame(rows), START).assign(comparison=FINAL)
    walk.rows += rows
    walk.summaries.append(summary)
    row, failed = _outcome(summary, rows, FINAL)
    return {key: row.get(key, math.nan) for key in final} | ({"verdict": failed} if failed else {})


def tune(
    model_fn: ModelFn,
    *,
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    inputs: Any = None,
    targets: torch.Tensor | None = None,
    data: DataLoader | Dataset | None = None,
    loss_fn: LossFn | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    profile: str | Profile | None = None,
    steps: int | None = None,
    techniques: Sequence[str] | None = None,
    optimizer: str = "sgd",
    loss_tolerance: float | None = None,
    name: str | None = None,
    out: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
    inference: bool = False,
    output_fn: OutputFn | None = None,
    max_batch: int | None = None,
    amp_dtype: str = "auto",
    sweep_compile: bool = False,
    request_seconds: float | None = None,
    request_batches: Sequence[int] | None = None,
) -> TuneResult | InferenceResult:
    """Try the stack's steps on the model that ``model_fn`` builds, one at a time, keeping each only if it was faster.

    Batches are synthetic (``input_shape`` of one input, without the batch dimension, and ``num_classes``), made from
    ``inputs`` (an example batch: a tensor, a tuple of tensors or a dict of keyword tensors, with its ``targets``
    or ``num_classes``; or descriptions such as ``"tokens:32000:128:mask"``, whose targets are the next tokens:
    :func:`~optlab.studies.tune.examples.parse_input`), or the reader's ``data`` (a DataLoader, used as it is, or a
    map-style dataset of ``(inputs, target)``). A batch size scales the example's first dimension.
    ``loss_fn(output, targets)`` defaults to cross-entropy (over every token for ``[N, T, V]`` outputs; a dict
    output's ``logits``); ``batch_size`` and ``steps`` (timed steps per repeat) default to the
    profile's; ``techniques`` names the stack's steps to try (default: all of them); ``optimizer`` is ``sgd`` or
    ``adam``. A faster step is kept only if its first two training losses are within ``loss_tolerance`` (relative;
    default 0.1 % in fp32, 5 % in fp16 or bf16) of the configuration's before it. ``out``: a folder for the record.

    A batch beyond what the device can hold (``inputs.batch_limit``) is refused before the
    model is built, and one the starting point runs out of memory on ends the tune: each with an
    :class:`~optlab.OptlabError` that names the limit. A step that runs out of memory is recorded as such, and the
    tune goes on; where every step measured failed, :class:`~optlab.studies.tune.NothingRecommended` is raised, its
    ``result`` holding the table.

    ``inference=True`` tries the inference stack instead, then sweeps batch sizes, and returns an
    :class:`~optlab.InferenceResult`; ``output_fn``, ``max_batch``, ``amp_dtype``, ``sweep_compile``,
    ``request_seconds`` and ``request_batches`` (batch sizes whose request latency is timed, default batch 1) are for
    that mode only.
    """
    if inference:
        given = [key for key, value in {"targets": targets, "loss_fn": loss_fn,
                                        "loss_tolerance": loss_tolerance}.items()
                 if value is not None] + (["optimizer"] if optimizer != "sgd" else [])
        if given:
            raise OptlabError(f"inference=True times the inputs through the forward only; "
                              f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for training")
        seconds = REQUEST_SECONDS if request_seconds is None else request_seconds
        return tune_inference(model_fn, input_shape=input_shape, inputs=inputs, data=data, num_classes=num_classes,
                              output_fn=output_fn, batch_size=batch_size, max_batch=max_batch, amp_dtype=amp_dtype,
                              sweep_compile=sweep_compile, request_seconds=seconds,
                              request_batches=(1,) if request_batches is None else request_batches, device=device,
                              profile=profile, steps=steps, techniques=techniques, name=name, out=out, seed=seed,
                              progress=progress)
    inference_only = {"output_fn": output_fn is not None, "max_batch": max_batch is not None,
                      "amp_dtype": amp_dtype != "auto", "sweep_compile": sweep_compile,
                      "request_seconds": request_seconds is not None, "request_batches": request_batches is not None}
    if any(inference_only.values()):
        raise OptlabError(f"{', '.join(k for k, v in inference_only.items() if v)}: only with inference=True "
                          "(--inference; amp_dtype is --dtype there)")
    info = resolve_device(device)
    prof = get_profile(profile, info.is_cuda)
    timed = _check_sizes(prof, techniques, batch_size, steps, loss_tolerance)
    start = apply_changes(RunConfig(optimizer=optimizer, num_workers=0), ALL_TOGETHER.variants[0][1])
    out_dir = store.writable_dir(out) if out is not None else None
    loss_fn = loss_fn or cross_entropy
    name = name or model_name(model_fn)
    examples = {"input_shape": input_shape, "inputs": inputs, "targets": targets, "num_classes": num_classes}
    batches = _batches(data, examples, batch_size, prof.batch_size, prof.warmup_steps + timed, seed, info.device)
    facts = probe(model_fn, batches, loss_fn, info.device, seed)
    prof = replace(prof, models=(name,), batch_size=batches.batch_size, steps=timed, test_steps=None, num_workers=0)
    start, notes = effective_config(replace(start, batch_size=batches.batch_size), info)
    plan = []
    for label, changes in stack_steps():
        changes, sizing = sized_workers(label, changes)
        reason = (skip_reason(changes, info, batches, facts) if techniques is None or label in techniques
                  else "not among the techniques asked for")
        notes += [] if reason else sizing
        plan.append((label, changes, reason))

    measured = sum(1 for _, _, reason in plan if reason is None)
    bar = progress_bar(2 * (prof.warmup_repeats + prof.max_repeats) * (measured + 1), f"tune {name}", progress)
    run = _Run(name, model_fn, loss_fn, batches, prof, info,
               int(facts.forward_flops_per_image * batches.batch_size * TRAIN_TO_FORWARD), seed, bar)
    _print_header(run, facts, loss_tolerance)
    try:
        _warm_up(run, start)
        walk = _walk(run, plan, start, notes, loss_tolerance)
        final = _afresh(run, start, walk)
        if not walk.kept:
            finish(bar, bar.total, bar.n, NOTHING_KEPT)
    finally:  # a line that ends the run is not printed on the bar's
        bar.close()
    notes = sorted(set(walk.notes))
    for note in notes:
        print(f"note: {note}")

    recommended = walk.current[1]
    result = TuneResult(
        model=name, steps=pd.DataFrame(walk.table, columns=STEP_COLUMNS), samples=pd.DataFrame(walk.rows),
        summary=pd.concat(walk.summaries, ignore_index=True) if walk.summaries else pd.DataFrame(), kept=walk.kept,
        start=start, recommended=recommended, speedup=float(final["speedup"]), ci_low=float(final["ci_low"]),
        ci_high=float(final["ci_high"]), verdict=str(final["verdict"]),
        code=code_lines(start, recommended, info.device), record={},
    )
    check_something_measured(result, batches.batch_size)
    result.record = _record(result, prof, info, batches, facts, notes, loss_tolerance)
    if out_dir is not None:
        result.path = store.save_record(result.record, out_dir)
        print(f"wrote {store.display_path(result.path)}")
    return result


def _knobs(config: RunConfig) -> dict[str, Any]:
    """A config's knobs without optlab's own model fields (the model is the reader's)."""
    return {k: v for k, v in config.to_dict().items() if k not in ("model", "model_variant", "width")}


def _record(result: TuneResult, prof: Profile, info: DeviceInfo, batches: Batches, facts: Probe, notes: list[str],
            loss_tolerance: float | None) -> dict[str, Any]:
    """The run as a record that the store saves and ``load_samples`` reads back."""
    return recommendation_record(
        result, _knobs, schema_version=store.SCHEMA_VERSION, technique=TECHNIQUE,
        title=f"optlab tune: the stack, one step at a time, on {result.model}", model=result.model,
        profile=vars(prof) | {"models": list(prof.models)}, environment=capture(info, batches.description, prof.name),
        parameters=facts.parameters, forward_flops_per_sample=facts.forward_flops_per_image,
        loss_tolerance=loss_tolerance if loss_tolerance is not None else LOSS_RTOL, notes=notes,
        memory_kind=memory_kind(info.device))
