"""The seed article's V100 tables (torch 1.8.1, batch 128, seconds per epoch, first epoch excluded) as data."""
from __future__ import annotations

from importlib import resources

import pandas as pd

SEED_MACHINE = "Tesla V100 (seed article, torch 1.8.1)"


def seed_results() -> pd.DataFrame:
    """Tidy seed rows: section, technique, variant, model, phase, seconds."""
    with resources.files("optlab.resources").joinpath("seed_v100_results.csv").open() as handle:
        wide = pd.read_csv(handle, dtype={"section": str})
    tidy = wide.melt(id_vars=["section", "technique", "variant", "model"], value_vars=["train_s", "test_s"],
                     var_name="phase", value_name="seconds").dropna(subset=["seconds"])
    tidy["phase"] = tidy["phase"].str.removesuffix("_s")
    return tidy.reset_index(drop=True)


def seed_speedups(technique: str) -> pd.DataFrame:
    """The seed's seconds per epoch and its speed-up over its own baseline (the technique's first variant)."""
    seed = seed_results()
    rows = seed[seed["technique"] == technique].copy()
    if rows.empty:
        return rows.assign(speedup=pd.Series(dtype=float))
    baseline = rows["variant"].iloc[0]
    base = rows[rows["variant"] == baseline].set_index(["model", "phase"])["seconds"]
    rows["speedup"] = [base[(m, p)] / s for m, p, s in zip(rows["model"], rows["phase"], rows["seconds"])]
    return rows.reset_index(drop=True)
