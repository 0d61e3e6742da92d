"""Tables and plots built from tidy samples and summaries, so live runs and stored records look the same."""
from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from . import store
from .seed import SEED_MACHINE, seed_speedups

TABLE_COLUMNS = {
    "model": "model", "phase": "phase", "variant": "variant", "n": "n", "epoch_s": "epoch s (median)",
    "epoch_iqr_s": "IQR s", "speedup": "speed-up", "ci": "95% CI", "verdict": "verdict", "peak_mem_mb": "peak MiB",
    "images_per_s": "img/s", "tflops": "TFLOP/s",
}


def set_theme() -> None:
    """The book's one seaborn theme."""
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")


def comparison_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as a readable table: median, spread, speed-up with its interval, verdict, memory."""
    table = summary.copy()
    table["ci"] = [
        "" if pd.isna(low) else f"{low:.2f}-{high:.2f}" for low, high in zip(table["ci_low"], table["ci_high"])
    ]
    table = table[list(TABLE_COLUMNS)].rename(columns=TABLE_COLUMNS)
    return table.round({"epoch s (median)": 2, "IQR s": 2, "speed-up": 2, "peak MiB": 0, "img/s": 0, "TFLOP/s": 3})


def plot_comparison(samples: pd.DataFrame, title: str = "", y: str = "epoch_equiv_s"):
    """Per model, bars of every variant's epoch-equivalent time (median, error bar: interquartile range)."""
    set_theme()
    ok = samples[samples["status"] == "ok"]
    grid = sns.catplot(
        data=ok, kind="bar", x="model", y=y, hue="variant", col="phase", sharey=False,
        estimator="median", errorbar=("pi", 50), height=3.4, aspect=1.3, legend_out=False,
    )
    grid.set_axis_labels("", "seconds per epoch-equivalent" if y == "epoch_equiv_s" else y)
    grid.set_titles("{col_name}")
    sns.move_legend(grid.axes.flat[0], "upper left", bbox_to_anchor=(0, -0.15), ncol=1, frameon=False, title=None)
    if title:
        grid.figure.suptitle(title, y=1.03)
    return grid


def plot_waterfall(summary: pd.DataFrame, labels: list[str], phase: str = "train"):
    """Per model, a waterfall of a cumulative stack: each bar spans the change that one more technique makes to the
    median epoch-equivalent time (green: faster, red: slower); the first bar is the baseline itself."""
    set_theme()
    rows = summary[(summary["phase"] == phase) & summary["variant"].isin(labels)]
    models = list(dict.fromkeys(rows["model"]))
    figure, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False, sharey=False)
    for ax, model in zip(axes[0], models):
        times = rows[rows["model"] == model].set_index("variant")["epoch_s"].reindex(labels)
        previous = 0.0
        for x, (label, seconds) in enumerate(times.items()):
            if pd.isna(seconds):  # a variant that failed (out of memory) has no bar
                continue
            colour = "0.55" if x == 0 else ("tab:green" if seconds <= previous else "tab:red")
            ax.bar(x, seconds - previous, bottom=previous, color=colour, width=0.7)
            ax.text(x, seconds, f"{seconds:.3g}", ha="center", va="bottom", fontsize=8)
            previous = seconds
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{model} ({phase})")
        ax.set_ylabel("seconds per epoch-equivalent (median)")
    figure.tight_layout()
    return figure


def plot_learning(curves: pd.DataFrame):
    """Training loss and test accuracy against optimizer steps, one line per variant."""
    set_theme()
    long = curves.melt(id_vars=["variant", "step"], value_vars=["train_loss", "test_accuracy"], var_name="measure")
    grid = sns.relplot(data=long, kind="line", x="step", y="value", hue="variant", col="measure", marker="o",
                       height=3.4, aspect=1.3, facet_kws={"sharey": False})
    grid.set_titles("{col_name}")
    grid.set_axis_labels("optimizer steps", "")
    return grid


BREAKDOWN_PARTS = {"data_wait_ms": "data wait", "launch_ms": "CUDA launch calls", "sync_ms": "sync wait",
                   "cpu_other_ms": "other CPU (framework, Python)"}


