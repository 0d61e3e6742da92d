"""``optlab tune --memory``: where one training step of the reader's own model spends its memory, and what moves it.

One step of the model (the same inputs ``tune`` accepts) is broken down by category (``breakdown.step_breakdown``:
parameters, gradients, optimizer state, activations, temporaries, ...). The largest category is named with the
techniques that move it (``MOVED_BY``), and each technique that applies to this model is measured against the
same step: set_to_none, activation checkpointing of the model's repeated blocks, 16-bit autocast, a foreach or fused
optimizer, and gradient accumulation at the same effective batch. The fixes are ranked by what they do to the step's
peak, the category each should move beside it. On a GPU the largest batch that fits comes last (doubling, then
bisecting, until the allocator runs out of memory); a CPU does not bound it (the operating system swaps or ends the
process first).

Before any of it, a training probe runs the forward, the loss and the backward on two samples: a model whose output
is detached, or whose training step fails, is one error line; so is a batch whose baseline step does not fit.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from ...core.measuring import loops
from ...core.knobs.config import RunConfig
from ...core.machine.device import DeviceInfo, native_bf16, resolve_device
from ...core.errors import OptlabError
from ...core.measuring.memory import is_out_of_memory
from ...core.run.progress import progress_bar
from ...core.knobs.profiles import Profile, get_profile
from ..transformer.largest_batch import MAX_LIMIT, fits_in_memory, free_memory, largest_fitting
from ..memory.breakdown import Breakdown, step_breakdown, train_step
from .examples import Examples, examples_from
from .inputs import (
    Batches, LossFn, ModelFn, batch_limit, build_model, check_batch, cross_entropy, dataset_batches, describe_error,
    gib, loader_batches, model_name, probe, synthetic_batches,
)

MOVED_BY = {
    "parameter": "FSDP2 (shards them across ranks); 16-bit weights (autocast keeps the fp32 ones)",
    "gradient": "set_to_none (frees them between steps); FSDP2 (shards them)",
    "optimizer_state": "an optimizer with less state (SGD keeps one tensor per parameter with momentum, Adam two); "
                       "FSDP2 (shards it)",
    "activation": "activation checkpointing (recomputes them); 16-bit autocast (stores many of them in 16 bits, "
                  "and keeps a 16-bit copy of the weights); gradient accumulation (a micro-batch's); a smaller batch",
    "temporary": "the optimizer's implementation (for-loop, foreach, fused); checkpointing and autocast change the "
                 "backward's",
    "input": "a smaller batch; gradient accumulation (a micro-batch on the device at a time)",
    "autograd_detail": "set_to_none (no accumulation into old gradients); activation checkpointing",
    "other": "a smaller batch: these are allocations the profiler could not tie to a tensor (libraries' "
             "workspaces, such as a CPU convolution's backward buffers)",
}
ACCUMULATION = 4  # micro-batches of the accumulation fix (the same effective batch)
FIX_COLUMNS = ["fix", "peak before MiB", "peak after MiB", "peak change", "moves", "measured at", "before MiB",
               "after MiB", "note"]
PROBE_SAMPLES = 2  # samples the training probe runs a forward and a backward on
NOT_MEMORY = ("steps", "techniques", "loss_tolerance", "out", "inference", "output_fn", "max_batch", "amp_dtype",
              "sweep_compile", "request_seconds", "request_batches")


@dataclass(frozen=True)
class Setting:
    """One way to train the same model on the same batch, as the fixes vary it."""

    set_to_none: bool = True
    autocast: str = "none"  # "none", "bf16" or "fp16"
    optimizer_impl: str = "default"  # torch's choice, "for_loop", "foreach" or "fused"
    accumulation: int = 1
    checkpointing: bool = False


@dataclass(frozen=True)
class Fix:
    """A technique as a pair of settings, the category it should move, and the moment that shows it: the forward's
    end (what the next backward holds) or the optimizer step (its temporaries)."""

    label: str
    category: str
    before: Setting
    after: Setting
    moment: str  # "forward's end" or "optimizer step"


BASE = Setting()
FIXES = (
    Fix("set_to_none", "gradient", Setting(set_to_none=False), BASE, "forward's end"),
    Fix("activation checkpointing", "activation", BASE, Setting(checkpointing=True), "forward's end"),
    Fix("16-bit autocast", "activation", BASE, Setting(autocast="bf16"), "forward's end"),
    Fix("foreach optimizer", "temporary", Setting(optimizer_impl="for_loop"), Setting(optimizer_impl="foreach"),
        "optimizer step"),
    Fix("fused optimizer", "temporary", Setting(optimizer_impl="for_loop"), Setting(optimizer_impl="fused"),
        "optimizer step"),
    Fix(f"gradient accumulation x{ACCUMULATION}", "activation", BASE, Setting(accumulation=ACCUMULATION),
        "forward's end"),
)
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class MemoryResult:
    """What ``tune(..., memory=True)`` returns: the step's ``Breakdown``, each fix's
    measured effect (``fixes``), and the largest batch that fits (``largest_batch``, None where the device does not
    bound it, with ``batch_note`` saying why or what bound it)."""

    model: str
    device: torch.device
    batch_size: int
    breakdown: Breakdown
    fixes: pd.DataFrame
    largest_batch: int | None
    batch_note: str

    def table(self) -> pd.DataFrame:
        """The breakdown: MiB of each category at the peak, its share, the arithmetic's MiB, what moves it."""
        return self.breakdown.table().assign(**{"moved by": [MOVED_BY[name] for name in self.breakdown.categories]})

    def describe(self) -> str:
        """The largest category and what moves it; the measured fix that lowered the peak most (or that none did);
        then the batch line."""
        largest, peak = self.breakdown.largest(), self.breakdown.peak_bytes
        share = self.breakdown.categories[largest] / peak if peak else 0.0
        lines = [f"largest: {largest}, {share:.0%} of the step's {gib(peak)} peak (during the "
                 f"{self.breakdown.peak_phase}); moved by {MOVED_BY[largest]}"]
        measured = self.fixes.dropna(subset=["peak after MiB"])
        if not measured.empty:  # the rows are ranked by the peak's change: the first lowers it most
            best = measured.iloc[0]
            lowers = best["peak after MiB"] < best["peak before MiB"]
            lines.append(f"{'lowers the peak most here' if lowers else 'no fix lowered the peak here; the closest'}: "
                         f"{best['fix']}, from {best['peak before MiB']:.3g} to "
                         f"{best['peak after MiB']:.3g} MiB ({best['peak change']}); it moves {best['moves']}: "
                         f"{best['before MiB']:.3g} to {best['after MiB']:.3g} MiB at the {best['measured at']}")
        lines.append(f"largest batch: {self.batch_note}")
        return "\n".join(lines)

    def fixes_table(self) -> pd.DataFrame:
        """The fixes as printed: MiB rounded, cells without a measurement blank."""
        return self.fixes.round(2).astype(object).fillna("")

    def report(self) -> str:
        """What ``optlab tune --memory`` prints: the breakdown, the fixes, then ``describe``."""
        with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 110):
            return "\n".join([self.table().to_string(index=False), self.fixes_table().to_string(index=False),
                              self.describe()])


