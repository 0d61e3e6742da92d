"""Tables and plots built from tidy samples and summaries, so live runs and stored records look the same."""
from __future__ import annotations

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import pandas as pd
import seaborn as sns

from ..core import store
from ..studies import compile_cost, cuda_graphs
from ..core.seed import SEED_MACHINE, seed_speedups
from ..core.techniques import SET_NAMES, technique_set

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


BREAKDOWN_PARTS = {"data_wait_ms": "data wait", "launch_ms": "CUDA launch and copy calls", "sync_ms": "sync wait",
                   "cpu_other_ms": "other CPU (framework, Python)"}


def plot_breakdown(breakdown: pd.DataFrame, title: str = ""):
    """Per config (rows of ``profiling.breakdown_table``): the step split along the CPU's timeline, stacked, and the
    GPU's busy share of the step; without a GPU, the share of the step spent waiting for data instead."""
    set_theme()
    frame = breakdown.set_index("config").iloc[::-1]  # barh draws bottom-up: the first config on top
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 2.3 + 0.5 * len(frame)), sharey=True,
                                         gridspec_kw={"width_ratios": [2, 1]})
    gpu = frame["device_busy_share"].notna().any()
    names = BREAKDOWN_PARTS if gpu else {**BREAKDOWN_PARTS, "cpu_other_ms": "other CPU (the model's arithmetic too)"}
    frame[list(names)].rename(columns=names).plot.barh(stacked=True, ax=left, width=0.7, legend=False)
    left.set_xlabel("ms per step (mean over the profiled steps)")
    left.set_ylabel("")
    (100 * frame["device_busy_share" if gpu else "data_wait_share"]).plot.barh(ax=right, color="C4" if gpu else "C0",
                                                                             width=0.7)
    right.set_xlim(0, 100)
    right.set_xlabel("GPU busy, % of the step" if gpu else "data wait, % of the step (no GPU)")
    figure.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=len(BREAKDOWN_PARTS), frameon=False)
    if title:
        figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    return figure


def plot_numerics(table: pd.DataFrame, measures: "list[str] | tuple[str, ...]", title: str = ""):
    """Per model, every variant's relative errors against the reference (rows of ``numerics.precision_numerics``),
    on a log scale, where an error of exactly zero has no bar."""
    set_theme()
    long = table.melt(id_vars=["model", "variant"], value_vars=list(measures), var_name="measure", value_name="error")
    grid = sns.catplot(data=long, kind="bar", x="measure", y="error", hue="variant", col="model",
                       col_wrap=min(2, long["model"].nunique()), height=3.2, aspect=1.5)
    grid.set(yscale="log")
    grid.set_titles("{col_name}")
    grid.set_axis_labels("", "relative error (log scale)")
    sns.move_legend(grid, "upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, frameon=False, title=None)
    if title:
        grid.figure.suptitle(title, y=1.03)
    return grid


OPTIMIZER_STEP_MEASURES = {"median_ms": "step ms (median)", "aten_ops_per_step": "aten ops per step (log scale)",
                           "kernels_per_step": "CUDA kernels per step (log scale)"}


def plot_optimizer_steps(table: pd.DataFrame, title: str = ""):
    """Per model (rows of ``optimizer_bench.step_benchmark``): the step's median time and what it launches (counts
    on log scales); the kernel row appears only where a GPU was measured."""
    set_theme()
    measures = {k: v for k, v in OPTIMIZER_STEP_MEASURES.items() if table[k].notna().any()}
    long = table.rename(columns=measures).melt(id_vars=["model", "variant"], value_vars=list(measures.values()),
                                               var_name="measure")
    grid = sns.catplot(data=long, kind="bar", x="variant", y="value", hue="variant", col="model", row="measure",
                       sharey="row", height=2.6, aspect=1.7, legend=False)
    for name, axes in zip(grid.row_names, grid.axes):
        for ax in axes:
            ax.set_yscale("linear" if name == OPTIMIZER_STEP_MEASURES["median_ms"] else "log")
    grid.set_titles("{col_name}: {row_name}")
    grid.set_axis_labels("", "")
    for ax in grid.axes.flat:
        ax.tick_params(axis="x", rotation=45)
    if title:
        grid.figure.suptitle(title, y=1.02)
    return grid


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
        set_name = next((name for name in SET_NAMES if name != "all" and technique in technique_set(name)), "all")
        return (f"no stored GPU reference of {technique} yet: `python -m optlab reference --set {set_name}` on a GPU "
                "machine writes one under results/reference/<machine>/")
    machines = ", ".join(f"{m} ({', '.join(sorted(set(g['profile'])))} profile)" for m, g in reference.groupby("machine"))
    return f"stored GPU reference of {technique}: {machines}"


def plot_step_trace(samples: pd.DataFrame):
    """Seconds of every step of repeat 0 on a log scale, per model and phase: the first step carries the compile."""
    set_theme()
    grid = sns.relplot(data=compile_cost.step_trace(samples), kind="line", x="step", y="seconds", hue="variant", style="variant",
                       markers=True, dashes=False, row="phase", col="model", height=3.0, aspect=1.3,
                       facet_kws={"sharey": False})
    grid.set(yscale="log")
    grid.set_titles("{col_name}, {row_name}")
    return grid


def plot_sweep(frame: pd.DataFrame, title: str = ""):
    """Milliseconds per step and microseconds per image against batch size, log-log, per mode (one machine's sweep)."""
    set_theme()
    long = pd.concat([frame.assign(metric="ms per step", value=1e3 * frame["median_s"]),
                      frame.assign(metric="µs per image", value=frame["per_image_us"])], ignore_index=True)
    executions = [e for e in cuda_graphs.EXECUTIONS if e in set(frame["execution"])]  # no legend entry for what did not run
    grid = sns.relplot(data=long, kind="line", x="batch_size", y="value", hue="execution", style="execution",
                       hue_order=executions, style_order=executions, markers=True, dashes=False, row="metric",
                       col="mode", height=3.0, aspect=1.3, facet_kws={"sharey": False})
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    grid.set(xscale="log", yscale="log", xticks=sorted(set(frame["batch_size"])))
    for ax in grid.axes.flat:
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            set_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))  # plain numbers
    grid.set_titles("{col_name}: {row_name}")
    grid.set_axis_labels("batch size", "")
    if title:
        grid.figure.suptitle(title, y=1.02)
    return grid
