"""Peak memory of one variant's phase, not of the whole process.

The variants of a model live side by side in one process (their repeats interleave), so the allocator's peak alone
would count every other variant's model, optimizer state and resident data set. On CUDA a phase therefore records
the variant's own resident tensors at its start (:func:`resident_mb`: parameters, buffers, gradients, optimizer
state, a data set held on the device) plus the phase's own increase (the allocator's peak during the phase minus
what was allocated when it began). Memory another variant holds is in both the start and the peak, so it cancels.

On the CPU there is no allocator counter to reset: the number is the process's peak resident set size over its
whole life (every variant, every phase so far), and :func:`memory_kind` says so.
"""
from __future__ import annotations

import resource
import sys
from typing import Iterable

import torch


def _tensors(owner: object) -> Iterable[torch.Tensor]:
    if isinstance(owner, torch.Tensor):
        yield owner
    elif isinstance(owner, torch.nn.Module):
        for tensor in (*owner.parameters(), *owner.buffers()):
            yield tensor
            if tensor.grad is not None:
                yield tensor.grad
    elif isinstance(owner, torch.optim.Optimizer):
        yield from (value for state in owner.state.values() for value in state.values() if torch.is_tensor(value))
    else:  # a loader that holds its data set as tensors (DeviceResidentLoader): its tensor fields
        yield from (value for value in getattr(owner, "__dict__", {}).values() if torch.is_tensor(value))


def resident_mb(owners: Iterable[object], device: torch.device) -> float:
    """MiB of the distinct tensor storages on ``device`` that ``owners`` hold (modules with their gradients,
    optimizers' state, tensors, objects with tensor fields); a storage shared by several tensors counts once."""
    storages = {}
    for owner in owners:
        for tensor in _tensors(owner):
            if tensor.device.type == device.type:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**20


def phase_start(device: torch.device) -> int:
    """Reset the allocator's peak and return the bytes allocated now (CUDA); 0 on the CPU."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def phase_peak_mb(device: torch.device, start_bytes: int, resident: float) -> float:
    """CUDA: ``resident`` MiB plus the phase's own increase since :func:`phase_start`. CPU: the process's lifetime
    peak RSS."""
    if device.type == "cuda":
        return resident + max(0, torch.cuda.max_memory_allocated(device) - start_bytes) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def graph_pool_mb(device: torch.device) -> float:
    """MiB the allocator holds in private memory pools on ``device``: the pools of captured CUDA graphs (Inductor's
    reduce-overhead graphs share one per device). A replay reads and writes that memory without allocating, so the
    phase's peak never sees it. 0 on the CPU."""
    if device.type != "cuda":
        return 0.0
    index = device.index if device.index is not None else torch.cuda.current_device()
    pooled = sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                 if segment.get("device") == index and tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0))
    return pooled / 2**20


def memory_kind(device: torch.device) -> str:
    """What a record's peak memory means on ``device``, in the words the record stores."""
    if device.type == "cuda":
        return "variant's resident CUDA tensors plus its phase's peak increase"
    return "process's lifetime peak RSS (every variant and phase so far, not per phase)"
