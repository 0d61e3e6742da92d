"""FP8 linear layers for training: torchao's float8 training where it is installed, else a torch-only layer.

The torch-only layer quantizes per tensor with an amax-based scale: weights and activations to ``float8_e4m3fn``,
gradients to ``float8_e5m2`` (more range, less precision), and multiplies with ``torch._scaled_mm`` in the forward pass
and in both matmuls of the backward pass. Its output has the dtype ``nn.Linear``'s would have: the autocast dtype under
autocast, else the input's. FP8 pays only on GPUs of compute capability 8.9 or newer; on a
CPU ``torch._scaled_mm`` runs too, so the numerics can be checked there (not the speed): ask for ``backend="torch"``.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import OptlabError, choice_error

BACKENDS = ("auto", "torchao", "torch")
WEIGHT_DTYPE = ACTIVATION_DTYPE = torch.float8_e4m3fn
GRADIENT_DTYPE = torch.float8_e5m2
OUT_DTYPE = torch.bfloat16  # the output of a bare FP8 product (scaled_mm_runs, a measured peak)
MIN_CAPABILITY = (8, 9)
ALIGN = 16  # torch._scaled_mm on a GPU wants every matrix dimension a multiple of 16


def fp8_support(device: torch.device | str) -> str | None:
    """None when FP8 training can pay on ``device`` (a CUDA GPU of compute capability 8.9 or newer), else one line
    saying why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"FP8 training needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
                f"newer; this is a {device.type.upper()} (torch._scaled_mm runs here, so only the numerics can be "
                "checked)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"FP8 matmuls need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, "
                f"Hopper, Blackwell); this GPU has {major}.{minor}")
    return None


def torchao_available() -> bool:
    """Whether torchao's float8 training can be imported."""
    return importlib.util.find_spec("torchao") is not None and importlib.util.find_spec("torchao.float8") is not None


def auto_backend() -> str:
    """The backend ``swap_linears_to_fp8(model)`` takes here: "torchao" where torchao is installed, else "torch"."""
    return "torchao" if torchao_available() else "torch"


def backend_note() -> str:
    """One line for a run's record: which FP8 layers its ``fp8`` variants run."""
    if auto_backend() == "torchao":
        return "fp8: linear layers by torchao's float8 training (backend torchao)"
    return "fp8: linear layers by optlab's torch-only FP8Linear (backend torch; torchao is not installed)"


def scaled_mm_runs(device: torch.device | str) -> str | None:
    """None when ``torch._scaled_mm`` multiplies FP8 matrices on ``device`` (a tiny call is tried), else why not."""
    device = torch.device(device)
    a = torch.ones(ALIGN, ALIGN, device=device).to(ACTIVATION_DTYPE)
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=OUT_DTYPE)
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        return f"torch._scaled_mm does not run on {device.type}: {(str(error).splitlines() or [''])[0]}"
    return None


def to_fp8(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` scaled so its largest magnitude meets ``dtype``'s largest value, cast to ``dtype``; with the
    inverse scale that ``torch._scaled_mm`` multiplies back."""
    limit = torch.finfo(dtype).max
    amax = tensor.detach().abs().amax().float().clamp(min=1e-12)
    scale = limit / amax
    return (tensor.float() * scale).clamp(-limit, limit).to(dtype), scale.reciprocal()


def column_major(matrix: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column by column (``torch._scaled_mm``'s layout for its second operand)."""
    return matrix.t().contiguous().t()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype = OUT_DTYPE) -> torch.Tensor:
    """``a @ b`` of two FP8 matrices times their inverse scales, accumulated in fp32 and returned in ``out_dtype``."""
    return torch._scaled_mm(a.contiguous(), column_major(b), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would return for ``x``: the autocast dtype where autocast is on, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class FP8Matmul(torch.autograd.Function):
    """``x @ weight.T`` in ``out_dtype``, with both operands in e4m3 and, in the backward pass, the gradient in e5m2."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        x8, x_scale = to_fp8(x, ACTIVATION_DTYPE)
        w8, w_scale = to_fp8(weight, WEIGHT_DTYPE)
        ctx.save_for_backward(x8, x_scale, w8, w_scale)
        ctx.dtypes = (x.dtype, weight.dtype)
        return scaled_mm(x8, w8.t(), x_scale, w_scale, out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x8, x_scale, w8, w_scale = ctx.saved_tensors
        g8, g_scale = to_fp8(grad, GRADIENT_DTYPE)
        grad_x = scaled_mm(g8, w8, g_scale, w_scale, ctx.dtypes[0])  # [M, N] @ [N, K]
        grad_w = scaled_mm(g8.t(), x8, g_scale, x_scale, ctx.dtypes[1])  # [N, M] @ [M, K]
        return grad_x, grad_w, None


class FP8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in FP8 (``FP8Matmul``); weights and bias stay in their own dtype, and the
    output's dtype is ``nn.Linear``'s (``output_dtype``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        pad = -rows.shape[0] % ALIGN
        padded = F.pad(rows, (0, 0, 0, pad)) if pad else rows
        out = FP8Matmul.apply(padded, self.weight, output_dtype(x))[:rows.shape[0]]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FP8Linear":
        layer = cls.__new__(cls)
        layer.__dict__ = linear.__dict__  # the same parameters, hooks and training flag: a change of forward only
        return layer


def convertible(module: nn.Module, tied: set[int]) -> bool:
    """An ``nn.Linear`` whose weight no embedding shares and whose sizes fit FP8 matmuls (multiples of 16)."""
    return (isinstance(module, nn.Linear) and id(module.weight) not in tied
            and module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0)


def swap_linears_to_fp8(model: nn.Module, backend: str = "auto") -> str:
    """Replace ``model``'s ``nn.Linear`` layers (not a head tied to an embedding, nor layers whose sizes are not
    multiples of 16) with FP8 linear layers, in place; return the backend used: "torchao" or "torch".

    "auto" takes torchao's float8 training when it is installed, else the torch-only :class:`FP8Linear`, and
    refuses a device where FP8 does not pay (:func:`fp8_support`). "torch" asks for the torch-only layer on any
    device where ``torch._scaled_mm`` runs, a CPU included (for checking numerics).
    """
    if backend not in BACKENDS:
        raise choice_error("FP8 backend", backend, BACKENDS)
    device = next(model.parameters()).device
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if backend == "torch":
        if reason := scaled_mm_runs(device):
            raise OptlabError(reason)
    elif reason := fp8_support(device):
        raise OptlabError(reason)
    elif backend == "torchao" and not torchao_available():
        raise OptlabError("the torchao FP8 backend needs torchao installed; choose 'torch' for the torch-only layer")
    elif auto_backend() == "torchao":
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(model, module_filter_fn=lambda module, fqn: convertible(module, tied))
        return "torchao"
    swaps = [(name, module) for name, module in model.named_modules() if name and convertible(module, tied)]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, FP8Linear.from_linear(module))
    return "torch"
