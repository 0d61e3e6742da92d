"""How each rank's share shrinks with the number of ranks, for world sizes this machine cannot start.

One process joins a *fake* process group of N ranks (``torch.testing._internal.distributed.fake_pg``: its
collectives return at once and move no data), shards the model as rank 0 of N, takes one step and measures the
tensors it holds. The shapes and bytes are FSDP2's own; the values are not (no gradient was averaged), which is
all a memory figure needs.
"""
from __future__ import annotations

from typing import Sequence

import pandas as pd
import torch
import torch.distributed as dist

from ...core.knobs.limits import check_count
from .sharding import TRANSFORMER, Workload, shard, state_bytes

MAX_FAKE_WORLD = 1024
WORLD_SIZES = (1, 2, 4, 8)


def fake_rank_bytes(world_sizes: Sequence[int], batch_size: int = 2, workload: Workload = TRANSFORMER) -> list[dict]:
    """Bytes rank 0 of each world size holds after one FSDP2 step, measured in this process under a fake group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    rows = []
    for world_size in world_sizes:
        check_count("world size", world_size, 1, MAX_FAKE_WORLD, "ranks a fake group simulates")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            torch.manual_seed(0)
            model = shard(workload.build())
            optimizer = torch.optim.AdamW(model.parameters())
            workload.loss(model, workload.batch(batch_size, 0)).backward()
            optimizer.step()
            rows.append({"ranks": world_size, **state_bytes(model, optimizer)})
        finally:
            dist.destroy_process_group()
    return rows


def scaling_table(rows: Sequence[dict]) -> pd.DataFrame:
    """Per-rank MiB of parameters, gradients and optimizer state at each world size, the total as a fraction of one
    rank's, and that fraction times N (1.0 is perfect sharding)."""
    table = pd.DataFrame(list(rows)).set_index("ranks")
    parts = ["parameters", "gradients", "optimizer state"]
    table["total"] = table[parts].sum(axis=1)
    table["of 1 rank"] = table["total"] / table.loc[1, "total"]
    table["x N"] = table["of 1 rank"] * table.index
    table[[*parts, "total"]] = table[[*parts, "total"]] / 2**20
    return table.rename(columns={part: f"{part} MiB" for part in [*parts, "total"]}).round(4)
