"""Does every attention kernel compute the hand-written causal attention?

Each kernel of :data:`~optlab.core.knobs.config.ATTENTIONS` runs through the model's own code
(:meth:`~optlab.core.gpt.transformer.CausalSelfAttention.attend`) on the same queries, keys and values, forward and, where
it runs, backward with the same upstream gradient. Its output and its gradients with respect to q, k and v are
compared with the hand-written kernel's in the same dtype, within a tolerance per dtype (:data:`TOLERANCES`). A
kernel that does not run on the device gets the one line saying why instead of numbers.
"""
from __future__ import annotations

import warnings

import pandas as pd
import torch

from ...core.knobs.config import ATTENTIONS
from ...core.errors import OptlabError, choice_error
from ...core.gpt.transformer import CausalSelfAttention, GPTConfig

REFERENCE = "manual"
# Largest absolute difference allowed against the hand-written kernel in the same dtype, for outputs and gradients of
# order 1: a few units in the last place of each format, summed over a softmax of up to a few thousand keys.
TOLERANCES = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}
LIMITS = {"batch": 64, "heads": 64, "seq_len": 4096, "head_dim": 256}


def _check_sizes(sizes: dict[str, int]) -> None:
    for name, value in sizes.items():
        limit = LIMITS[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise OptlabError(f"attention check: {name} must be a whole number from 1 to {limit}, got {value!r}")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _run(attention: str, inputs: tuple[torch.Tensor, ...], upstream: torch.Tensor, backward: bool):
    """The kernel's output (and q, k, v gradients with ``backward``) on fresh leaf copies of ``inputs``."""
    heads, head_dim = inputs[0].shape[1], inputs[0].shape[3]
    config = GPTConfig(vocab_size=8, block_size=inputs[0].shape[2], n_layer=1, n_head=heads, n_embd=heads * head_dim)
    layer = CausalSelfAttention(config, attention).to(inputs[0].device).eval()
    q, k, v = (tensor.detach().clone().requires_grad_(backward) for tensor in inputs)
    with torch.set_grad_enabled(backward), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention's and SDPA's kernel-choice warnings: the row says it
        out = layer.attend(q, k, v)
        if not backward:
            return out.detach(), None
        out.backward(upstream)
    return out.detach(), torch.cat([t.grad.flatten() for t in (q, k, v)])


def attention_agreement(device: "torch.device | str" = "cpu", dtype: str = "float32", batch: int = 2, heads: int = 2,
                        seq_len: int = 64, head_dim: int = 32, seed: int = 0) -> pd.DataFrame:
    """One row per attention kernel against the hand-written one on ``device`` in ``dtype``: ``runs`` ("forward and
    backward", "forward only" or "no"), the largest absolute difference of the output and of the q, k, v gradients,
    the ``tolerance``, ``agrees`` (every difference measured within the tolerance; None where the kernel does not
    run), and ``why`` a kernel or its
    backward does not run (empty where it does)."""
    if dtype not in TOLERANCES:
        raise choice_error("dtype", dtype, tuple(TOLERANCES))
    _check_sizes({"batch": batch, "heads": heads, "seq_len": seq_len, "head_dim": head_dim})
    device, tolerance = torch.device(device), TOLERANCES[dtype]
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq_len, head_dim)
    inputs = tuple(torch.randn(shape, generator=generator).to(device, getattr(torch, dtype)) for _ in range(3))
    upstream = torch.randn(shape, generator=generator).to(device, getattr(torch, dtype))
    reference_out, reference_grad = _run(REFERENCE, inputs, upstream, backward=True)
    rows = []
    for attention in ATTENTIONS:
        row = {"kernel": attention, "runs": "forward and backward", "output max abs diff": float("nan"),
               "gradient max abs diff": float("nan"), "tolerance": tolerance, "agrees": None, "why": ""}
        try:
            out, grad = _run(attention, inputs, upstream, backward=True)
        except (RuntimeError, NotImplementedError) as error:
            row["why"] = f"no backward: {_first_line(error)}"
            try:
                out, grad = _run(attention, inputs, upstream, backward=False)
                row["runs"] = "forward only"
            except (RuntimeError, NotImplementedError) as error:
                row.update(runs="no", why=_first_line(error))
                rows.append(row)
                continue
        row["output max abs diff"] = (out.float() - reference_out.float()).abs().max().item()
        differences = [row["output max abs diff"]]
        if grad is not None:
            row["gradient max abs diff"] = (grad.float() - reference_grad.float()).abs().max().item()
            differences.append(row["gradient max abs diff"])
        row["agrees"] = all(difference <= tolerance for difference in differences)
        rows.append(row)
    table = pd.DataFrame(rows)
    table.attrs["note"] = (f"{device.type}, {dtype}: {batch} x {heads} heads x {seq_len} tokens x {head_dim}, against "
                           f"the hand-written kernel in {dtype}, tolerance {tolerance:g} (largest absolute difference)")
    return table
