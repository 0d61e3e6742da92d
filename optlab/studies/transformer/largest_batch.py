"""The largest batch of sequences each activation-checkpointing setting trains on a GPU without running out of memory.

For each setting one GPT and its AdamW train a step at a batch that doubles from 1 until a step runs out of memory
(``torch.OutOfMemoryError``) or reaches the limit, then the batch is bisected between the last that fitted and the
first that did not. Memory is freed between tries. The answer needs a GPU's caching allocator and its out-of-memory
error: on a CPU the operating system would swap or kill the process first, so there is one line instead.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from ...core.knobs.config import CHECKPOINTINGS
from ...core.errors import OptlabError, choice_error
from ...core.gpt.transformer import GPT, GPT_SIZES
from ...core.measuring.memory import is_out_of_memory

MAX_LIMIT = 65_536  # sequences: far beyond what any GPU holds for the GPTs here


@dataclass(frozen=True)
class BatchSearch:
    """The search's table (None where it cannot run) and one line saying what it measured, or why not."""

    table: "pd.DataFrame | None"
    note: str


def largest_fitting(fits: Callable[[int], bool], limit: int) -> tuple[int, int]:
    """The largest batch from 1 to ``limit`` for which ``fits`` holds, assuming every smaller batch fits too: double
    from 1 until a batch does not fit (or ``limit`` does), then bisect. Returns (batch, tries); batch 0 when even one
    sequence does not fit."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise OptlabError(f"the batch limit must be a whole number from 1 to {MAX_LIMIT}, got {limit!r}")
    good, batch, tries = 0, 1, 0
    while True:
        tries += 1
        if not fits(batch):
            bad = batch
            break
        good = batch
        if batch == limit:
            return good, tries
        batch = min(2 * batch, limit)
    while bad - good > 1:
        middle, tries = (good + bad) // 2, tries + 1
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good, tries


def free_memory(device: torch.device) -> None:
    """Drop unreferenced tensors and hand the allocator's cached blocks back (CUDA), so the next try starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fits_in_memory(step: Callable[[int], object], batch: int, device: torch.device,
                   optimizer: "torch.optim.Optimizer | None" = None) -> bool:
    """Whether ``step(batch)`` runs without running out of memory (``is_out_of_memory``: a GPU's
    ``torch.OutOfMemoryError`` or the CPU allocator's failure; any other error is raised). Before the next try
    everything this one kept is freed, whether it fitted or not: ``optimizer``'s gradients (a step that failed in its
    backward leaves some), and the try's own tensors (its batch and autograd's graph die with the step's frame, which
    a failed step's traceback holds until the error is handled), then the allocator's cache."""
    try:
        step(batch)
        fitted = True
    except Exception as error:  # noqa: BLE001  (out of memory is the answer; anything else is raised)
        if not is_out_of_memory(error):
            raise
        fitted = False
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    free_memory(device)
    return fitted


def training_step(model: GPT, optimizer: torch.optim.Optimizer, device: torch.device) -> Callable[[int], None]:
    """One fp32 training step of ``model`` on ``batch`` random sequences of its full length (AdamW included: its
    state is part of the memory a step needs). The gradients are dropped afterwards, also after a failed step."""
    config = model.config

    def step(batch: int) -> None:
        try:
            idx = torch.randint(config.vocab_size, (batch, config.block_size), device=device)
            loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)

    return step


def largest_batches(device: "torch.device | str", size: str = "gpt2_small", settings: Sequence[str] = CHECKPOINTINGS,
                    limit: int = 1024) -> BatchSearch:
    """For each checkpointing setting, the largest batch of ``size``'s full-length sequences one training step fits on
    a CUDA ``device`` (searched up to ``limit``), with the tries it took and the step's peak memory at that batch. On
    any other device: no table, and one line saying why."""
    if size not in GPT_SIZES:
        raise choice_error("GPT size", size, tuple(GPT_SIZES))
    for setting in settings:
        if setting not in CHECKPOINTINGS:
            raise choice_error("checkpointing", setting, CHECKPOINTINGS)
    largest_fitting(lambda batch: True, limit)  # refuses a bad limit before any model is built
    device = torch.device(device)
    if device.type != "cuda":
        return BatchSearch(None, f"the largest batch per setting needs a GPU's allocator: on {device.type} running out "
                                 "of memory swaps or ends the process instead of raising torch.OutOfMemoryError")
    rows = []
    for setting in settings:
        torch.manual_seed(0)
        model = GPT(GPT_SIZES[size], attention="sdpa", checkpointing=setting).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        step = training_step(model, optimizer, device)
        batch, tries = largest_fitting(lambda n: fits_in_memory(step, n, device), limit)
        peak = float("nan")
        if batch:
            torch.cuda.reset_peak_memory_stats(device)
            if fits_in_memory(step, batch, device):
                peak = torch.cuda.max_memory_allocated(device) / 2**20
        rows.append({"checkpointing": setting, "largest batch": batch,
                     "tokens a step": batch * model.config.block_size, "tries": tries,
                     "stopped at the limit": batch == limit, "peak MiB at that batch": peak})
        del model, optimizer, step
        free_memory(device)
    table = pd.DataFrame(rows)
    return BatchSearch(table, f"{size} on {torch.cuda.get_device_name(device)}: fp32 training steps with AdamW, "
                              f"sequences of {GPT_SIZES[size].block_size} tokens, batches searched up to {limit}")
