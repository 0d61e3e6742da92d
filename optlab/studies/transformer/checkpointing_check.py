"""Does activation checkpointing train the same model? It must: it only chooses what is kept and what is recomputed.

Every setting of :data:`~optlab.core.knobs.config.CHECKPOINTINGS` starts from the same weights and trains a few AdamW steps
on the same batches. The losses of every step (the later ones depend on the earlier gradients) and the gradients of
the first step are compared with the run without checkpointing, within ``TOLERANCE``.
"""
from __future__ import annotations

import copy

import pandas as pd
import torch
import torch.nn.functional as F

from ...core.knobs.config import CHECKPOINTINGS
from ...core.errors import OptlabError, choice_error
from ...core.gpt.transformer import GPT, GPT_SIZES

TOLERANCE = 1e-5  # largest absolute difference of a loss or a gradient element from the run without checkpointing
MAX_STEPS, MAX_BATCH = 20, 256


def _train(model: GPT, batches: list[torch.Tensor]) -> tuple[list[float], torch.Tensor]:
    """The loss of each step and the first step's gradients, flattened into one vector (zeros for a parameter that
    got none)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    losses, first_grads = [], None
    for batch in batches:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        if first_grads is None:
            first_grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()  # none: zero
                                     for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first_grads


def checkpointing_agreement(size: str = "gpt_tiny", batch: int = 8, steps: int = 2, seed: int = 0,
                            device: "torch.device | str" = "cpu") -> pd.DataFrame:
    """One row per checkpointing setting: the loss of each of ``steps`` training steps from the same weights on the
    same ``batch`` x ``size``'s block of random tokens, the largest difference of those losses and of the first
    step's gradients from the run without checkpointing, and ``agrees`` (both within ``TOLERANCE``, 1e-5)."""
    if size not in GPT_SIZES:
        raise choice_error("GPT size", size, tuple(GPT_SIZES))
    for name, value, limit in (("batch", batch, MAX_BATCH), ("steps", steps, MAX_STEPS)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise OptlabError(f"checkpointing check: {name} must be a whole number from 1 to {limit}, got {value!r}")
    config, device = GPT_SIZES[size], torch.device(device)
    torch.manual_seed(seed)
    weights = copy.deepcopy(GPT(config).state_dict())
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randint(config.vocab_size, (batch, config.block_size + 1), generator=generator).to(device)
               for _ in range(steps)]
    runs = {}
    for setting in CHECKPOINTINGS:
        model = GPT(config, checkpointing=setting).to(device)
        model.load_state_dict(weights)
        runs[setting] = _train(model.train(), batches)
    losses, grads = runs["none"]
    rows = []
    for setting, (their_losses, their_grads) in runs.items():
        loss_diff = max(abs(a - b) for a, b in zip(their_losses, losses))
        grad_diff = (their_grads - grads).abs().max().item()
        rows.append({"checkpointing": setting, **{f"loss, step {i + 1}": loss for i, loss in enumerate(their_losses)},
                     "loss max abs diff": loss_diff, "gradient max abs diff": grad_diff,
                     "agrees": loss_diff <= TOLERANCE and grad_diff <= TOLERANCE})
    return pd.DataFrame(rows)
