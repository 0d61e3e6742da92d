"""FP8 linear layers' numerics on the GPT: a few training steps with every eligible ``nn.Linear`` in FP8
(:func:`optlab.core.gpt.fp8.swap_linears_to_fp8`) against the same steps in fp32 and in bf16 autocast, from the same
weights on the same batches.

The FP8 run keeps everything else in fp32, so its distance from fp32 is FP8's own rounding. ``backend="torch"`` runs
the torch-only layer on ``torch._scaled_mm``, which runs on a CPU too: there the numerics can be checked, not the
speed (FP8 pays only on GPUs of compute capability 8.9 or newer).

A few steps of a small GPT cannot tell a scaled cast from an unscaled one (its weights and activations sit inside
e4m3's range either way), so :func:`layer_errors` checks every FP8 linear layer on its own: its output and both
gradients against float64, on operands whose magnitude spans what training meets, against the rounding bound of the
formats; :func:`cast_errors` shows where a cast without a scale flushes to zero or saturates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pandas as pd
import torch
from torch import nn

from ...core.machine.device import effective_config, resolve_device
from ...core.gpt.fp8 import (
    ACTIVATION_DTYPE, GRADIENT_DTYPE, WEIGHT_DTYPE, FP8Linear, column_major, convertible,
    swap_linears_to_fp8, to_fp8,
)
from ...core.knobs.limits import check_count, check_overrides
from ...core.measuring.loops import train_step
from ...core.process.quiet import fix_threads
from ...core.knobs.profiles import Profile, get_profile
from ...core.techniques.registry import get_experiment
from ...core.gpt.transformer import GPT, GPT_SIZES
from ...core.run.variants import build_state
from ...core.workload import get_workload

MAX_STEPS = 200  # a numerics check, not a training run
LOSS_RTOL = 0.01  # FP8's mean loss over the steps against fp32's: e4m3 keeps 3 mantissa bits; a loss averages them
VARIANTS = {"fp32": ("none", False), "bf16 autocast": ("bf16", False), "FP8 linears": ("none", True)}  # amp, fp8
# operand RMS values a layer meets in training: activations around 1 with outliers to 1e3, weights 1e-3 to 1 (a deep or
# wide model's init is 0.02 / sqrt(2 x layers)), gradients down to 1e-6 (tiny per-token losses, no loss scaling)
MAGNITUDES = (1e-6, 1e-3, 1.0, 1e3)
PASSES = ("output", "input grad", "weight grad")


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the gap between 1 and the next number: a normal number's largest relative rounding error."""
    return torch.finfo(dtype).eps / 2


# RMS bound of each product's error (see layer_errors): the two operands' formats, fp32 accumulation
BOUNDS = {"output": math.hypot(unit_roundoff(ACTIVATION_DTYPE), unit_roundoff(WEIGHT_DTYPE)),
          "input grad": math.hypot(unit_roundoff(GRADIENT_DTYPE), unit_roundoff(WEIGHT_DTYPE)),
          "weight grad": math.hypot(unit_roundoff(GRADIENT_DTYPE), unit_roundoff(ACTIVATION_DTYPE))}


@dataclass(frozen=True)
class FP8Run:
    """The losses of every step per variant, the FP8 backend used, and how many of the model's linear layers ran in
    FP8 (torch's :class:`~optlab.core.gpt.fp8.FP8Linear` or torchao's ``Float8Linear``, both ``nn.Linear`` subclasses)."""

    losses: pd.DataFrame  # variant, step, loss
    backend: str
    fp8_layers: int
    linear_layers: int

    def summary(self) -> pd.DataFrame:
        """Per variant: the first and last loss, the mean over the steps, and its relative distance from fp32's."""
        table = self.losses.groupby("variant", sort=False)["loss"].agg(first="first", last="last", mean="mean")
        table["rel_diff_vs_fp32"] = (table["mean"] - table.loc["fp32", "mean"]).abs() / table.loc["fp32", "mean"]
        table["tolerance"] = LOSS_RTOL
        return table.reset_index()


def fp8_losses(model: str = "gpt_tiny", steps: int = 10, backend: str = "torch", device: str = "auto",
               profile: "str | Profile | None" = None, seed: int = 0, batch_size: int | None = None) -> FP8Run:
    """Train ``model`` ``steps`` optimizer steps three times from the same weights on the same batches: in fp32, in
    bf16 autocast, and with its linear layers in FP8 (``backend``: "torch", "torchao" or "auto"), and record every
    step's loss. ``batch_size``: sequences a step (the profile's if None)."""
    steps = check_count("steps", steps, 1, MAX_STEPS, "a numerics check needs a few steps")
    info = resolve_device(device)
    fix_threads(info.is_cuda)
    base = get_experiment("gpt_precision").configs(model, get_profile(profile, info.is_cuda))["fp32 strict"]
    workload = get_workload(base.workload)
    if batch_size is not None:
        check_overrides({"batch_size": batch_size}, workload)
        base = replace(base, batch_size=batch_size)
    train_set, test_set = workload.datasets(workload.find_source(False), False)
    rows, used, swapped, linears = [], "", 0, 0
    for label, (amp, fp8) in VARIANTS.items():
        config, _ = effective_config(replace(base, amp_dtype=amp), info)
        state = build_state(config, info, train_set, test_set, seed)
        linears = sum(isinstance(m, nn.Linear) for m in state.model.modules())
        if fp8:
            used = swap_linears_to_fp8(state.model, backend)
            swapped = sum(type(m) is not nn.Linear and isinstance(m, nn.Linear) for m in state.model.modules())
        state.model.train()
        batches = iter(state.loaders["train"])
        for step in range(1, steps + 1):
            loss = train_step(state.model, next(batches), state.optimizer, state.scaler, config, info.device, 0,
                              loss_fn=workload.loss)
            rows.append({"variant": label, "step": step, "loss": float(loss.float())})
    return FP8Run(pd.DataFrame(rows), used, swapped, linears)


