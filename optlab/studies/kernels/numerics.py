"""How far each precision of the ``precision`` registry entry lands from an fp32 reference with TF32 off.

Every variant starts from the same weights (a copy of one model) and sees the same batch, run through the code the
timed loops run: :func:`optlab.loops.backend_flags` sets the TF32 switches, autocast wraps the forward as in
:func:`optlab.loops.train_step`, fp16 scales its loss with the loop's GradScaler. One forward and backward gives
the logits', loss's and gradients' errors; a few :func:`~optlab.loops.train_step` calls give the loss drift.
On the CPU the TF32 switches do not exist, so a variant that runs the reference's exact config there is left out
with a note instead of being reported as a perfect match.
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from ...core.cifar import data
from ...core.results import store
from ...core.knobs.config import RunConfig
from ...core.machine.device import TORCH_DTYPES, DeviceInfo, effective_config, resolve_device
from ...core.errors import OptlabError
from ...core.techniques.registry import get_experiment
from ...core.measuring.loops import backend_flags, make_optimizer, make_scaler, prepare_model, to_device, train_step
from ...core.cifar.models import build_model
from ...core.knobs.profiles import Profile, get_profile

EXPERIMENT = "precision"
REPEAT_LABEL = "fp32 strict (again)"  # the reference run twice: the floor set by run-to-run nondeterminism
YARDSTICK_LABEL = "fp64 (yardstick)"  # the reference in fp64: how far fp32 itself is from nearly exact arithmetic
SPLIT_TF32 = (("TF32 matmul only", {"matmul_tf32": True}), ("TF32 cuDNN only", {"cudnn_tf32": True}))
DRIFT_STEPS = 3
RELATIVE_ERRORS = ("logits_rel_err", "grad_rel_err", "drift")  # comparable across models: the chapter plots them


@dataclass
class NumericsResult:
    """One row per model and variant, and one note per variant left out on this device."""

    table: pd.DataFrame
    notes: list[str]


@dataclass
class _Pass:
    logits: torch.Tensor
    loss: float
    grads: torch.Tensor
    loss_scale: float  # the GradScaler scale at which fp16's gradients were finite (1.0 without a scaler)
    losses: list[float]  # the training loss of every step, before its update
    skipped_steps: int  # optimizer steps GradScaler skipped (fp16 gradients that overflowed)


def variant_configs(model: str, profile: Profile,
                    info: DeviceInfo) -> tuple[RunConfig, dict[str, RunConfig], list[str]]:
    """The reference config (the registry's baseline) and every variant to compare with it, as they run here.

    On CUDA the registry's TF32 variant is joined by matmul-only and cuDNN-only TF32. A variant whose effective
    config equals the reference's, or another variant's but for the optimizer's implementation, is left out, with a
    note saying why.
    """
    experiment = get_experiment(EXPERIMENT)
    configs = experiment.configs(model, profile, overrides={"num_workers": 0})
    reference = configs.pop(experiment.baseline_label)
    candidates = {REPEAT_LABEL: reference, **configs}
    if info.is_cuda:
        candidates.update({label: replace(reference, **changes) for label, changes in SPLIT_TF32})
    ran_reference = effective_config(reference, info)[0]
    chosen, notes = {}, []
    for label, config in candidates.items():
        ran, config_notes = effective_config(config, info)
        if ran == ran_reference and label != REPEAT_LABEL:
            why = "; ".join(n for n in config_notes if "tf32" in n) or "no knob differs on this device"
            notes.append(f"{label}: left out on {info.device.type}, it runs the reference's exact config ({why})")
            continue
        twin = next((other for other, c in chosen.items()
                     if replace(c, optimizer_impl=ran.optimizer_impl) == ran), None)
        if twin:  # the same arithmetic, another optimizer kernel: a question of speed, not of precision
            notes.append(f"{label}: left out, it computes what {twin} computes (only the optimizer's implementation "
                         "differs)")
            continue
        chosen[label] = ran
    return ran_reference, chosen, notes


def _without_dropout(model: nn.Module) -> nn.Module:
    """Train mode (batch statistics, as in training), but dropout off: its random mask is not the question here."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.eval()
    return model


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, config: RunConfig,
                     device: torch.device) -> tuple[torch.Tensor, float, torch.Tensor, float]:
    """Logits, loss, unscaled flat gradients and the loss scale of one forward and backward, as the loop runs them.

    For fp16 the loss is scaled as the loop's GradScaler scales it, and the scale is halved until the gradients are
    finite, as GradScaler's skipped steps would halve it."""
    scaler = make_scaler(config, device)
    amp_dtype = TORCH_DTYPES[config.amp_dtype]
    while True:
        model.zero_grad(set_to_none=True)
        with backend_flags(config):
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(inputs)
                loss = F.cross_entropy(logits, targets)
            scaler.scale(loss).backward()
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        grads = torch.cat([p.grad.detach().flatten().double() / scale for p in model.parameters()])
        if not scaler.is_enabled() or bool(torch.isfinite(grads).all()) or scale < 1:
            return logits.detach().double(), float(loss.detach()), grads, scale
        scaler.update(scale / 2)


