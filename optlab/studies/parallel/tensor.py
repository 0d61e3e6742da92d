"""Tensor and sequence parallelism on the book's GPT, with DTensor's ``parallelize_module``.

Megatron's split of a block: the attention's fused ``qkv`` and the MLP's ``fc`` are split by output columns
(``ColwiseParallel``: each rank computes its own heads and its own slice of the hidden layer), their ``proj`` layers by
input rows (``RowwiseParallel``: each rank's partial product is summed over the ranks). Forward then all-reduces the
activations twice per block, backward twice. With ``sequence=True`` the norms run on a slice of the sequence
(``SequenceParallel``): the all-reduces become an all-gather before each split layer and a reduce-scatter after it.
Embeddings and the tied head stay whole on every rank.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
)

from ...core.errors import OptlabError
from ...core.gpt.transformer import GPT, CausalSelfAttention


class ShardedHeadsAttention(CausalSelfAttention):
    """Causal self-attention over this rank's heads only: ``qkv`` gives [q | k | v] of ``n_head / tp`` heads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        qkv = self.qkv(x)  # [n, t, 3 * c_local], this rank's heads
        c = qkv.shape[-1] // 3
        q, k, v = (part.view(n, t, self.n_head, c // self.n_head).transpose(1, 2) for part in qkv.split(c, dim=2))
        y = self.attend(q, k, v)
        return self.proj_dropout(self.proj(y.transpose(1, 2).contiguous().view(n, t, c)))


def group_heads(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """The fused [q | k | v] rows reordered to [q0 k0 v0 | q1 k1 v1 | ...], rank r's heads in block r, so that a
    split by output columns gives each rank the q, k and v of its own heads (Megatron stores them so too)."""
    return weight.reshape(3, tp, -1, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def ungroup_heads(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """The inverse of :func:`group_heads`: back to the one-process [q | k | v] order."""
    return weight.reshape(tp, 3, -1, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def block_plan(sequence: bool) -> dict[str, object]:
    """The parallel style of each module of a block: Megatron's column/row split, with sequence-parallel norms."""
    if not sequence:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    return {"norm1": SequenceParallel(), "attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(), "mlp.fc": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


def tensor_parallel(model: GPT, mesh: DeviceMesh, sequence: bool = False) -> GPT:
    """``model`` split over the ranks of ``mesh`` (1-D) in place: every block by :func:`block_plan`; with
    ``sequence`` the residual stream between the blocks holds a slice of the sequence on each rank, cut after the
    embeddings and gathered again before the head."""
    tp = mesh.size()
    config = model.config
    if config.n_head % tp:
        raise OptlabError(f"tensor parallelism over {tp} ranks needs a head count divisible by {tp}, "
                          f"got n_head={config.n_head}")
    for block in model.blocks:
        attention = block.attn
        with torch.no_grad():
            attention.qkv.weight.copy_(group_heads(attention.qkv.weight, tp))
            if attention.qkv.bias is not None:
                attention.qkv.bias.copy_(group_heads(attention.qkv.bias, tp))
        attention.__class__ = ShardedHeadsAttention
        attention.n_head = config.n_head // tp
        parallelize_module(block, mesh, block_plan(sequence))
    if sequence:
        parallelize_module(model, mesh, {
            "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                           use_local_output=True),
            "norm": SequenceParallel(),
            "head": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                       use_local_output=True),
        })
    return model


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank must call it), a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_state(model: nn.Module, tp: int, gradients: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or, with ``gradients``, its gradient) gathered in full and in the one-process layout (the
    ``qkv`` rows back in [q | k | v] order), by name. Every rank must call it."""
    state = {}
    for name, parameter in model.named_parameters():
        value = full(parameter.grad if gradients else parameter).detach().clone()
        state[name] = ungroup_heads(value, tp) if ".attn.qkv." in name else value
    return state