def plot_breakdown(breakdown: pd.DataFrame, title: str = ""):
    """Per config (rows of ``profiling.breakdown_table``): the step split along the CPU's timeline, stacked, and the
    GPU's busy share of the step; without a GPU, the share of the step spent waiting for data instead."""
    set_theme()
    frame = breakdown.set_index("config")
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 1.4 + 0.55 * len(frame)), sharey=True,
                                         gridspec_kw={"width_ratios": [2, 1]})
    frame[list(BREAKDOWN_PARTS)].rename(columns=BREAKDOWN_PARTS).plot.barh(stacked=True, ax=left, width=0.7)
    left.set_xlabel("ms per step (mean over the profiled steps)")
    left.set_ylabel("")
    left.invert_yaxis()
    left.legend(loc="upper left", bbox_to_anchor=(0, -0.25), ncol=2, frameon=False)
    gpu = frame["device_busy_share"].notna().any()
    (100 * frame["device_busy_share" if gpu else "data_wait_share"]).plot.barh(ax=right, color="C4" if gpu else "C0",
                                                                             width=0.7)
    right.set_xlim(0, 100)
    right.set_xlabel("GPU busy, % of the step" if gpu else "waiting for data, % of the step (no GPU)")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def seed_comparison(technique: str, live: pd.DataFrame | None = None, reference: pd.DataFrame | None = None) -> pd.DataFrame:
    """The seed's V100 speed-ups beside ours: the live run and any stored reference summaries.

    ``live`` and ``reference`` are summary tables (``reference`` with a ``machine`` column).
    """
    seed = seed_speedups(technique)
    table = seed.rename(columns={"seconds": "V100 s", "speedup": "V100 speed-up"})[
        ["model", "phase", "variant", "V100 s", "V100 speed-up"]
    ]
    sources = [("live", live)] + [
        (machine, frame) for machine, frame in (reference.groupby("machine") if reference is not None else [])
    ]
    keys = ["model", "phase", "variant"]
    for name, frame in sources:
        if frame is None or frame.empty:
            continue
        ours = frame[keys + ["epoch_s", "speedup", "verdict"]].rename(
            columns={"epoch_s": f"{name} s", "speedup": f"{name} speed-up", "verdict": f"{name} verdict"}
        )
        table = table.merge(ours, on=keys, how="outer")
    table.attrs["seed_machine"] = SEED_MACHINE
    return table.round(2)


def reference_comparison(technique: str, live: pd.DataFrame | None = None) -> pd.DataFrame:
    """A technique beyond the seed: the live speed-ups beside every stored reference machine's, one row per variant."""
    keys = ["model", "phase", "variant"]
    sources = [("live", live)]
    reference = reference_summary(technique)
    if reference is not None:
        sources += list(reference.groupby("machine"))
    table = None
    for name, frame in sources:
        if frame is None or frame.empty:
            continue
        ours = frame[keys + ["epoch_s", "speedup", "verdict", "peak_mem_mb"]].rename(columns={
            "epoch_s": f"{name} s", "speedup": f"{name} speed-up", "verdict": f"{name} verdict",
            "peak_mem_mb": f"{name} peak MiB"})
        table = ours if table is None else table.merge(ours, on=keys, how="outer")
    if table is None:
        return pd.DataFrame(columns=keys)
    table.attrs["reference_machines"] = [name for name, _ in sources[1:]]
    return table.round(2)


def reference_summary(technique: str) -> pd.DataFrame | None:
    """Stored reference summaries of ``technique`` from every machine under ``results/reference``, or None."""
    paths = [p for machine in store.reference_machines() for p in (store.REFERENCE_DIR / machine).glob(f"{technique}.json")]
    if not paths:
        return None
    return pd.concat([store.load_summaries(p) for p in paths], ignore_index=True)



def reference_note(technique: str) -> str:
    """One line: which machines have a stored reference of ``technique``, or how to make one."""
    reference = reference_summary(technique)
    if reference is None:
        return (f"no stored GPU reference of {technique} yet: `python -m optlab reference --set beyond` on a GPU "
                "machine writes one under results/reference/<machine>/")
    machines = ", ".join(f"{m} ({', '.join(sorted(set(g['profile'])))} profile)" for m, g in reference.groupby("machine"))
    return f"stored GPU reference of {technique}: {machines}"
