"""Pipeline schedules on 4 CPU ranks against one process: parity, each rank's timeline, its idle fraction against
the bubble formula, and the activations each rank holds by schedule.

A 4-process job on a laptop shares its few cores, so a chunk's wall time depends on how many ranks compute beside it.
The idle fraction is therefore read twice from each rank's timeline: on the wall clock (what happened here), and
replayed (:func:`.pipeline.replayed_idle`): the order each rank ran its chunks in, every forward chunk at the median
forward and every backward at the median backward of all ranks (balanced stages, free communication). The replay is
what the formula describes, and is held to it.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...core.errors import OptlabError
from ...core.gpt.transformer import GPT, GPTConfig
from ...core.knobs.limits import check_count
from . import formulas
from .held import saved_activation_bytes
from .pipeline import SCHEDULES, Timeline, build_schedule, replayed_idle, stage_modules, untied
from .ranks import joined, run_ranks, write_findings

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=2, n_embd=64)
STAGES, BATCH = 4, 8  # ranks, sequences per step (split into the micro-batches)
BUBBLE_TOLERANCE = 0.05  # |replayed idle fraction - formula| for GPipe and 1F1B, on every rank
MAX_REPEATS = 20


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=generator)


def _chunk_bytes(rank: int, ranks: int, virtual: int, model: GPT, microbatch: int) -> dict[int, int]:
    """Bytes one micro-batch's forward saves on each of this rank's stages, the activation a stage received from
    the stage before included (it stays until the backward); the token ids and targets, data the step was given,
    left out. The targets are a slice of the token batch, as the step passes them."""
    sizes = {}
    for index, module in stage_modules(model, rank, ranks, virtual):
        targets = torch.zeros(microbatch, CONFIG.block_size + 1, dtype=torch.long)[:, 1:]
        if module.embed is not None:
            inputs = torch.zeros(microbatch, CONFIG.block_size, dtype=torch.long)
            given = (inputs, targets)
        else:
            inputs = torch.randn(microbatch, CONFIG.block_size, CONFIG.n_embd, requires_grad=True)
            given = (targets,)
        run = (lambda m=module, x=inputs: loss_fn(m(x), targets)) if module.head is not None \
            else (lambda m=module, x=inputs: m(x))
        sizes[index] = saved_activation_bytes(module, run, given)
    return sizes


def _step(schedule, rank: int, ranks: int, batch: torch.Tensor) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(batch[:, :-1])
    elif rank == ranks - 1:
        schedule.step(target=batch[:, 1:], losses=losses)
    else:
        schedule.step()
    return losses


def pipeline_rank(out: Path, microbatches: list[int], repeats: int) -> None:
    """One rank of the study (run under torchrun); rank 0 writes the findings."""
    with joined() as (rank, ranks):
        torch.manual_seed(0)
        model, batch = untied(GPT(CONFIG)), _batch()
        reference = copy.deepcopy(model)
        reference_loss = float(loss_fn(reference(batch[:, :-1]), batch[:, 1:]))
        reference.zero_grad()
        loss_fn(reference(batch[:, :-1]), batch[:, 1:]).backward()
        rows = []
        for name, (_, virtual) in SCHEDULES.items():
            reference_stages = [module for _, module in stage_modules(reference, rank, ranks, virtual, share=True)]
            for m in microbatches:
                timeline = Timeline()
                schedule, stages = build_schedule(name, model, rank, ranks, m, loss_fn, torch.device("cpu"), timeline)
                for repeat in range(repeats + 1):  # the first step is the parity step; the last one's timeline is kept
                    for stage in stages:
                        stage.submod.zero_grad()
                    timeline.events.clear()
                    dist.barrier()
                    start = time.perf_counter()
                    losses = _step(schedule, rank, ranks, batch)
                    wall = time.perf_counter() - start
                    if repeat == 0:
                        gradient = max(float((p.grad - q.grad).abs().max())
                                       for stage, ref in zip(stages, reference_stages)
                                       for p, q in zip(stage.submod.parameters(), ref.parameters()))
                        loss = abs(float(torch.stack(losses).mean()) - reference_loss) if losses else None
                sizes = _chunk_bytes(rank, ranks, virtual, model, BATCH // m)
                rows.append({"schedule": name, "microbatches": m, "rank": rank,
                             "wall idle": 1 - timeline.busy_s() / wall,
                             "order": timeline.order(), "durations": timeline.median_s(),
                             "in flight": timeline.most_held(), "held bytes": timeline.most_held(sizes),
                             "chunk bytes": sizes, "gradient": gradient, "loss": loss})
        everything = [None] * ranks
        dist.all_gather_object(everything, rows)
        if rank == 0:
            write_findings(out, {"ranks": ranks, "rows": [row for rank_rows in everything for row in rank_rows]})


@dataclass(frozen=True)
class PipelineStudy:
    """Every rank's rows: per schedule and micro-batch count, its timeline's order and durations, idle fractions,
    what it held, and its parity with one process."""

    ranks: int
    rows: list[dict]

    def idle_table(self) -> pd.DataFrame:
        """Per schedule, micro-batch count and rank: idle on the wall clock, replayed, and the formula."""
        table = pd.DataFrame(self.rows)
        replayed = []
        for (name, m), group in table.groupby(["schedule", "microbatches"], sort=False):
            group = group.sort_values("rank")
            balanced = {kind: float(pd.Series([d[kind] for d in group["durations"]]).median()) for kind in ("F", "B")}
            idle = replayed_idle([[tuple(e) for e in order] for order in group["order"]], [balanced] * len(group))
            virtual = SCHEDULES[name][1]
            for rank, value in zip(group["rank"], idle):
                replayed.append({"schedule": name, "microbatches": m, "rank": rank, "replayed idle": value,
                                 "formula": formulas.bubble_fraction(self.ranks, m, virtual)})
        merged = table[["schedule", "microbatches", "rank", "wall idle"]].merge(pd.DataFrame(replayed))
        return merged.set_index(["schedule", "microbatches", "rank"]).round(3)

    def idle_by_rank(self) -> pd.DataFrame:
        """:meth:`idle_table` with a column per rank, as a page shows it: per schedule and micro-batch count, the
        formula once (it is every rank's), each rank's replayed idle, and each rank's wall idle in the collapsed "all
        columns" block."""
        idle = self.idle_table()
        per_rank = idle[["replayed idle", "wall idle"]].unstack("rank")
        per_rank.columns = [f"{kind} {rank}" for kind, rank in per_rank.columns]
        formula = idle["formula"].groupby(level=["schedule", "microbatches"], sort=False).first()
        table = pd.concat([formula, per_rank.loc[formula.index]], axis=1)
        table.attrs.update(keys=["schedule", "microbatches"],
                           details=[column for column in table if column.startswith("wall idle")])
        return table

    def held_table(self, value: str = "in flight") -> pd.DataFrame:
        """Per rank (rows) and schedule (columns), at the most micro-batches: the most micro-batch chunks forwarded
        and not yet backwarded (``in flight``), or the KiB of activations they held (``held bytes``)."""
        table = pd.DataFrame(self.rows)
        table = table[table["microbatches"] == table["microbatches"].max()]
        held = table.pivot(index="rank", columns="schedule", values=value)[list(SCHEDULES)]
        return held if value == "in flight" else (held / 2**10).round(1)

    def stage_bytes(self, schedule: str = "1F1B", microbatches: int | None = None) -> dict[int, int]:
        """Bytes one micro-batch's forward saved on each stage (by stage index) under ``schedule``, with
        ``microbatches`` micro-batches a step (the most by default)."""
        table = pd.DataFrame(self.rows)
        microbatches = table["microbatches"].max() if microbatches is None else microbatches
        table = table[(table["schedule"] == schedule) & (table["microbatches"] == microbatches)]
        return {int(index): size for sizes in table["chunk bytes"] for index, size in sizes.items()}

    def parity_table(self) -> pd.DataFrame:
        """The largest difference from one process: every rank's gradients, and the last rank's mean loss."""
        table = pd.DataFrame(self.rows)
        return table.groupby(["schedule", "microbatches"], sort=False).agg(
            gradient=("gradient", "max"), loss=("loss", "max"))


def pipeline_study(microbatches: tuple[int, ...] = (4, 8), repeats: int = 0, timeout: float = 300.0) -> PipelineStudy:
    """Launch the study on 4 CPU processes and return every rank's rows (``repeats`` more steps per schedule after
    the first, whose timeline replaces the first's)."""
    try:
        for m in microbatches:
            check_count("microbatches", m, STAGES, BATCH, f"from the {STAGES} stages to the batch's {BATCH} sequences")
            if BATCH % m:
                raise OptlabError(f"microbatches must divide the batch of {BATCH} sequences, got {m}")
        check_count("repeats", repeats, 0, MAX_REPEATS, "steps per schedule after the first")
    except OptlabError as error:
        raise OptlabError(f"pipeline study: {error}") from None
    findings = run_ranks("pipeline-rank", STAGES, ["--microbatches", ",".join(map(str, microbatches)),
                                                  "--repeats", str(repeats)], timeout)
    return PipelineStudy(**findings)
