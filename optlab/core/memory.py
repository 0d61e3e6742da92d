"""Peak memory of a phase: the CUDA allocator's peak on a GPU, the process's peak RSS on the CPU."""
from __future__ import annotations

import resource
import sys

import torch


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device: torch.device) -> float:
    """Peak MiB since :func:`reset_peak` on CUDA; on the CPU the process's lifetime peak RSS (it cannot be reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def memory_kind(device: torch.device) -> str:
    return "cuda peak allocated" if device.type == "cuda" else "process peak RSS"
