"""Pipeline parallelism on the book's GPT with ``torch.distributed.pipelining``: the GPT cut into stages, a schedule
(GPipe, 1F1B, interleaved 1F1B) that runs micro-batches through them, and each rank's timeline of what it computed.

Stage ``k`` of ``n`` holds an equal run of blocks; the first also the embeddings, the last the final norm and the
head. The head's weight is its own (untied from the embedding): a tie across two ranks would need its gradients
summed between them, as Megatron does; here the one-process reference unties it too.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...core.errors import OptlabError
from ...core.gpt.transformer import GPT

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

# Each schedule's class in torch.distributed.pipelining, and its stages per rank. The classes are named, not imported
# here: torch.distributed.pipelining imports torch._dynamo, a second at the start of every process that imports optlab.
SCHEDULES = {"GPipe": ("ScheduleGPipe", 1), "1F1B": ("Schedule1F1B", 1),
             "interleaved 1F1B": ("ScheduleInterleaved1F1B", 2)}


def untied(model: GPT) -> GPT:
    """``model`` with the head's weight a copy of the embedding's instead of the same tensor."""
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    return model


class Stage(nn.Module):
    """A run of the GPT's blocks; the first stage embeds the tokens, the last applies the final norm and the head."""

    def __init__(self, model: GPT, first: int, last: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.embed = nn.ModuleDict({"token": model.token_embedding, "position": model.position_embedding}) \
            if is_first else None
        self.blocks = nn.ModuleList(model.blocks[first:last])
        self.norm, self.head = (model.norm, model.head) if is_last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed["token"](x) + self.embed["position"](torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def stage_modules(model: GPT, rank: int, ranks: int, virtual: int = 1, share: bool = False) -> list[tuple[int, Stage]]:
    """This rank's stages as (stage index, module): with ``virtual`` stages per rank, stages rank, rank + ranks, ...
    (interleaved 1F1B's loop order). Each stage gets n_layer / (ranks x virtual) blocks, copied from ``model`` (with
    ``share``, its own modules: a view of the one-process model, whose gradients line up with the stage's)."""
    stages = ranks * virtual
    if model.config.n_layer % stages:
        raise OptlabError(f"{model.config.n_layer} blocks do not split into {stages} pipeline stages")
    per = model.config.n_layer // stages
    model = model if share else copy.deepcopy(model)
    return [(index, Stage(model, index * per, (index + 1) * per, index == 0, index == stages - 1))
            for index in range(rank, stages, ranks)]


class Timeline:
    """When this rank computed: (start, end, "F" or "B", micro-batch, stage) for every chunk a schedule ran, read
    by wrapping each stage's ``forward_one_chunk`` and ``backward_one_chunk``."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, str, int, int]] = []

    def watch(self, stage: PipelineStage) -> None:
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            method = getattr(stage, name)

            def timed(chunk, *args, _method=method, _kind=kind, **kwargs):
                start = time.perf_counter()
                try:
                    return _method(chunk, *args, **kwargs)
                finally:
                    self.events.append((start, time.perf_counter(), _kind, chunk, stage.stage_index))
            setattr(stage, name, timed)

    def busy_s(self) -> float:
        return sum(end - start for start, end, *_ in self.events)

    def most_held(self, chunk_bytes: dict[int, int] | None = None) -> int:
        """The most that was forwarded and not yet backwarded at once: chunks, or with ``chunk_bytes`` (per stage
        index) the bytes of their saved activations."""
        held = most = 0
        for _, _, kind, _, stage in sorted(self.events):
            size = chunk_bytes[stage] if chunk_bytes else 1
            held += size if kind == "F" else -size
            most = max(most, held)
        return most

    def order(self) -> list[tuple[str, int, int]]:
        """(kind, micro-batch, stage) of each chunk, in the order it ran."""
        return [(kind, chunk, stage) for _, _, kind, chunk, stage in sorted(self.events)]

    def median_s(self) -> dict[str, float]:
        """The median duration of a forward and of a backward chunk."""
        return {kind: statistics.median(end - start for start, end, k, _, _ in self.events if k == kind)
                for kind in ("F", "B")}


def replayed_idle(orders: list[list[tuple[str, int, int]]], durations: list[dict[str, float]]) -> list[float]:
    """Each rank's idle fraction when every rank runs its chunks in the order it recorded (``orders[rank]``: kind,
    micro-batch, stage) and each chunk takes that rank's median duration of its kind, communication free: a forward
    waits for the same micro-batch's forward on the stage before, a backward for its backward on the stage after."""
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(orders)
    position = [0] * len(orders)
    last_stage = max(stage for order in orders for _, _, stage in order)
    while any(position[r] < len(orders[r]) for r in range(len(orders))):
        moved = False
        for rank, order in enumerate(orders):
            if position[rank] == len(order):
                continue
            kind, chunk, stage = order[position[rank]]
            needs = ("F", chunk, stage - 1) if kind == "F" else ("B", chunk, stage + 1)
            if (kind == "F" and stage == 0) or (kind == "B" and stage == last_stage):
                needs = None if kind == "F" else ("F", chunk, stage)
            if needs is not None and needs not in done:
                continue
            start = max(free[rank], done[needs] if needs else 0.0)
            free[rank] = done[(kind, chunk, stage)] = start + durations[rank][kind]
            position[rank] += 1
            moved = True
        if not moved:
            raise OptlabError("the recorded orders wait on each other: a stage boundary is broken")
    span = max(free)
    return [1 - sum(durations[r][kind] for kind, _, _ in order) / span for r, order in enumerate(orders)]


def build_schedule(name: str, model: GPT, rank: int, ranks: int, microbatches: int, loss_fn, device: torch.device,
                   timeline: Timeline):
    """The schedule ``name`` over this rank's stages of ``model``, each stage watched by ``timeline``."""
    if name not in SCHEDULES:
        raise OptlabError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    from torch.distributed import pipelining  # late import: see SCHEDULES

    class_name, virtual = SCHEDULES[name]
    schedule = getattr(pipelining, class_name)
    stages = []
    for index, module in stage_modules(model, rank, ranks, virtual):
        stage = pipelining.PipelineStage(module, index, ranks * virtual, device)
        timeline.watch(stage)
        stages.append(stage)
    if virtual == 1:
        return schedule(stages[0], microbatches, loss_fn=loss_fn), stages
    return schedule(stages, microbatches, loss_fn=loss_fn), stages
