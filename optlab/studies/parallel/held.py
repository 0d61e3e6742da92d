"""What one rank holds: the bytes of its parameters and of the activations autograd saves for the backward, a
DTensor counted by its local shard."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (its shards), each storage once (a tied weight counts once)."""
    storages = {}
    for parameter in model.parameters():
        storage = local(parameter).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def saved_activation_bytes(model: nn.Module, forward: Callable[[], torch.Tensor],
                           inputs: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes autograd saves for the backward while ``forward()`` runs on this rank: the storages behind the saved
    tensors (a view keeps its whole storage, counted once), parameters and ``inputs`` left out. The graph is dropped
    without a backward."""
    known = {local(t).untyped_storage().data_ptr() for t in (*model.parameters(), *inputs)}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in known:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    del output
    return sum(saved.values())