def _run(base: nn.Module, config: RunConfig, batches: list, info: DeviceInfo) -> _Pass:
    """One forward and backward on the first batch; then, from the same weights, a training step on every batch."""
    device = info.device
    model = _without_dropout(prepare_model(copy.deepcopy(base), config, device))
    inputs, targets = to_device(batches[0], config, device)
    logits, loss, grads, scale = forward_backward(model, inputs, targets, config, device)

    model = _without_dropout(prepare_model(copy.deepcopy(base), config, device))
    optimizer, scaler = make_optimizer(model, config), make_scaler(config, device)
    losses, skipped = [], 0
    with backend_flags(config):
        for index, batch in enumerate(batches):
            before = scaler.get_scale() if scaler.is_enabled() else 1.0
            losses.append(float(train_step(model, batch, optimizer, scaler, config, device, index)))
            skipped += int(scaler.is_enabled() and scaler.get_scale() < before)
    return _Pass(logits, loss, grads, scale, losses, skipped)


def _yardstick(base: nn.Module, config: RunConfig, batch, info: DeviceInfo) -> _Pass:
    """One forward and backward of the reference in fp64 (weights and inputs). No drift: no loop trains in fp64."""
    model = _without_dropout(prepare_model(copy.deepcopy(base).double(), config, info.device))
    inputs, targets = to_device(batch, config, info.device)
    logits, loss, grads, scale = forward_backward(model, inputs.double(), targets, config, info.device)
    return _Pass(logits, loss, grads, scale, [float("nan")], 0)


def _compare(reference: _Pass, other: _Pass) -> dict[str, float]:
    diff = other.logits - reference.logits
    return {
        "logits_rel_err": float(diff.norm() / reference.logits.norm()),
        "logits_max_abs_err": float(diff.abs().max()),
        "loss_abs_diff": abs(other.loss - reference.loss),
        "grad_rel_err": float((other.grads - reference.grads).norm() / reference.grads.norm()),
        "grad_cosine": float(F.cosine_similarity(other.grads, reference.grads, dim=0)),
        "drift": abs(other.losses[-1] - reference.losses[-1]) / abs(reference.losses[-1]),
        "loss_scale": other.loss_scale,
        "skipped_steps": other.skipped_steps,
        "finite": bool(torch.isfinite(other.logits).all() and torch.isfinite(other.grads).all()),
    }


def precision_numerics(models: Iterable[str] | None = None, profile: "str | Profile | None" = None,
                       device: str = "auto", steps: int = DRIFT_STEPS, seed: int = 0) -> NumericsResult:
    """Errors of every precision against the fp32 reference (TF32 off), per model, as one tidy table.

    Models, width and batch size come from the profile. ``drift`` is the relative difference of the training loss
    after ``steps`` optimizer steps (measured on the next batch) from the same start on the same batches. The first
    row of each model is the reference itself in fp64: the error fp32 makes, against which the others are read.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise OptlabError(f"steps must be an integer >= 1, got {steps!r}")
    info = resolve_device(device)
    prof = get_profile(profile, info.is_cuda)
    source = data.find_source()
    train_set, _ = data.datasets(source)
    rows, notes = [], []
    for model_name in models or prof.models:
        reference_config, variants, model_notes = variant_configs(model_name, prof, info)
        notes += [f"{model_name}: {note}" for note in model_notes]
        loader = data.make_loader(train_set, reference_config, train=True, seed=seed)
        torch.manual_seed(seed)  # the augmentation draws from the global generator
        batches = list(itertools.islice(loader, steps + 1))
        torch.manual_seed(seed)  # the same weights whatever the number of steps
        base = build_model(model_name, reference_config.model_variant, reference_config.width)
        reference = _run(base, reference_config, batches, info)
        passes = {YARDSTICK_LABEL: _yardstick(base, reference_config, batches[0], info)}
        passes.update({label: _run(base, config, batches, info) for label, config in variants.items()})
        rows += [{"device": info.name, "model": model_name, "variant": label, "data": source.kind, "steps": steps,
                  **_compare(reference, other)} for label, other in passes.items()]
    return NumericsResult(pd.DataFrame(rows), notes)


def run_reference(out: "str | Path", device: str = "cuda") -> list[Path]:
    """The GPU reference: the numerics of every model of the quick profile, saved as precision_numerics.csv."""
    result = precision_numerics(profile="quick", device=device, steps=10)
    return [store.save_table(result.table, out, "precision_numerics")]


def loss_distances(losses: pd.DataFrame, references: "tuple[str, ...]" = ("fp32", "bf16 autocast")) -> pd.DataFrame:
    """Per variant of a loss record (rows of variant, step, loss: ``fp8_training.FP8Run.losses``), the relative
    distance of its mean loss over the steps from each reference variant's (``rel_diff_vs_<reference>``): against
    bf16 autocast as well as fp32, so that a variant whose outputs are rounded to bf16 (an FP8 matmul's) is measured
    against that rounding too, and its own share shows."""
    means = losses.groupby("variant", sort=False)["loss"].mean()
    missing = [reference for reference in references if reference not in means.index]
    if missing:
        raise OptlabError(f"no {missing} among the variants {list(means.index)}: a distance needs its reference")
    table = pd.DataFrame({"variant": means.index})
    for reference in references:
        column = f"rel_diff_vs_{reference.split()[0]}"
        table[column] = ((means - means[reference]).abs() / means[reference]).to_numpy()
    return table
