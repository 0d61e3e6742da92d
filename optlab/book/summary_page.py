"""The book's summary page: every seed technique's speed-ups (the seed's, our live run's, our stored references'),
then the techniques beyond the seed (ours only: the seed did not measure them)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from ..core import store
from ..core.registry import get_experiment
from ..core.profiles import ALL_MODELS
from .report import set_theme
from ..core.seed import seed_speedups
from ..core.techniques import BEYOND_TECHNIQUES, SEED_TECHNIQUES

SEED = "seed V100"
LIVE = "live"
NOT_RUN = "not run"
KEYS = ["technique", "variant", "model", "phase"]
COLUMNS = KEYS + ["source", "speedup", "ci_low", "ci_high", "verdict"]


def seed_rows() -> pd.DataFrame:
    """The seed's speed-up of each non-baseline variant per model, in training (inference for test-only techniques)."""
    frames = []
    for name in SEED_TECHNIQUES:
        experiment = get_experiment(name)
        phase = "train" if "train" in experiment.phases else "test"
        rows = seed_speedups(name)
        rows = rows[(rows["phase"] == phase) & (rows["variant"] != experiment.baseline_label)]
        frames.append(rows.assign(technique=name, source=SEED, verdict=""))
    return pd.concat(frames, ignore_index=True).reindex(columns=COLUMNS)


def _records(folder: Path) -> pd.DataFrame:
    return store.load_summaries(folder) if any(folder.glob("*.json")) else pd.DataFrame(columns=COLUMNS)


def sources() -> dict[str, pd.DataFrame]:
    """Summary rows by source: ``live`` (``results/live``) and each machine under ``results/reference``."""
    found = {LIVE: _records(store.LIVE_DIR)}
    found.update({machine: _records(store.REFERENCE_DIR / machine) for machine in store.reference_machines()})
    return found


def describe(found: dict[str, pd.DataFrame]) -> str:
    """Where each source's numbers come from: how many seed techniques it has, machine and profile."""
    lines = []
    for name, rows in found.items():
        if rows.empty:
            lines.append(f"{name}: no records yet")
            continue
        machines, profiles = (", ".join(sorted(set(rows[column]))) for column in ("machine", "profile"))
        counts = []
        for kind, names in (("seed", SEED_TECHNIQUES), ("beyond-the-seed", BEYOND_TECHNIQUES)):
            missing = sorted(set(names) - set(rows["technique"]))
            counts.append(f"{len(names) - len(missing)} of {len(names)} {kind} techniques"
                          + (f" (missing: {', '.join(missing)})" if missing else ""))
        lines.append(f"{name}: {'; '.join(counts)}; machine {machines}; profile {profiles}")
    return "\n".join(lines)


def speedups(found: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """Tidy speed-ups: the seed's rows, and ours where a source measured the same technique, variant and model."""
    seed = seed_rows()
    frames = [seed]
    for name, summary in (sources() if found is None else found).items():
        ours = summary.merge(seed[KEYS], on=KEYS) if not summary.empty else summary
        frames.append(ours.assign(source=name).reindex(columns=COLUMNS))
    return pd.concat([f for f in frames if not f.empty], ignore_index=True)


def _measured(rows: pd.DataFrame, index: pd.MultiIndex) -> tuple[list[str], pd.Series]:
    """One source's "speed-up (95 % interval)" texts and verdicts on ``index``; "not run" where it has no row."""
    rows = rows.drop_duplicates(KEYS, keep="last").set_index(KEYS).reindex(index)
    texts = [NOT_RUN if pd.isna(ratio) else f"{ratio:.2f} ({low:.2f}-{high:.2f})"
             for ratio, low, high in zip(rows["speedup"], rows["ci_low"], rows["ci_high"])]
    return texts, rows["verdict"].fillna("")


def summary_table(tidy: pd.DataFrame) -> pd.DataFrame:
    """One row per technique, variant and model: the seed's speed-up, then each source's with its verdict."""
    seed = tidy[tidy["source"] == SEED].set_index(KEYS)
    table = seed[["speedup"]].round(2).rename(columns={"speedup": SEED})
    for name in [LIVE] + sorted(set(tidy["source"]) - {SEED, LIVE}):
        table[name], table[f"{name} verdict"] = _measured(tidy[tidy["source"] == name], table.index)
    return table.droplevel("phase")


def plot_speedups(tidy: pd.DataFrame):
    """Per model, each variant's speed-up from every source; the dashed line at 1 is no change."""
    set_theme()
    label = lambda d: d["technique"] + ": " + d["variant"]  # noqa: E731
    data = tidy.dropna(subset=["speedup"]).assign(row=label)
    grid = sns.catplot(data=data, kind="strip", x="speedup", y="row", hue="source", col="model",
                       col_order=[m for m in ALL_MODELS if m in set(data["model"])], col_wrap=2,
                       order=list(dict.fromkeys(label(tidy[tidy["source"] == SEED]))), jitter=False, dodge=True, size=6,
                       height=4.2, aspect=1.25)
    for ax in grid.axes.flat:
        ax.axvline(1.0, color="0.4", lw=1, ls="--")
    grid.set_axis_labels("", "")
    grid.set_titles("{col_name}")
    grid.figure.supxlabel("speed-up: baseline time / technique time", y=-0.01)
    return grid


def beyond_table(found: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """The techniques beyond the seed, one row per technique, variant, model and phase: each source's speed-up over
    the technique's baseline with its 95 % interval and verdict, its peak memory and its achieved TFLOP/s."""
    found = sources() if found is None else found
    keys = ["technique", "variant", "model", "phase"]
    table = None
    for name, rows in found.items():
        if rows.empty:
            continue
        rows = rows[rows["technique"].isin(BEYOND_TECHNIQUES) & (rows["verdict"] != "baseline")]
        if rows.empty:
            continue
        rows = rows.drop_duplicates(keys, keep="last")
        ours = pd.DataFrame({
            **{key: rows[key] for key in keys},
            name: [NOT_RUN if pd.isna(r) else f"{r:.2f} ({lo:.2f}-{hi:.2f})"
                   for r, lo, hi in zip(rows["speedup"], rows["ci_low"], rows["ci_high"])],
            f"{name} verdict": rows["verdict"], f"{name} peak MiB": rows["peak_mem_mb"].round(0),
            f"{name} TFLOP/s": rows["tflops"].round(3),
        })
        table = ours if table is None else table.merge(ours, on=keys, how="outer")
    if table is None:
        return pd.DataFrame(columns=keys)
    measured = [name for name in found if name in table]
    table[measured] = table[measured].fillna(NOT_RUN)
    # registry order: techniques as the chapters come, variants as each technique lists them (others last)
    rank = {(name, label): (i, j) for i, name in enumerate(BEYOND_TECHNIQUES)
            for j, label in enumerate(get_experiment(name).labels)}
    position = [rank.get((t, v), (BEYOND_TECHNIQUES.index(t), len(rank))) for t, v in zip(table["technique"], table["variant"])]
    table = table.assign(_position=position).sort_values(["_position", "model", "phase"], kind="stable")
    return table.drop(columns="_position").set_index(keys)