def tune_memory(model_fn: ModelFn, *, input_shape: Any = None, num_classes: int | None = None, inputs: Any = None,
                targets: torch.Tensor | None = None, data: DataLoader | Dataset | None = None,
                loss_fn: LossFn | None = None, batch_size: int | None = None, device: str = "auto",
                profile: str | Profile | None = None, optimizer: str = "sgd", name: str | None = None, seed: int = 0,
                progress: bool = True, **timed_only: Any) -> MemoryResult:
    """Break one training step of the model that ``model_fn`` builds down by memory category, name the largest and
    what moves it, measure each fix that applies, and find the largest batch that fits (on a GPU).

    The inputs are given as for ``tune`` (``input_shape``, ``inputs``, ``targets``, ``num_classes`` or ``data``); the
    batch size defaults to the profile's. Options of the timed tune (``steps``, ``techniques``, ``out``,
    ``inference`` and its options) are refused, in one line."""
    given = [key for key in NOT_MEMORY if timed_only.pop(key, None) not in (None, False, "auto")]
    if timed_only:
        raise TypeError(f"tune() got unexpected keyword arguments: {', '.join(timed_only)}")
    if given:
        raise OptlabError(f"memory=True (--memory) breaks one training step down; {', '.join(given)} "
                          f"{'is' if len(given) == 1 else 'are'} for the timed tune")
    info = resolve_device(device)
    RunConfig(optimizer=optimizer)  # a name it does not know is refused here, in one line
    loss_fn = loss_fn or cross_entropy
    examples, batches = _batches(data, input_shape, inputs, targets, num_classes, batch_size,
                                 get_profile(profile, info.is_cuda).batch_size, seed, info.device)
    probe(model_fn, batches, loss_fn, info.device, seed)
    training_probe(model_fn, batches.first, loss_fn, info.device, seed)
    name = name or model_name(model_fn)
    print(f"optlab tune --memory {name}: one training step, batch {batches.batch_size}, {optimizer}, on "
          f"{info.describe()}")
    measure = Measure(model_fn, batches.first, loss_fn, optimizer, info, seed)
    fixes = applicable_fixes(build_model(model_fn, seed), batches.batch_size, info)
    # one step a setting, measured once: the foreach and fused optimizers share their before
    settings = {BASE} | {setting for fix, reason in fixes if reason is None for setting in (fix.before, fix.after)}
    bar = progress_bar(len(settings), f"memory {name}", progress)
    try:
        base = measure(BASE, bar)
        if isinstance(base, str):
            raise OptlabError(baseline_failure(base, batches.batch_size, info))
        rows = [fix_row(fix, reason, measure, bar) for fix, reason in fixes]
    finally:
        bar.close()
    largest, note = largest_batch(measure, examples, info)
    return MemoryResult(name, info.device, batches.batch_size, base, ranked(pd.DataFrame(rows, columns=FIX_COLUMNS)),
                        largest, note)


