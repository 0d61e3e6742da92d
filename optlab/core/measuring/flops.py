"""FLOPs per step from ``torch.utils.flop_counter``, and achieved TFLOP/s."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import torch

from ..knobs.config import RunConfig
from ..workload import get_workload

TRAIN_TO_FORWARD = 3  # backward costs about twice the forward: the usual 6 x MACs per trained sample


def forward_flop_counts(config: RunConfig) -> dict[str, int]:
    """FLOPs of one forward pass on one sample of ``config``'s model, per operator (``"aten.mm"``, ...), counted by
    FlopCounterMode on the meta device under the workload's ``counting_knobs``. Counted once per model shape: the
    configs that differ only in how they run it (precision, layout, optimizer, loader) share one count, which takes
    seconds for a MobileNetV2 on a CPU."""
    spec = get_workload(config.workload)
    counted = replace(config, **spec.counting_knobs)
    return _shape_flop_counts(RunConfig(workload=config.workload, model=config.model,
                                        model_variant=config.model_variant, width=config.width,
                                        **spec.knobs_of(counted)))


@lru_cache(maxsize=None)
def _shape_flop_counts(config: RunConfig) -> dict[str, int]:
    spec = get_workload(config.workload)
    with torch.device("meta"):
        net = spec.build(config)
        example = spec.input_for(1, config)
    from torch.utils.flop_counter import FlopCounterMode  # on first use: it imports triton, 0.4 s a process
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(example)
    return {str(op): count for op, count in counter.get_flop_counts().get("Global", {}).items()}


def forward_flops_of(config: RunConfig) -> int:
    """FLOPs of one forward pass on one sample of ``config``'s model (its workload's example input for the config: one
    image, one token sequence), counted by FlopCounterMode on the meta device, attention included where the model has
    it (counted under the workload's ``counting_knobs``: the same arithmetic in kernels the counter knows).

    Training FLOPs are derived as 3 x forward rather than counted, because FlopCounterMode overcounts the
    backward of depthwise convolutions (MobileNetV2: 21x the forward in torch 2.14).
    """
    return sum(forward_flop_counts(config).values())


def forward_flops_per_sample(model: str, variant: str = "base", width: float = 1.0, workload: str = "cifar") -> int:
    """:func:`forward_flops_of` the workload's ``model`` with its other knobs at their defaults."""
    return forward_flops_of(RunConfig(workload=workload, model=model, model_variant=variant, width=width))


def forward_flops_per_image(model: str, variant: str = "base", width: float = 1.0) -> int:
    """:func:`forward_flops_per_sample` of a CIFAR model: one 32x32 image."""
    return forward_flops_per_sample(model, variant, width, "cifar")


def config_step_flops(config: RunConfig, train: bool) -> int:
    """FLOPs of one step of ``config`` (its samples per step): forward only for evaluation, forward + backward for
    training."""
    return forward_flops_of(config) * config.samples_per_step * (TRAIN_TO_FORWARD if train else 1)


def step_flops(model: str, variant: str, width: float, samples: int, train: bool, workload: str = "cifar") -> int:
    """FLOPs of one step over ``samples`` samples: forward only for evaluation, forward + backward for training."""
    per_sample = forward_flops_per_sample(model, variant, width, workload)
    return per_sample * samples * (TRAIN_TO_FORWARD if train else 1)


def tflops(flops: float, seconds: float) -> float:
    """Achieved TFLOP/s."""
    return flops / seconds / 1e12 if seconds > 0 else float("nan")
