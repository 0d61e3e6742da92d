"""FLOPs per step from ``torch.utils.flop_counter``, and achieved TFLOP/s."""
from __future__ import annotations

from functools import lru_cache

import torch
from torch.utils.flop_counter import FlopCounterMode

from .models import build_model

TRAIN_TO_FORWARD = 3  # backward costs about twice the forward: the usual 6 x MACs per trained image


@lru_cache(maxsize=None)
def forward_flops_per_image(model: str, variant: str = "base", width: float = 1.0) -> int:
    """FLOPs of one forward pass on one 32x32 image, counted by FlopCounterMode on the meta device.

    Training FLOPs are derived as 3 x forward rather than counted, because FlopCounterMode overcounts the
    backward of depthwise convolutions (MobileNetV2: 21x the forward in torch 2.14).
    """
    with torch.device("meta"):
        net = build_model(model, variant, width)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(torch.empty(1, 3, 32, 32, device="meta"))
    return counter.get_total_flops()


def step_flops(model: str, variant: str, width: float, images: int, train: bool) -> int:
    """FLOPs of one step over ``images`` images: forward only for evaluation, forward + backward for training."""
    per_image = forward_flops_per_image(model, variant, width)
    return per_image * images * (TRAIN_TO_FORWARD if train else 1)


def tflops(flops: float, seconds: float) -> float:
    """Achieved TFLOP/s."""
    return flops / seconds / 1e12 if seconds > 0 else float("nan")