def training_probe(model_fn: ModelFn, batch: tuple[Any, torch.Tensor], loss_fn: LossFn, device: torch.device,
                   seed: int) -> None:
    """A forward, the loss and a backward on ``PROBE_SAMPLES`` samples of ``batch``, in training mode: a loss that
    no trainable parameter reaches (a detached output, a forward under ``no_grad``) or a backward that fails is
    one ``OptlabError`` naming it, before any breakdown."""
    model = build_model(model_fn, seed).to(device).train()
    inputs = loops.inputs_to(loops.map_inputs(lambda t: t[:PROBE_SAMPLES], batch[0]), device)
    targets = batch[1][:PROBE_SAMPLES].to(device)
    try:
        loss = loss_fn(loops.call_model(model, inputs), targets)
        if not loss.requires_grad:
            raise OptlabError("the loss does not depend on any trainable parameter, so a training step has nothing "
                              "to do: is the model's output detached, or its forward run under torch.no_grad()?")
        loss.backward()
    except OptlabError:
        raise
    except Exception as error:  # noqa: BLE001  (the reader's model: its error, in one line)
        raise OptlabError(f"the training step (forward, loss, backward) failed on {PROBE_SAMPLES} samples: "
                          f"{describe_error(error)}") from None
    finally:
        del model
        free_memory(device)


