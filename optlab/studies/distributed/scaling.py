"""Scaling across processes: throughput and efficiency against one process, stored multi-GPU runs, ring all-reduce."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ...core.results import store

STORED_DIR = store.DISTRIBUTED_DIR


def scaling(samples: pd.DataFrame, phase: str = "train") -> pd.DataFrame:
    """Throughput of each variant against the number of processes, and the efficiency against 1 process.

    efficiency = images/s with N processes / (N x images/s with 1 process): 1.0 is perfect scaling.
    """
    rows = samples[(samples["status"] == "ok") & (samples["phase"] == phase)]
    table = (rows.groupby(["machine", "model", "variant", "world_size"], sort=False)["images_per_s"].median()
             .rename("images/s").reset_index())
    single = table[table["world_size"] == 1].set_index(["machine", "model", "variant"])["images/s"]
    keys = list(zip(table["machine"], table["model"], table["variant"]))
    table["speed-up"] = [ips / single.get(key, np.nan) for ips, key in zip(table["images/s"], keys)]
    table["efficiency"] = table["speed-up"] / table["world_size"]
    return table.round({"images/s": 1, "speed-up": 2, "efficiency": 2})


def stored_samples(folder: str | Path = STORED_DIR) -> pd.DataFrame:
    """The samples of every distributed record stored under ``folder`` (an empty frame if there is none)."""
    if not Path(folder).is_dir():
        return pd.DataFrame()
    frames = [store.load_samples(path) for path in store.record_paths(folder) if "distributed" in store.load_record(path)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def ring_allreduce_s(nbytes: float, world_size: int, bytes_per_s: float) -> float:
    """Seconds a ring all-reduce of ``nbytes`` needs at ``bytes_per_s`` per link: each rank sends (and receives)
    2 (N-1)/N x ``nbytes``. Large messages only: the per-message latency is left out."""
    return 2 * (world_size - 1) / world_size * nbytes / bytes_per_s
