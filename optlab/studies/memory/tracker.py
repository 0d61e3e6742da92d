"""An independent count of a training step's peak: torch's ``MemTracker`` beside the breakdown.

The breakdown's categories and its measured peak both come from the profiler's allocation records, so their
agreement is a consistency check. torch's ``MemTracker`` (in ``torch.distributed``'s memory tools) counts another
way: a dispatch mode sees every tensor an operator creates and follows its storage (with weak references) until it
dies, sorting it as parameter, buffer, gradient, activation, temporary, optimizer state or other. ``tracked_peak``
runs one more step of the same model under it; ``tracker_table`` sets its peak beside the breakdown's
(``Breakdown.tracked`` holds it), with the tolerance (``TRACKER_RTOL``) they must agree within.
"""
from __future__ import annotations

from typing import Any

import pandas as pd
import torch
from torch import nn

from ...core.measuring import loops
from .breakdown import Breakdown, LossFn, micro_batches, quiet_hooks, train_step

TRACKER_RTOL = 0.02  # the two peaks, relative: both see every tensor the step holds; a GPU's blocks are rounded alike
MiB = 2**20


def tracked_peak(model: nn.Module, inputs: tuple[Any, torch.Tensor], loss_fn: LossFn,
                 optimizer: torch.optim.Optimizer, *, device: "str | torch.device", set_to_none: bool = True,
                 autocast_dtype: torch.dtype | None = None, accumulation: int = 1) -> dict[str, int]:
    """Bytes on ``device`` at the peak of one training step under ``MemTracker`` (the step ``step_breakdown``
    runs, with the same options), by the tracker's kinds (``param``, ``grad``, ``act``, ``temp``, ``opt``, ...) and
    ``total``. The model, its optimizer's state and the batch are tracked from before the step."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    batch = (loops.inputs_to(inputs[0], device), inputs[1].to(device))
    chunks = micro_batches(batch, accumulation)
    # torch's memory tools (MemTracker), imported here: they pull in torch._inductor and torch._dynamo, about a second
    # that every process importing optlab would otherwise pay at its start
    from torch.distributed import _tools

    tracker = _tools.MemTracker()
    tracker.track_external(model, optimizer, *loops.input_tensors(batch[0]), batch[1])
    with tracker, quiet_hooks():
        train_step(model, chunks, loss_fn, optimizer, device, autocast_dtype, set_to_none,
                   between=tracker.reset_mod_stats)  # its per-module record takes one forward at a time
    peak = tracker.get_tracker_snapshot("peak").get(device, {})
    return {getattr(kind, "name", str(kind)).lower(): int(size) for kind, size in peak.items()}


def tracker_table(breakdowns: dict[str, Breakdown]) -> pd.DataFrame:
    """One row per setting whose breakdown has MemTracker's count (``Breakdown.tracked``): the breakdown's measured
    peak and MemTracker's (MiB), their relative difference, the tolerance, and whether they agree within it."""
    rows = []
    for label, breakdown in breakdowns.items():
        if not breakdown.tracked:
            continue
        theirs = breakdown.tracked["total"]
        difference = theirs / breakdown.peak_bytes - 1
        rows.append({"setting": label, "peak MiB (profiler)": breakdown.peak_bytes / MiB,
                     "peak MiB (MemTracker)": theirs / MiB, "difference": difference, "tolerance": TRACKER_RTOL,
                     "agrees": abs(difference) <= TRACKER_RTOL})
    return pd.DataFrame(rows, columns=["setting", "peak MiB (profiler)", "peak MiB (MemTracker)", "difference",
                                       "tolerance", "agrees"]).set_index("setting")
