"""FP8 linear layers' numerics on the GPT: a few training steps with every eligible ``nn.Linear`` in FP8
(:func:`optlab.core.fp8.swap_linears_to_fp8`) against the same steps in fp32 and in bf16 autocast, from the same
weights on the same batches.

The FP8 run keeps everything else in fp32, so its distance from fp32 is FP8's own rounding. ``backend="torch"`` runs
the torch-only layer on ``torch._scaled_mm``, which runs on a CPU too: there the numerics can be checked, not the
speed (FP8 pays only on GPUs of compute capability 8.9 or newer).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pandas as pd
import torch
from torch import nn

from ..core.device import effective_config, resolve_device
from ..core.fp8 import ACTIVATION_DTYPE, OUT_DTYPE, column_major, swap_linears_to_fp8, to_fp8
from ..core.limits import check_count
from ..core.loops import train_step
from ..core.quiet import fix_threads
from ..core.profiles import Profile, get_profile
from ..core.registry import get_experiment
from ..core.variants import build_state
from ..core.workload import get_workload

MAX_STEPS = 200  # a numerics check, not a training run
LOSS_RTOL = 0.01  # FP8's mean loss over the steps against fp32's: e4m3 keeps 3 mantissa bits; a loss averages them
VARIANTS = {"fp32": ("none", False), "bf16 autocast": ("bf16", False), "FP8 linears": ("none", True)}  # amp, fp8


@dataclass(frozen=True)
class FP8Run:
    """The losses of every step per variant, the FP8 backend used, and how many of the model's linear layers ran in
    FP8 (torch's :class:`~optlab.core.fp8.FP8Linear` or torchao's ``Float8Linear``, both ``nn.Linear`` subclasses)."""

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
               profile: "str | Profile | None" = None, seed: int = 0) -> FP8Run:
    """Train ``model`` ``steps`` optimizer steps three times from the same weights on the same batches: in fp32, in
    bf16 autocast, and with its linear layers in FP8 (``backend``: "torch", "torchao" or "auto"), and record every
    step's loss."""
    steps = check_count("steps", steps, 1, MAX_STEPS, "a numerics check needs a few steps")
    info = resolve_device(device)
    fix_threads(info.is_cuda)
    base = get_experiment("gpt_precision").configs(model, get_profile(profile, info.is_cuda))["fp32 strict"]
    workload = get_workload(base.workload)
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


def scaled_mm_error(rows: int = 64, cols: int = 64, inner: int = 64, seed: int = 0) -> dict[str, float]:
    """One FP8 matmul against fp32: the relative error of ``torch._scaled_mm`` with per-tensor scales, and of the same
    product without its scales (the inputs cast straight to e4m3, where small values underflow and large ones clip)."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, inner, generator=generator) * 1e-3  # activations far below e4m3's normal range
    b = torch.randn(cols, inner, generator=generator) * 1e-3
    exact = a @ b.t()
    (a8, sa), (b8, sb) = to_fp8(a, ACTIVATION_DTYPE), to_fp8(b, ACTIVATION_DTYPE)
    scaled = torch._scaled_mm(a8, column_major(b8.t()), scale_a=sa, scale_b=sb, out_dtype=OUT_DTYPE).float()
    one = torch.ones(())
    raw = torch._scaled_mm(a.to(ACTIVATION_DTYPE), column_major(b.to(ACTIVATION_DTYPE).t()), scale_a=one,
                           scale_b=one, out_dtype=OUT_DTYPE).float()
    norm = float(exact.norm())
    return {"scaled_rel_err": float((scaled - exact).norm()) / norm,
            "unscaled_rel_err": float((raw - exact).norm()) / norm}