def _product_scale(a: torch.Tensor, b: torch.Tensor) -> float:
    """sqrt(sum_k |a[:, k]|^2 |b[k, :]|^2) for ``a @ b``: the error of ``a @ b`` when each operand element carries an
    independent relative error of RMS 1 (the yardstick a rounding bound multiplies)."""
    return float((a.double().pow(2).sum(0) * b.double().pow(2).sum(1)).sum().sqrt())


def layer_errors(model: str = "gpt_tiny", magnitudes: tuple[float, ...] = MAGNITUDES, rows: int = 64,
                 seed: int = 0) -> pd.DataFrame:
    """Every FP8 linear layer of ``model`` (the torch-only :class:`~optlab.core.gpt.fp8.FP8Linear`), one forward and
    backward pass per operand magnitude: its weight rescaled to RMS ``m``, an input and an upstream gradient of RMS
    ``m``. Each product (output, input gradient, weight gradient) is compared with float64, and its error with the
    rounding bound: with every operand element rounded to nearest in its format (relative error at most ``u``, half
    the format's epsilon: 2^-4 for e4m3, 2^-3 for e5m2), the error of ``a @ b`` has an RMS of at most
    ``hypot(u_a, u_b) * sqrt(sum_k |a[:, k]|^2 |b[k, :]|^2)``. A per-tensor scale keeps every operand in range at any
    magnitude; a cast without one flushes small values to zero and saturates large ones, far past the bound. ``rows``
    input rows give each product thousands of elements, an RMS to a few percent (more rows only add e4m3 products,
    which run a reference kernel on some CPUs)."""
    sizes = GPT_SIZES[model]
    generator = torch.Generator().manual_seed(seed)
    net = GPT(sizes)
    layers = [(name, m) for name, m in net.named_modules() if isinstance(m, nn.Linear)]
    table = []
    for name, linear in layers:
        if not convertible(linear, {id(net.token_embedding.weight)}):
            continue
        for magnitude in magnitudes:
            weight = linear.weight.detach() * (magnitude / linear.weight.detach().pow(2).mean().sqrt())
            x = torch.randn(rows, linear.in_features, generator=generator) * magnitude
            upstream = torch.randn(rows, linear.out_features, generator=generator) * magnitude
            errors = _pass_errors(weight, x, upstream)
            table += [{"layer": name, "magnitude": magnitude, "pass": key, "rel_err": value, "bound": BOUNDS[key]}
                      for key, value in errors.items()]
    frame = pd.DataFrame(table)
    frame["within"] = frame["rel_err"] <= frame["bound"]
    return frame


def _pass_errors(weight: torch.Tensor, x: torch.Tensor, upstream: torch.Tensor) -> dict[str, float]:
    """The three products of one FP8 linear layer (no bias) against float64, each over its rounding yardstick."""
    layer = FP8Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.clone())
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(upstream)
    out = out.detach()
    w, x64, g = weight.double(), x.detach().double(), upstream.double()
    exact = {"output": (out, x64 @ w.t(), _product_scale(x64, w.t())),
             "input grad": (x.grad, g @ w, _product_scale(g, w)),
             "weight grad": (layer.weight.grad, g.t() @ x64, _product_scale(g.t(), x64))}
    return {key: float((value.double() - reference).norm()) / scale if scale > 0 else float("nan")
            for key, (value, reference, scale) in exact.items()}


def cast_errors(magnitudes: tuple[float, ...] = MAGNITUDES, size: int = 64, seed: int = 0) -> pd.DataFrame:
    """One FP8 matmul of two e4m3 operands of RMS ``m`` against fp32, with per-tensor scales and without (the operands
    cast as they are), per magnitude: the relative error of each, and the share of the unscaled operands' nonzero
    elements that the cast flushed to zero or saturated at e4m3's largest value (448)."""
    generator = torch.Generator().manual_seed(seed)
    limit = torch.finfo(ACTIVATION_DTYPE).max
    one, rows = torch.ones(()), []
    for magnitude in magnitudes:
        a, b = (torch.randn(size, size, generator=generator) * magnitude for _ in range(2))
        exact = a @ b.t()
        (a8, sa), (b8, sb) = to_fp8(a, ACTIVATION_DTYPE), to_fp8(b, ACTIVATION_DTYPE)
        scaled = torch._scaled_mm(a8, column_major(b8.t()), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        raw_a, raw_b = a.to(ACTIVATION_DTYPE), b.to(ACTIVATION_DTYPE)
        raw = torch._scaled_mm(raw_a, column_major(raw_b.t()), scale_a=one, scale_b=one, out_dtype=torch.float32)
        cast = torch.cat([raw_a.float().flatten(), raw_b.float().flatten()])
        norm = float(exact.norm())
        rows.append({"magnitude": magnitude, "scaled_rel_err": float((scaled - exact).norm()) / norm,
                     "unscaled_rel_err": float((raw - exact).norm()) / norm,
                     "unscaled_flushed": float((cast == 0).float().mean()),
                     "unscaled_saturated": float((cast.abs() >= limit).float().mean())})
    return pd.DataFrame(rows)
