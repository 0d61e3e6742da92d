"""Every figure a page draws: the headline speed-up figure (log axis, intervals, coloured by verdict, beside the seed's
V100 speed-up), the stack's waterfall, learning curves, profiles, numerics, optimizer steps, sweeps and memory.
"""
from __future__ import annotations

import math
import textwrap

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ...core.techniques.no_effect import NO_EFFECT, is_no_effect
from ...core.stats.summary import CLAIM, CONTROL, NOT_WAITED
from ...core.measuring.timing import FASTER, INTERVAL, SAME, SLOWER, UNCLEAR
from ...studies.kernels import compile_cost, cuda_graphs
from .tables import set_theme
from .comparisons import LIVE, SEED

# seaborn's colour-blind blue, vermillion and green; "can't tell yet" is grey and hollow
VERDICT_COLOURS = {FASTER: "#0173b2", SLOWER: "#d55e00", SAME: "#029e73"}


UNCLEAR_COLOUR = "#949494"


SOURCE_MARKERS = ("o", "s", "^", "v", "P", "X")  # the live run, then each stored reference machine


LABEL_WIDTH = 34  # characters per line of a row label of the speed-up figure


def plot_speedups(tidy: pd.DataFrame, rows: "tuple[str, ...]" = ("model", "variant"), col: str = "phase",
                  col_wrap: int | None = None) -> Figure:
    """The headline figure: one row per ``rows`` and one panel per ``col``; each source's speed-up with its interval
    on a log axis, coloured by verdict (hollow grey: can't tell yet), the seed's V100 speed-up as a black diamond,
    and a dashed line at 1. A variant compared with another variant than the baseline says so in its label; rows of
    an A/A control say so at the right edge; a variant with no effect on this device (not timed) says so in words
    at 1."""
    set_theme()
    data = tidy[tidy["speedup"].notna() | tidy["verdict"].map(is_no_effect)]
    data = data.assign(role=lambda d: d["role"].fillna(CLAIM) if "role" in d else CLAIM)
    data["label"] = [" · ".join(map(str, values)) for values in zip(*(data[column] for column in rows))]
    if "versus" in data:
        data["label"] = [f"{label} (vs {other})" if isinstance(other, str) and other else label
                         for label, other in zip(data["label"], data["versus"])]
    labels, panels = list(dict.fromkeys(data["label"])), list(dict.fromkeys(data[col]))
    measured = [source for source in dict.fromkeys(data["source"]) if source != SEED]
    slots = ([SEED] if (data["source"] == SEED).any() else []) + measured
    step = min(0.22, 0.8 / len(slots)) if slots else 0
    offsets = {source: (i - (len(slots) - 1) / 2) * step for i, source in enumerate(slots)}
    markers = dict(zip(measured, SOURCE_MARKERS))
    ncols = min(len(panels), col_wrap or len(panels)) or 1
    nrows = math.ceil(len(panels) / ncols) or 1
    lines = max((len(textwrap.wrap(label, LABEL_WIDTH)) for label in labels), default=1)
    row_height = max(0.18 * lines + 0.1, 0.13 * len(slots) + 0.08)
    figure, axes = plt.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False, layout="constrained",
                                figsize=(9, 1.6 + nrows * (0.5 + row_height * max(len(labels), 1))))
    y = {label: i for i, label in enumerate(labels)}
    for ax, panel in zip(axes.flat, panels):
        part = data[data[col] == panel]
        ours = part.loc[part["source"] != SEED, "role"]
        control = not ours.empty and (ours == CONTROL).all()  # a panel of A/A controls says so once, in its title
        _draw_panel(ax, part, y, offsets, markers, label_controls=not control)
        ax.set_title(f"{panel} ({CONTROL}: not a claim)" if control else str(panel))
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    _speedup_axes(axes.flat[0], data, labels)
    handles = _legend(markers, SEED in slots)
    figure.legend(handles=handles, loc="outside upper center", ncols=len(handles) // 2, frameon=False, fontsize="small")
    figure.supxlabel(f"speed-up: reference time / variant time (log scale); lines: {INTERVAL}s", fontsize="medium")
    if data.empty:
        figure.text(0.5, 0.5, "no speed-up measured yet", ha="center", va="center")
    return figure


def _draw_panel(ax, part: pd.DataFrame, y: dict, offsets: dict, markers: dict, label_controls: bool) -> None:
    ax.axvline(1.0, color="0.3", lw=1, ls="--", zorder=1)
    for row in part.itertuples():
        height = y[row.label] + offsets[row.source]
        if row.source == SEED:
            ax.scatter(row.speedup, height, marker="D", s=26, color="black", zorder=4)
            continue
        if is_no_effect(row.verdict):
            ax.text(1.0, height, f" {NO_EFFECT}: not timed", ha="left", va="center", fontsize="x-small",
                    color=UNCLEAR_COLOUR, style="italic", zorder=3)
            continue
        colour = VERDICT_COLOURS.get(row.verdict, UNCLEAR_COLOUR)
        alpha = 0.5 if row.role == CONTROL else 1.0
        if not (pd.isna(row.ci_low) or pd.isna(row.ci_high)):
            ax.hlines(height, row.ci_low, row.ci_high, color=colour, lw=2, alpha=alpha, zorder=2)
        ax.scatter(row.speedup, height, marker=markers[row.source], s=42, linewidths=1.5, alpha=alpha, zorder=3,
                   facecolors=colour if row.verdict in VERDICT_COLOURS else "white", edgecolors=colour)
    for label in dict.fromkeys(part.loc[part["role"] == CONTROL, "label"]) if label_controls else ():
        ax.text(0.99, y[label], CONTROL, transform=ax.get_yaxis_transform(), ha="right", va="center",
                fontsize="x-small", color="0.4", style="italic")


def _speedup_axes(ax, data: pd.DataFrame, labels: list[str]) -> None:
    """Row labels top to bottom, and a log x axis from the smallest to the largest value drawn (1 included)."""
    ax.set_yticks(range(len(labels)), [textwrap.fill(label, LABEL_WIDTH) for label in labels])
    ax.set_ylim(max(len(labels), 1) - 0.5, -0.5)
    values = pd.concat([data["speedup"], data["ci_low"], data["ci_high"], pd.Series([1.0])]).astype(float)
    values = values[np.isfinite(values) & (values > 0)]
    low, high = values.min() / 1.25, values.max() * 1.25
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ticks = [m * 10.0 ** e for e in range(-4, 5) for m in (1, 2, 5) if low <= m * 10.0 ** e <= high]
    if len(ticks) > 6:  # several decades: 0.1, 1, 10 (beyond four decades, every other one: 0.01, 1, 100)
        decades = [t for t in ticks if math.log10(t).is_integer()]
        ticks = [t for t in decades if len(decades) <= 4 or round(math.log10(t)) % 2 == 0]
    if len(ticks) < 3:  # a narrow range: plain steps such as 0.9, 1, 1.1
        ticks = [t for t in ticker.MaxNLocator(5).tick_values(low, high) if low <= t <= high and t > 0]
    ax.xaxis.set_major_locator(ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_locator(ticker.NullLocator())


def _legend(markers: dict, seed: bool) -> list[Line2D]:
    """Two rows, filled column by column: the sources, then the verdicts."""
    def mark(label: str = "", marker: str = "o", colour: str = "0.35", filled: bool = True) -> Line2D:
        return Line2D([], [], ls="", marker=marker if label else "", ms=7, mew=1.5, color=colour, label=label,
                      markerfacecolor=colour if filled else "white")
    sources = [mark("live (this page's run)" if source == LIVE else source, marker)
               for source, marker in markers.items()]
    sources += [mark("seed V100 (no interval)", "D", "black")] if seed else []
    verdicts = [mark(verdict, colour=colour) for verdict, colour in VERDICT_COLOURS.items()]
    verdicts += [mark(f"{UNCLEAR} (hollow)", colour=UNCLEAR_COLOUR, filled=False)]
    width = max(len(sources), len(verdicts))
    rows = [row + [mark() for _ in range(width - len(row))] for row in (sources, verdicts)]
    return [handle for pair in zip(*rows) for handle in pair]


WATERFALL_LABEL_WIDTH = 16  # characters per line of a waterfall's step label, written level under its bar


WATERFALL_BAR_INCHES = 1.3  # the width of one bar's slot: a label line of 16 characters at 8 points fits it


def plot_waterfall(steps: pd.DataFrame, labels: "list[str] | tuple[str, ...]", phase: str = "train"):
    """Per model, the waterfall of a cumulative stack (rows of ``summary.step_by_step``): the first bar is the
    baseline's median epoch-equivalent time, and each step's bar spans the change it makes, from the level before it to
    that level over the step's paired speed-up against the step before; coloured by that step's verdict as the
    speed-up figure colours it (grey: can't tell yet, or not waited for). A step with no speed-up (it failed, or was
    compared with one that did) has no bar, nor has any step after it. Labels are wrapped level under their bars, and
    the figure widens with the steps, so that a long label keeps the bars their height."""
    set_theme()
    rows = steps[steps["phase"] == phase]
    models = list(dict.fromkeys(rows["model"]))
    wrapped = [textwrap.fill(label, WATERFALL_LABEL_WIDTH, break_long_words=False) for label in labels]
    lines = max(label.count("\n") + 1 for label in wrapped)
    width = max(5.2, WATERFALL_BAR_INCHES * len(labels))  # each bar as wide as its label's lines
    figure, axes = plt.subplots(1, len(models), figsize=(width * len(models), 3.6 + 0.15 * lines), squeeze=False,
                                sharey=False)
    for ax, model in zip(axes[0], models):
        ours = rows[rows["model"] == model].set_index("step")
        level = float(ours["baseline_epoch_s"].iloc[0])
        ax.bar(0, level, color="0.35", width=0.7)
        ax.text(0, level, f"{level:.3g}", ha="center", va="bottom", fontsize=8)
        for x, label in enumerate(labels[1:], start=1):
            if label not in ours.index or pd.isna(ours.loc[label, "vs previous"]):
                break
            after = level / float(ours.loc[label, "vs previous"])
            ax.bar(x, after - level, bottom=level, width=0.7,
                   color=VERDICT_COLOURS.get(ours.loc[label, "verdict"], UNCLEAR_COLOUR))
            ax.text(x, after, f"{after:.3g}", ha="center", va="top" if after < level else "bottom", fontsize=8)
            level = after
        ax.set_xticks(range(len(labels)), wrapped, rotation=0, ha="center", fontsize=8)
        ax.set_title(f"{model} ({phase})")
        ax.set_ylabel("seconds per epoch-equivalent")
    figure.legend(handles=[Patch(color=colour, label=verdict) for verdict, colour in
                           [*VERDICT_COLOURS.items(), (f"{UNCLEAR} or {NOT_WAITED}", UNCLEAR_COLOUR)]],
                  loc="lower center", ncol=4, fontsize=8, title="each step against the step before",
                  bbox_to_anchor=(0.5, 1.0))
    figure.tight_layout()
    return figure


LEVEL_NAMES = {"level_uniform": "uniform (ln of the alphabet)", "level_unigram": "unigram entropy",
               "level_bigram": "bigram entropy"}  # a text corpus's reference losses (studies.learning.text_levels)


def plot_learning(curves: pd.DataFrame):
    """Training and test loss, and test accuracy, against optimizer steps, one colour per variant; on a text corpus
    the loss panel also draws the test split's entropy levels (uniform, unigram, bigram) as labelled lines."""
    set_theme()
    figure, (loss_ax, accuracy_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    long = curves.melt(id_vars=["variant", "step"], value_vars=["train_loss", "test_loss"], var_name="loss")
    sns.lineplot(data=long, x="step", y="value", hue="variant", style="loss", marker="o", ax=loss_ax)
    for (column, name), shade in zip(LEVEL_NAMES.items(), ("0.55", "0.35", "0.15")):
        if column in curves:
            level = float(curves[column].iloc[0])
            loss_ax.axhline(level, color=shade, ls=":", lw=1.2)
            loss_ax.annotate(f"{name} {level:.2f}", (1, level), xycoords=("axes fraction", "data"), xytext=(-4, 2),
                             textcoords="offset points", ha="right", va="bottom", fontsize=8, color=shade)
    loss_ax.set(title="loss, nats per prediction", xlabel="optimizer steps", ylabel="")
    sns.lineplot(data=curves, x="step", y="test_accuracy", hue="variant", marker="o", ax=accuracy_ax, legend=False)
    accuracy_ax.set(title="test accuracy", xlabel="optimizer steps", ylabel="")
    sns.move_legend(loss_ax, "upper left", bbox_to_anchor=(0, -0.18), ncol=2, fontsize=8, frameon=False)
    figure.tight_layout()
    return figure


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


def legend_below(target: "sns.FacetGrid | Figure | Axes", columns: int = 3) -> None:
    """The legend of a seaborn grid, or of a figure (or the figure an axes is in), under its panels, outside every
    axes, so that it covers no title and no data (seaborn puts a grid's at the right edge, where a long panel title
    runs into it; matplotlib, pandas and seaborn put an axes' inside it). A figure's legend gathers every panel's
    labelled artists and legends, one entry per label, keeps the title of a legend it replaces, and removes the
    panels' own legends. A figure with nothing labelled is an error."""
    if isinstance(target, sns.FacetGrid):
        sns.move_legend(target, "upper center", bbox_to_anchor=(0.5, 0.0), ncol=columns, frameon=False, title=None)
        target.figure.tight_layout()
        return
    figure = target.figure if isinstance(target, Axes) else target
    entries: dict[str, object] = {}
    title = None
    for ax in figure.axes:
        legend = ax.get_legend()
        if legend is None:
            pairs = zip(*ax.get_legend_handles_labels())
        else:
            pairs = zip(legend.legend_handles, [text.get_text() for text in legend.get_texts()])
            title = title or legend.get_title().get_text() or None
            legend.remove()
        for handle, label in pairs:
            entries.setdefault(label, handle)
    if not entries:
        raise ValueError("legend_below: the figure has nothing labelled to put under its panels; label an artist")
    figure.legend(list(entries.values()), list(entries), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                  ncols=min(columns, len(entries)), frameon=False, title=title)


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
    legend_below(grid)
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


def plot_step_trace(samples: pd.DataFrame):
    """Seconds of every step of repeat 0 on a log scale, per model and phase: the first step carries the compile."""
    set_theme()
    grid = sns.relplot(data=compile_cost.step_trace(samples), kind="line", x="step", y="seconds", hue="variant", style="variant",
                       markers=True, dashes=False, row="phase", col="model", height=3.0, aspect=1.3,
                       facet_kws={"sharey": False})
    grid.set(yscale="log")
    grid.set_titles("{col_name}, {row_name}")
    legend_below(grid)
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
    legend_below(grid)
    if title:
        grid.figure.suptitle(title, y=1.02)
    return grid


THROUGHPUT = "throughput, samples/s (back-to-back calls)"


CALL_TIME = "ms: a call back-to-back (line); a request one at a time (p50 to p99)"


def plot_batch_sizes(sweep: pd.DataFrame, model: str | None = None, latency: pd.DataFrame | None = None):
    """An inference tune's two serving numbers against batch size, log-log, one line per configuration: throughput
    (back-to-back calls, inputs on the device: its ``sweep``) above, the time per call below, with its request latency
    (one request at a time, copy in and out included: its ``latency``, if given) as a p50 point and a bar to p99. A
    ``model`` column, if there is one, gives a column of panels per model. An out-of-memory point is a cross on the
    x axis of the lower panel."""
    set_theme()
    frame = sweep.assign(model=sweep["model"] if "model" in sweep else model or "")
    ok = frame[frame["status"] == "ok"]
    long = pd.concat([ok.assign(metric=THROUGHPUT, value=ok["samples_per_s"]),
                      ok.assign(metric=CALL_TIME, value=ok["call_ms"])], ignore_index=True)
    configs = list(dict.fromkeys(frame["config"]))
    grid = sns.relplot(data=long, kind="line", x="batch", y="value", hue="config", style="config", hue_order=configs,
                       style_order=configs, markers=True, dashes=False, row="metric", col="model", height=3.0,
                       aspect=1.3, facet_kws={"sharey": False, "sharex": False})
    requests = pd.DataFrame() if latency is None else \
        latency.assign(model=latency["model"] if "model" in latency else model or "").query("status == 'ok'")
    colours = dict(zip(configs, sns.color_palette(n_colors=len(configs))))
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    grid.set(xscale="log", yscale="log")
    for (metric, name), ax in grid.axes_dict.items():
        ax.set_xticks(sorted(set(frame.loc[frame["model"] == name, "batch"])))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        if metric == CALL_TIME and len(requests):
            for row in requests[requests["model"] == name].itertuples():
                ax.errorbar([row.batch], [row.p50_ms], yerr=[[0], [row.p99_ms - row.p50_ms]], fmt="D",
                            color=colours.get(row.config), markerfacecolor="white", capsize=3)
        for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            set_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))  # plain numbers
        out_of_memory = frame[(frame["model"] == name) & (frame["status"] == "out of memory")]
        if metric == CALL_TIME and len(out_of_memory):
            low = ax.get_ylim()[0]
            ax.plot(out_of_memory["batch"], [low] * len(out_of_memory), "x", color="black", markersize=9,
                    clip_on=False)
            ax.annotate("out of memory", (out_of_memory["batch"].min(), low), xytext=(0, 8),
                        textcoords="offset points", ha="right", fontsize="small")
    grid.set_titles("{col_name}: {row_name}" if frame["model"].iloc[0] else "{row_name}")
    for ax in grid.axes.flat:  # a title as wide as its panel: two panels' long titles side by side do not meet
        ax.set_title(textwrap.fill(ax.get_title(), 44))
    grid.set_axis_labels("batch size", "")
    legend_below(grid)
    return grid


def plot_memory_tradeoff(summary: pd.DataFrame, labels: "list[str] | tuple[str, ...]", phase: str = "train"):
    """Per model, what each variant pays and saves: its speed relative to the baseline (tokens or images per second,
    with the interval) across, its peak memory up, one labelled point per variant coloured by verdict; the baseline
    sits at 1 (dashed). Down and to the right is better; checkpointing moves down and to the left."""
    set_theme()
    rows = summary[(summary["phase"] == phase) & summary["variant"].isin(labels)]
    models = list(dict.fromkeys(rows["model"]))
    figure, axes = plt.subplots(1, len(models), figsize=(5.6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        part = rows[rows["model"] == model].set_index("variant").reindex(list(labels)).dropna(subset=["speedup"])
        for label, row in part.iterrows():
            colour = VERDICT_COLOURS.get(row["verdict"], UNCLEAR_COLOUR if row["verdict"] != "baseline" else "0.2")
            ax.errorbar(row["speedup"], row["peak_mem_mb"], fmt="o", color=colour, markersize=8, capsize=3,
                        xerr=[[row["speedup"] - row["ci_low"]], [row["ci_high"] - row["speedup"]]])
            ax.annotate("\n".join(textwrap.wrap(str(label), 24)), (row["speedup"], row["peak_mem_mb"]),
                        textcoords="offset points", xytext=(10, 0), va="center", fontsize=8)
        ax.axvline(1.0, color="0.5", linestyle="--", linewidth=1)
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}x"))
        ax.set_ylim(0, 1.15 * part["peak_mem_mb"].max())
        ax.set_title(f"{model} ({phase}); colour: the verdict on speed")
        ax.set_xlabel(f"speed relative to the baseline ({INTERVAL})")
        ax.set_ylabel("peak memory, MiB")
    figure.tight_layout()
    return figure
