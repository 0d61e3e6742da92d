"""Peak memory of one variant's phase, not of the whole process.

The variants of a model live side by side in one process (their repeats interleave), so the allocator's peak alone
would count every other variant's model, optimizer state and resident data set. On CUDA a phase therefore records
the variant's own resident tensors at its start (:func:`resident_mb`: parameters, buffers, gradients, optimizer
state, a data set held on the device) plus the phase's own increase (the allocator's peak during the phase minus
what was allocated when it began). Memory another variant holds is in both the start and the peak, so it cancels.

On the CPU there is no allocator counter to reset, so the phase's increase comes from torch.profiler's memory
records (``profile_memory=True`` records every CPU tensor allocation and free): :func:`cpu_step_increase_mb` runs one
step under the profiler and takes the running sum's maximum. The loops profile one extra, untimed step after the
timed ones (:func:`loops.run_timed`): the profiler's overhead stays off every timed step, and by then the step has
settled (gradients and optimizer state exist, as in the timed steps), which a warm-up step has not. A variant's
steps have the same shapes every repeat, so each variant profiles one step per phase, on its first pass
(``experiments.phase_pass`` keeps the figure). The same
resident tensors are added, so a CPU figure means what a CUDA one does. Where no step could be profiled (no batch
left after the timed ones), there is no number (NaN) rather than the process's lifetime peak.

Running out of memory is recognised in one place (:func:`is_out_of_memory`), and :func:`device_memory_bytes` says how
much memory a device has at most, for sizes that are refused before any work.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


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


def cpu_step_increase_mb(step: Callable[[], object]) -> float:
    """Run ``step`` once under torch.profiler with its memory records, and return the peak MiB of CPU tensor memory
    it held above what was allocated when it began (allocations minus frees, at their highest point)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = itertools.accumulate((e.nbytes() for e in events if e.device_type() == DeviceType.CPU), initial=0)
    return max(running) / 2**20


def phase_peak_mb(device: torch.device, start_bytes: int, resident: float, step_increase_mb: float = math.nan) -> float:
    """``resident`` MiB plus the phase's own increase: on CUDA the allocator's peak since :func:`phase_start`; on the
    CPU ``step_increase_mb`` from :func:`cpu_step_increase_mb` (NaN when no step was profiled: no number)."""
    if device.type == "cuda":
        return resident + max(0, torch.cuda.max_memory_allocated(device) - start_bytes) / 2**20
    return resident + step_increase_mb


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


class GraphPoolTally:
    """The private-pool MiB one variant's CUDA graphs hold: what :func:`graph_pool_mb` grew by over each of the
    variant's own runs (:meth:`run`), summed. The device's pools are shared (Inductor's graphs share one), so their
    total counts other variants' graphs and an earlier run's; the growth while this variant runs is its own, and a
    replay of graphs already recorded adds nothing. ``counted=False`` (no graphs, or not on CUDA): always 0."""

    def __init__(self, device: torch.device, counted: bool = True):
        self.device, self.counted, self.mb = device, counted and device.type == "cuda", 0.0

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """Add what the private pools grew by while the block ran (nothing if it raised)."""
        before = graph_pool_mb(self.device) if self.counted else 0.0
        yield
        if self.counted:
            self.mb += max(0.0, graph_pool_mb(self.device) - before)


def memory_kind(device: torch.device) -> str:
    """What a record's peak memory means on ``device``, in the words the record stores."""
    if device.type == "cuda":
        return "variant's resident CUDA tensors plus its phase's peak increase"
    return "variant's resident CPU tensors plus its phase's peak increase (profiler memory records, one untimed step)"


CPU_OOM_TEXTS = ("out of memory", "can't allocate memory")  # the CUDA caching allocator's and the CPU allocator's
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU's ``torch.OutOfMemoryError``, the CPU allocator's failure (a RuntimeError "can't allocate memory"),
    Python's ``MemoryError``, or one of them inside another error (a compiler's or a graph capture's, as its cause,
    context or ``inner_exception``)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
                isinstance(error, RuntimeError) and any(text in str(error) for text in CPU_OOM_TEXTS)):
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False


def device_memory_bytes(device: torch.device) -> int | None:
    """The most memory ``device`` has: a GPU's total, or the machine's RAM within this process's cgroup limit;
    None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    limits = []
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    for path in CGROUP_LIMITS:
        try:
            limits.append(int(Path(path).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max": no limit there
            continue
    return min(limits) if limits else None
