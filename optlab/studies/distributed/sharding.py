"""Sharded data parallelism with FSDP2: the wrapping, the workload it trains, and what each rank holds.

``fully_shard`` splits every parameter along its first dimension over the ranks (a ``DTensor`` shard each). Each
block is sharded on its own, then the root: forward all-gathers one block's parameters just before it runs and frees
them after it (``reshard_after_forward``), and backward reduce-scatters every block's gradients, so each rank keeps
only its shard of the parameters, of the gradients and of the optimizer state.

The code is generic over a :class:`Workload`: a model builder whose module has a ``.blocks`` ``nn.ModuleList``, a
batch maker and a loss. :func:`build_transformer` is the transformer track's GPT, at the size the chapter and the checks train.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ...core.errors import OptlabError
from ...core.gpt.transformer import GPT, GPTConfig

VOCAB, WIDTH, DEPTH, HEADS, CONTEXT = 256, 64, 2, 4, 32  # a GPT at toy size: a CPU step takes milliseconds


def build_transformer() -> nn.Module:
    """The transformer track's GPT (:class:`optlab.core.gpt.transformer.GPT`) at a size a CPU trains in milliseconds:
    ``forward(idx [N, T]) -> logits [N, T, VOCAB]``, with ``.blocks``."""
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=CONTEXT, n_layer=DEPTH, n_head=HEADS, n_embd=WIDTH))


def token_batch(batch_size: int, seed: int) -> torch.Tensor:
    """``batch_size`` random token sequences of ``CONTEXT`` tokens, the same for the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, CONTEXT), generator=generator)


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each token from the ones before it."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@dataclass(frozen=True)
class Workload:
    """What sharded training needs to know of a model: how to build it, its batches and its loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, int], torch.Tensor]  # (batch size, seed) -> one batch
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]


TRANSFORMER = Workload(build_transformer, token_batch, next_token_loss)


def shard(model: nn.Module, reshard_after_forward: bool = True,
          mixed_precision: MixedPrecisionPolicy | None = None) -> nn.Module:
    """FSDP2 over ``model``: each of ``model.blocks`` sharded as one unit, then the root (embeddings, norm, head).

    ``reshard_after_forward`` frees each block's gathered parameters after its forward (backward gathers them
    again); the root keeps its own either way, because backward needs the head first.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise OptlabError(f"sharding needs a model with a non-empty .blocks nn.ModuleList, got {type(model).__name__}")
    policy = mixed_precision or MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return fully_shard(model, reshard_after_forward=False, mp_policy=policy)


BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind ``tensors`` (a DTensor's local shard), each storage counted once."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = _local(tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds after a step, from the tensors themselves: parameters, gradients, optimizer state."""
    parameters = list(model.parameters())
    state = [value for p in parameters for value in optimizer.state.get(p, {}).values() if torch.is_tensor(value)]
    return {"parameters": held_bytes(parameters), "gradients": held_bytes(p.grad for p in parameters),
            "optimizer state": held_bytes(state)}
