"""FLOPs per step from ``torch.utils.flop_counter``, and achieved TFLOP/s."""
from __future__ import annotations

from functools import lru_cache

import torch
from torch.utils.flop_counter import FlopCounterMode

from .workload import get_workload

TRAIN_TO_FORWARD = 3  # backward costs about twice the forward: the usual 6 x MACs per trained sample


@lru_cache(maxsize=None)
def forward_flops_per_sample(model: str, variant: str = "base", width: float = 1.0, workload: str = "cifar") -> int:
    """FLOPs of one forward pass on one sample of ``workload`` (its ``example_input(1)``: one image, one token
    sequence), counted by FlopCounterMode on the meta device (attention included where the model has it).

    Training FLOPs are derived as 3 x forward rather than counted, because FlopCounterMode overcounts the
    backward of depthwise convolutions (MobileNetV2: 21x the forward in torch 2.14).
    """
    spec = get_workload(workload)
    with torch.device("meta"):
        net = spec.build_model(model, variant, width)
        example = spec.example_input(1)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(example)
    return counter.get_total_flops()


def forward_flops_per_image(model: str, variant: str = "base", width: float = 1.0) -> int:
    """:func:`forward_flops_per_sample` of a CIFAR model: one 32x32 image."""
    return forward_flops_per_sample(model, variant, width, "cifar")


def step_flops(model: str, variant: str, width: float, samples: int, train: bool, workload: str = "cifar") -> int:
    """FLOPs of one step over ``samples`` samples: forward only for evaluation, forward + backward for training."""
    per_sample = forward_flops_per_sample(model, variant, width, workload)
    return per_sample * samples * (TRAIN_TO_FORWARD if train else 1)


def tflops(flops: float, seconds: float) -> float:
    """Achieved TFLOP/s."""
    return flops / seconds / 1e12 if seconds > 0 else float("nan")
