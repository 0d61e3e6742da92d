"""The book's summary page: every seed technique's speed-ups (the seed's, our live run's, our stored references'),
then the techniques beyond the seed and the transformer track (ours only: the seed did not measure them)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from ..core.results import store
from ..core.techniques.gpt import TRANSFORMER_TECHNIQUES
from ..core.techniques.registry import get_experiment
from ..core.results.seed import seed_speedups
from ..core.stats.summary import CLAIM
from ..core.techniques.cnn import BEYOND_TECHNIQUES, SEED_TECHNIQUES
from . import report
from .report import LIVE, SEED, significant, speedup_text, verdict_text

NOT_RUN = "not run"
KEYS = ["technique", "variant", "model", "phase"]
COLUMNS = KEYS + ["source", "speedup", "ci_low", "ci_high", "verdict", "role"]


def seed_rows() -> pd.DataFrame:
    """The seed's speed-up of each non-baseline variant per model, in training (inference for test-only techniques)."""
    frames = []
    for name in SEED_TECHNIQUES:
        experiment = get_experiment(name)
        phase = "train" if "train" in experiment.phases else "test"
        rows = seed_speedups(name)
        rows = rows[(rows["phase"] == phase) & (rows["variant"] != experiment.baseline_label)]
        frames.append(rows.assign(technique=name, source=SEED, verdict="", role=CLAIM))
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
        for kind, names in (("seed", SEED_TECHNIQUES), ("beyond-the-seed", BEYOND_TECHNIQUES),
                            ("transformer", TRANSFORMER_TECHNIQUES)):
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
        if not summary.empty:
            frames.append(summary.merge(seed[KEYS], on=KEYS).assign(source=name).reindex(columns=COLUMNS))
    tidy = pd.concat([frame for frame in frames if not frame.empty], ignore_index=True)
    return tidy.assign(role=tidy["role"].fillna(CLAIM))


def _measured(rows: pd.DataFrame, index: pd.MultiIndex) -> tuple[list[str], list[str]]:
    """One source's "speed-up (interval)" texts and verdicts on ``index``; "not run" where it has no row."""
    rows = rows.drop_duplicates(KEYS, keep="last").set_index(KEYS).reindex(index)
    texts = [NOT_RUN if pd.isna(r) else speedup_text(r, low, high)
             for r, low, high in zip(rows["speedup"], rows["ci_low"], rows["ci_high"])]
    return texts, [verdict_text(v, r) if not pd.isna(v) else "" for v, r in zip(rows["verdict"], rows["role"])]


def compared_with(index: pd.MultiIndex) -> list[str]:
    """The variant each row's speed-up is measured against, from the registry (levels ``technique``, ``variant``)."""
    pairs = zip(index.get_level_values("technique"), index.get_level_values("variant"))
    return [get_experiment(technique).reference_of(variant) for technique, variant in pairs]


def summary_table(tidy: pd.DataFrame) -> pd.DataFrame:
    """One row per technique, variant and model: the seed's speed-up, what others published on a modern GPU for the
    technique (:func:`report.summary_cell`), then each source's with its interval and verdict (a source without
    records has no columns)."""
    seed = tidy[tidy["source"] == SEED].set_index(KEYS)
    table = seed[["speedup"]].map(report.ratio).rename(columns={"speedup": SEED})
    table.insert(0, report.COMPARED_WITH, compared_with(table.index))
    table.insert(2, report.SUMMARY_COLUMN, report.summary_column(table.index.get_level_values("technique")))
    for name in [LIVE] + sorted(set(tidy["source"]) - {SEED, LIVE}):
        table[f"{name} ({report.INTERVAL})"], table[f"{name} verdict"] = _measured(tidy[tidy["source"] == name],
                                                                                table.index)
    return table.droplevel("phase")


def plot_speedups(tidy: pd.DataFrame) -> Figure:
    """The summary's figure: a panel per model, a row per technique and variant, every source's speed-up."""
    return report.plot_speedups(tidy, rows=("technique", "variant"), col="model", col_wrap=2)


