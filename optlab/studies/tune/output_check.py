"""Whether an inference step left a model's outputs where they were: its outputs against the starting point's
(fp32 eager) on the same inputs, within a tolerance per precision, and for a classifier its top-1 classes."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ...core.knobs.config import RunConfig
from ...core.machine.device import DeviceInfo
from ...core.errors import OptlabError
from .inputs import describe_error, main_output

# Outputs against the starting point's, per sample: the largest difference over the largest reference output. TF32
# rounds convolution inputs to 10 mantissa bits (the starting point's own precision on a GPU, but another algorithm,
# such as a channels-last kernel, rounds elsewhere); bf16 keeps 8 bits. The top-1 class may change on at most the
# same share of samples (none in fp32; near-ties of a freshly initialised model in 16-bit).
OUTPUT_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "16-bit": 5e-2}

OutputFn = Callable[[Any], torch.Tensor]


def precision(config: RunConfig, info: DeviceInfo) -> str:
    """How a configuration computes, in words: autocast keeps the weights in fp32 and runs eligible kernels in 16-bit."""
    if config.amp_dtype != "none":
        return f"{config.amp_dtype} autocast (fp32 weights)"
    if info.is_cuda and config.cudnn_tf32:
        return "fp32 (TF32 convolutions)"
    return "fp32"


def tolerance(config: RunConfig, info: DeviceInfo) -> float:
    """The output tolerance of a configuration's precision (:data:`OUTPUT_TOLERANCE`)."""
    if config.amp_dtype != "none":
        return OUTPUT_TOLERANCE["16-bit"]
    return OUTPUT_TOLERANCE["tf32" if info.is_cuda and (config.cudnn_tf32 or config.matmul_tf32) else "fp32"]


def _classes(reference: torch.Tensor) -> bool:
    """A classifier's ``[N, C]`` or a token model's ``[N, T, V]`` outputs: scores over the last dimension."""
    return reference.dim() in (2, 3) and reference.shape[-1] >= 2


def output_change(reference: torch.Tensor, outputs: torch.Tensor) -> tuple[float, float | None]:
    """The largest relative error and, for scores over classes, the share of top-1 choices unchanged (None
    otherwise). Per sample for ``[N, C]`` outputs, per token for ``[N, T, V]`` (each position's scores over the
    vocabulary are one item): the largest absolute difference over the largest absolute reference score, for the
    worst item; the top-1 agreement over every item. Outputs of another shape, or not finite, are infinitely far."""
    if outputs.shape != reference.shape:
        return math.inf, (0.0 if _classes(reference) else None)
    items = reference.shape[-1] if reference.dim() == 3 else None  # a token model's vocabulary
    ref = reference.float().reshape(-1, items) if items else reference.float().reshape(len(reference), -1)
    out = outputs.float().reshape(ref.shape)
    scale = ref.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    error = float(((out - ref).abs().amax(dim=1) / scale).max())
    if not math.isfinite(error):
        error = math.inf
    top1 = None
    if _classes(reference):
        top1 = float((outputs.argmax(dim=-1) == reference.argmax(dim=-1)).float().mean())
    return error, top1


def within_tolerance(error: float, top1: float | None, limit: float) -> bool:
    """Outputs unchanged: the relative error within ``limit``, and the top-1 class changed on at most that share."""
    return error <= limit and (top1 is None or 1.0 - top1 <= limit)


def pick_output(raw: Any, output_fn: OutputFn | None) -> torch.Tensor:
    """The tensor of a model's output that is compared: what ``output_fn`` picks from it, or else the output itself,
    a dict's ``logits`` (or its only tensor), a tuple's first tensor (:func:`~.inputs.main_output`)."""
    if output_fn is None:
        picked = main_output(raw)
        if isinstance(picked, torch.Tensor):
            return picked
        raise OptlabError(f"the model returned a {type(raw).__name__} without 'logits' or a single tensor: pass "
                          "output_fn (--output-fn PACKAGE.MODULE:CALLABLE), a function that picks the tensor to "
                          "compare from it, such as lambda out: out['scores']")
    try:
        picked = output_fn(raw)
    except Exception as error:  # noqa: BLE001  (the user's function: its error, in one line)
        raise OptlabError(f"output_fn failed on the model's output (a {type(raw).__name__}): "
                          f"{describe_error(error)}") from None
    if not isinstance(picked, torch.Tensor):
        raise OptlabError(f"output_fn returned a {type(picked).__name__}, not a tensor")
    return picked