def baseline_failure(outcome: str, batch_size: int, info: DeviceInfo) -> str:
    """The line for a baseline step that could not be measured: out of memory says so, with what to change."""
    if outcome == "out of memory":
        return (f"the training step at batch {batch_size} ran out of memory on {info.device}: give a smaller "
                f"batch_size (--batch-size)")
    return f"the training step at batch {batch_size} could not be broken down: {outcome.removeprefix('failed: ')}"


def ranked(fixes: pd.DataFrame) -> pd.DataFrame:
    """The fixes ranked by what they do to the peak, the largest fall first; those not measured last."""
    change = (fixes["peak after MiB"] / fixes["peak before MiB"]).sort_values(kind="stable", na_position="last")
    return fixes.loc[change.index].reset_index(drop=True)


def _batches(data: Any, input_shape: Any, inputs: Any, targets: Any, num_classes: int | None, batch_size: int | None,
             default_size: int, seed: int, device: torch.device) -> tuple[Examples | None, Batches]:
    """The examples (None for ``data``) and the batches a memory tune takes its one batch from."""
    if data is None:
        made = examples_from(inputs, targets, input_shape, num_classes, seed)
        size = check_batch("batch_size", batch_size, made, device) if batch_size is not None else \
            min(default_size, batch_limit(made, device)[0])
        return made, synthetic_batches(made, size, 1)
    if any(value is not None for value in (input_shape, inputs, targets, num_classes)):
        raise OptlabError("give either data= or the inputs (input_shape, inputs, targets, num_classes), not both")
    if isinstance(data, DataLoader):
        return None, loader_batches(data, batch_size, 1)
    return None, dataset_batches(data, batch_size or default_size, 1, seed)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks that checkpointing can wrap: the children of the outermost ModuleLists and Sequentials
    whose two or more children are all of one class with modules of their own (a transformer's layers, a ResNet's
    stages' blocks)."""
    children = list(model.children())
    if isinstance(model, (nn.ModuleList, nn.Sequential)) and len(children) >= 2 \
            and len({type(child) for child in children}) == 1 and any(True for _ in children[0].children()):
        return children
    return [block for child in children for block in repeated_blocks(child)]


def checkpointed(model: nn.Module) -> nn.Module:
    """``model`` with each of its ``repeated_blocks`` recomputed in the backward (non-reentrant checkpointing):
    only a block's inputs are kept between the forward and the backward."""
    for block in repeated_blocks(model):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def applicable_fixes(model: nn.Module, batch_size: int, info: DeviceInfo) -> list[tuple[Fix, str | None]]:
    """Each fix, with the reason it does not apply to this model, batch or device (None where it does); autocast
    is bf16 where the device has it natively, else fp16."""
    dtype = "bf16" if not info.is_cuda or native_bf16(info) else "fp16"
    fixes = []
    for fix in FIXES:
        if fix.after.autocast != "none":
            fix = Fix(f"16-bit autocast ({dtype})", fix.category, fix.before, Setting(autocast=dtype), fix.moment)
        reason = None
        if fix.after.checkpointing and not repeated_blocks(model):
            reason = "no repeated blocks (a ModuleList or Sequential of one block class) to checkpoint"
        if fix.after.accumulation > batch_size:
            reason = f"a batch of {batch_size} cannot be cut into {fix.after.accumulation} micro-batches"
        fixes.append((fix, reason))
    return fixes


class Measure:
    """The breakdown of one setting, built from fresh weights each time and kept for the next fix that needs it."""

    def __init__(self, model_fn: ModelFn, batch: tuple[Any, torch.Tensor], loss_fn: LossFn, optimizer: str,
                 info: DeviceInfo, seed: int) -> None:
        self.model_fn, self.batch, self.loss_fn, self.optimizer = model_fn, batch, loss_fn, optimizer
        self.info, self.seed = info, seed
        self.done: dict[Setting, Breakdown | str] = {}

    def model(self, setting: Setting) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A fresh model (the same weights every time) on the device, and its optimizer, as ``setting`` asks."""
        model = build_model(self.model_fn, self.seed).to(self.info.device)
        if setting.checkpointing:
            model = checkpointed(model)
        config = RunConfig(optimizer=self.optimizer, optimizer_impl=setting.optimizer_impl)
        return model, loops.make_optimizer(model, config)

    def __call__(self, setting: Setting, bar: tqdm) -> Breakdown | str:
        """The breakdown of ``setting``, or the reason it could not be measured (out of memory, an error)."""
        if setting not in self.done:
            try:
                model, optimizer = self.model(setting)
                self.done[setting] = step_breakdown(
                    model, self.batch, self.loss_fn, optimizer, device=self.info.device,
                    set_to_none=setting.set_to_none, autocast_dtype=AUTOCAST[setting.autocast],
                    accumulation=setting.accumulation, steps=1, warmup_steps=1, snapshot=False)
            except Exception as error:  # noqa: BLE001  (a setting that fails is a row that says why)
                self.done[setting] = "out of memory" if is_out_of_memory(error) else \
                    f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            free_memory(self.info.device)
            bar.update()
        return self.done[setting]


def category_at(breakdown: Breakdown, category: str, moment: str) -> int:
    """Bytes of ``category`` at the forward's end, or the most during the optimizer step."""
    if moment == "forward's end":
        return breakdown.at_end_of("forward")[category]
    timeline = breakdown.timeline
    rows = timeline[(timeline["phase"] == "optimizer") & (timeline["category"] == category)]
    return int(rows["bytes"].max()) if len(rows) else 0


def fix_row(fix: Fix, reason: str | None, measure: Measure, bar: tqdm) -> dict[str, Any]:
    """One fix's row: the category it moves at its moment and the peak, before and after (MiB), or why not."""
    row = {"fix": fix.label, "moves": fix.category, "measured at": fix.moment, "note": reason or ""}
    if reason:
        return row
    before, after = measure(fix.before, bar), measure(fix.after, bar)
    failed = [f"{which}: {outcome}" for which, outcome in (("before", before), ("after", after))
              if isinstance(outcome, str)]
    if failed:
        return row | {"note": "; ".join(failed)}
    return row | {"before MiB": category_at(before, fix.category, fix.moment) / 2**20,
                  "after MiB": category_at(after, fix.category, fix.moment) / 2**20,
                  "peak before MiB": before.peak_bytes / 2**20, "peak after MiB": after.peak_bytes / 2**20,
                  "peak change": f"{after.peak_bytes / before.peak_bytes - 1:+.0%}"}


def largest_batch(measure: Measure, examples: Examples | None, info: DeviceInfo) -> tuple[int | None, str]:
    """The largest batch that fits on a GPU (``search_batch``) and a line saying it; on a CPU, or for the reader's
    own data, None and the line that says why there is none."""
    if not info.is_cuda:
        return None, "not bounded on a CPU: the operating system swaps or ends the process before torch runs out"
    if examples is None:
        return None, "needs described inputs or an example batch: data= gives batches of its own size"
    most, bound = batch_limit(examples, info.device)
    found, tries = search_batch(measure, examples, min(most, MAX_LIMIT))
    return found, f"{found} ({tries} tries on {info.device}, within {bound})"


def search_batch(measure: Measure, examples: Examples, limit: int) -> tuple[int, int]:
    """The largest batch of ``examples`` up to ``limit`` with which two steps of the starting setting run without
    running out of memory (doubling, then bisecting), and the tries it took; 0 when one sample does not fit."""
    device = measure.info.device
    model, optimizer = measure.model(BASE)

    def step(size: int) -> None:  # the try's batch and graph live in this frame only
        inputs, targets = examples.make(size, 0)
        chunks = [(loops.inputs_to(inputs, device), targets.to(device))]
        for _ in range(2):
            train_step(model, chunks, measure.loss_fn, optimizer, device, None, True)

    return largest_fitting(lambda size: fits_in_memory(step, size, device, optimizer), limit)