def beyond_table(found: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """The techniques beyond the seed, one row per technique, variant, model and phase: each source's speed-up over
    the technique's baseline with its interval and verdict, its peak memory and its achieved TFLOP/s."""
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
        roles = rows["role"] if "role" in rows else pd.Series(CLAIM, index=rows.index)
        ours = pd.DataFrame({
            **{key: rows[key] for key in keys},
            f"{name} ({report.INTERVAL})": [NOT_RUN if pd.isna(r) else speedup_text(r, lo, hi)
                                            for r, lo, hi in zip(rows["speedup"], rows["ci_low"], rows["ci_high"])],
            f"{name} verdict": [verdict_text(v, r) for v, r in zip(rows["verdict"], roles)],
            f"{name} peak MiB": rows["peak_mem_mb"].map(significant),
            f"{name} TFLOP/s": rows["tflops"].map(significant),
        })
        table = ours if table is None else table.merge(ours, on=keys, how="outer")
    if table is None:
        return pd.DataFrame(columns=keys)
    table.insert(len(keys), report.COMPARED_WITH, compared_with(table.set_index(keys).index))
    table.insert(len(keys) + 1, report.SUMMARY_COLUMN, report.summary_column(table["technique"]))
    measured = [column for column in table if column.endswith(f" ({report.INTERVAL})")]
    table[measured] = table[measured].fillna(NOT_RUN)
    # registry order: techniques as the chapters come, variants as each technique lists them (others last)
    rank = {(name, label): (i, j) for i, name in enumerate(BEYOND_TECHNIQUES)
            for j, label in enumerate(get_experiment(name).labels)}
    position = [rank.get((t, v), (BEYOND_TECHNIQUES.index(t), len(rank))) for t, v in zip(table["technique"], table["variant"])]
    table = report.in_order(table.assign(_position=position)).sort_values("_position", kind="stable")
    return table.drop(columns="_position").set_index(keys)


def transformer_table(found: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """The transformer track's techniques, one row per technique, variant, model and phase, baselines included: each
    source's speed-up over the variant it is compared with (as its run recorded it) with its interval and verdict,
    then its throughput in the workload's unit (tokens/s) and its peak memory."""
    found = sources() if found is None else found
    keys = ["technique", "variant", "model", "phase"]
    table = None
    for name, rows in found.items():
        if rows.empty or "technique" not in rows:
            continue
        rows = rows[rows["technique"].isin(TRANSFORMER_TECHNIQUES)].drop_duplicates(keys, keep="last")
        if rows.empty:
            continue
        roles = rows["role"] if "role" in rows else pd.Series(CLAIM, index=rows.index)
        units = rows["unit"].dropna() if "unit" in rows else pd.Series(dtype=object)
        rates = rows["items_per_s"] if "items_per_s" in rows else pd.Series(float("nan"), index=rows.index)
        ours = pd.DataFrame({
            **{key: rows[key] for key in keys},
            f"{name} {report.COMPARED_WITH}": rows["reference"] if "reference" in rows else None,
            f"{name} ({report.INTERVAL})": [NOT_RUN if pd.isna(r) else speedup_text(r, lo, hi)
                                            for r, lo, hi in zip(rows["speedup"], rows["ci_low"], rows["ci_high"])],
            f"{name} verdict": [verdict_text(v, r) for v, r in zip(rows["verdict"], roles)],
            f"{name} {units.iloc[0] if not units.empty else 'items'}/s": rates.map(significant),
            f"{name} peak MiB": rows["peak_mem_mb"].map(significant),
        })
        table = ours if table is None else table.merge(ours, on=keys, how="outer")
    if table is None:
        return pd.DataFrame(columns=keys)
    measured = [column for column in table if column.endswith(f" ({report.INTERVAL})")]
    table[measured] = table[measured].fillna(NOT_RUN)
    rank = {name: i for i, name in enumerate(TRANSFORMER_TECHNIQUES)}
    table = table.assign(_rank=table["technique"].map(rank)).sort_values("_rank", kind="stable")
    return table.drop(columns="_rank").set_index(keys)
