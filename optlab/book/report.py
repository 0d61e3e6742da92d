"""Tables and figures built from summaries and stored records, so live runs and stored references look the same.

Every table a page shows goes through :func:`html_table` (:func:`set_theme` registers it with IPython): no 0..N
index column, three significant figures, "—" where a value is missing, and the columns that a table marks as
details in a collapsed block. The headline figure is :func:`plot_speedups`: speed-ups on a log axis with their
intervals, coloured by verdict, beside the seed's V100 speed-up.
"""
from __future__ import annotations

import html
import math
import numbers
import re
import textwrap

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..core.results import store
from ..core.errors import OptlabError
from ..core.techniques.no_effect import NO_EFFECT, is_no_effect
from ..core.knobs.profiles import ALL_MODELS
from ..core.techniques.registry import PHASES, Experiment, get_experiment
from ..core.results.seed import SEED_MACHINE, seed_speedups
from ..core.stats.summary import CLAIM, CONTROL, NOT_WAITED
from ..core.techniques.cnn import SET_NAMES, technique_set
from ..core.measuring.timing import (
    DEPENDENT, ERROR_RATE, FASTER, INTERVAL, SAME, SLOWER, UNCLEAR, VERDICTS, dependent_rounds,
    page_bound, percent, too_wide,
)
from ..studies.kernels import compile_cost, cuda_graphs

MISSING = "—"
SEED, LIVE = "seed V100", "live"
KEYS = ["model", "phase", "variant"]
SPEEDUP = f"speed-up ({INTERVAL})"
DETAILS = {"n": "n (pairs)", "epoch_s": "epoch s (median)", "epoch_iqr_s": "IQR s", "epoch_min_s": "min s",
           "step_ms": "step ms", "startup_s": "start-up s", "images_per_s": "img/s", "tflops": "TFLOP/s",
           "first_peak_mem_mb": "first repeat's peak MiB"}
GRAPHS_SKIPPED = "CUDA graphs skipped: timed as plain compile"
TIDY = ["model", "phase", "variant", "source", "speedup", "ci_low", "ci_high", "verdict", "role", "versus"]
# seaborn's colour-blind blue, vermillion and green; "can't tell yet" is grey and hollow
VERDICT_COLOURS = {FASTER: "#0173b2", SLOWER: "#d55e00", SAME: "#029e73"}
UNCLEAR_COLOUR = "#949494"
COMPARED_WITH = "compared with"
SOURCE_MARKERS = ("o", "s", "^", "v", "P", "X")  # the live run, then each stored reference machine
LABEL_WIDTH = 34  # characters per line of a row label of the speed-up figure
LONG_NAME = 10  # characters: a longer word in a table cell may break after punctuation
WIDE = 9  # a table with more columns is set tighter (book/_static/optlab.css), to fit the article column


def set_theme() -> None:
    """The book's one look: seaborn's colour-blind theme for figures and, under IPython, :func:`html_table` for every
    DataFrame a cell shows."""
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    try:
        from IPython import get_ipython
    except ImportError:  # the command line: no pages to render
        return
    shell = get_ipython()
    if shell is not None:
        shell.display_formatter.formatters["text/html"].for_type(pd.DataFrame, html_table)


def number(value: object) -> str:
    """A value as a table shows it: three significant figures (whole numbers from 100 up), "—" when missing."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)) or value == "":
        return MISSING
    if not isinstance(value, numbers.Number) or isinstance(value, (bool, np.bool_)):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(value)
    value = float(value)
    return f"{value:.0f}" if abs(value) >= 100 or not math.isfinite(value) else f"{value:.3g}"


def significant(value: float, digits: int = 3) -> float:
    """``value`` rounded to ``digits`` significant figures (whole numbers above that)."""
    if isinstance(value, numbers.Integral) or pd.isna(value) or value == 0 or not math.isfinite(value):
        return value
    return round(float(value), max(0, digits - 1 - math.floor(math.log10(abs(value)))))


def ratio(value: float) -> str:
    """A speed-up with three significant figures, trailing zeros kept: 1.10, 0.0250, 12.0."""
    return f"{value:#.3g}".rstrip(".")


def speedup_text(speedup: float, low: float, high: float, rounds: "int | None" = None) -> str:
    """"1.23 (1.10–1.38)": a speed-up and its interval; the speed-up alone without one; "—" without either; an
    interval whose high end is more than ``timing.TOO_WIDE`` times its low end is too wide to mean anything and says so,
    with the ``rounds`` it had."""
    if pd.isna(speedup):
        return MISSING
    if pd.isna(low) or pd.isna(high) or low == high:  # no interval, or the baseline against itself
        return ratio(speedup)
    if too_wide(low, high):
        had = "" if rounds is None or pd.isna(rounds) else f" after {int(rounds)} rounds"
        return f"{ratio(speedup)} (interval too wide to tell{had})"
    return f"{ratio(speedup)} ({ratio(low)}–{ratio(high)})"


def noise_line(summary: pd.DataFrame) -> str:
    """What a run measured and what that lets the rule tell: the round-level noise of its comparisons, the half-width
    of their intervals at the rounds they had, and the page's bound on a false verdict (:func:`timing.page_bound`)."""
    compared = summary[summary["verdict"].isin(VERDICTS)] if "verdict" in summary else summary.iloc[0:0]
    if compared.empty or "noise" not in compared or compared["noise"].isna().all():
        return "No comparison on this page has an interval yet."
    noise = 100 * compared["noise"].astype(float)
    half = 100 * (np.exp((np.log(compared["ci_high"].astype(float)) - np.log(compared["ci_low"].astype(float))) / 2)
                  - 1)
    count = len(compared)
    return (f"Measured: {count} comparisons, a round's noise (standard deviation of its log speed-up) "
            f"{noise.median():.1f} % median ({noise.min():.1f}-{noise.max():.1f} %), {compared['n'].median():.0f} rounds median. At that, "
            f"an interval reaches about ±{half.median():.1f} % around its speed-up: differences beyond that are told, "
            f"and \"{SAME}\" needs it under 2 %. Each is a {INTERVAL} (at most {percent(ERROR_RATE)} of comparisons "
            f"of a configuration with itself say faster or slower); with {count} on this page, the chance that any of "
            f"them does is at most {percent(page_bound(count))}.")


def verdict_text(verdict: object, role: object = CLAIM) -> str:
    """The verdict, marked where the row is an A/A control (a phase the technique cannot change): not a claim. A
    variant with no effect on this device was not timed, so it is no control either."""
    if pd.isna(verdict) or verdict == "":
        return MISSING
    marked = role == CONTROL and verdict != "baseline" and not is_no_effect(verdict)
    return f"{verdict} ({CONTROL})" if marked else str(verdict)


def dependence_warning(verdict: str, autocorrelation: object, rounds: object) -> str:
    """The verdict, with a warning where its comparison's rounds look dependent (:func:`timing.dependent_rounds`):
    its interval assumed independent rounds and may be too narrow."""
    if pd.isna(autocorrelation) or pd.isna(rounds) or not dependent_rounds(float(autocorrelation), int(rounds)):
        return verdict
    return f"{verdict} ({DEPENDENT.format(autocorrelation=float(autocorrelation))})"


def html_table(frame: pd.DataFrame) -> str:
    """``frame`` as a page shows it: named index levels as columns (an unnamed index is dropped), every value through
    :func:`number`, and the columns named in ``frame.attrs["details"]`` in a collapsed "all columns" block that
    repeats the ``frame.attrs["keys"]`` columns."""
    details, keys = frame.attrs.get("details", []), frame.attrs.get("keys", [])
    names = [name for name in frame.index.names if name is not None]
    frame = frame.reset_index(drop=not names or any(name in frame.columns for name in names))
    if isinstance(frame.columns, pd.MultiIndex):
        frame.columns = [" ".join(str(part) for part in column if part != "") for column in frame.columns]
    details = [column for column in details if column in frame]
    shown = _html(frame[[column for column in frame if column not in details]])
    if not details:
        return shown
    more = _html(frame[[column for column in keys if column in frame] + details])
    return f'{shown}<details class="optlab-details"><summary>all columns</summary>{more}</details>'


def _html(frame: pd.DataFrame) -> str:
    wide = len(frame.columns) > WIDE
    head = "".join(f"<th>{_text(column, wide)}</th>" for column in frame.columns)
    body = "".join("<tr>" + "".join(_cell(value, wide) for value in row) + "</tr>"
                   for row in frame.itertuples(index=False))
    return (f'<table class="optlab-table{" wide" if wide else ""}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def _cell(value: object, wide: bool) -> str:
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, np.bool_)):
        return f'<td class="num">{html.escape(number(value))}</td>'
    return f"<td>{_text(number(value), wide)}</td>"


def _text(value: object, wide: bool) -> str:
    """Escaped, and breakable where a long name (an operator's) has punctuation, and in a wide table after every "_"
    (column names such as data_wait_ms), so that the table fits the article column; a whole value written
    ``[text](https://...)`` (:func:`linked_sources`) is a link."""
    link = LINK.fullmatch(str(value))
    if link:
        return f'<a href="{html.escape(link.group(2))}">{html.escape(link.group(1))}</a>'
    mark = "\x00"  # set before escaping, written as <wbr> after

    def breakable(word: str) -> str:
        if len(word) > LONG_NAME:
            return re.sub(r"([_.#:/(])", rf"\1{mark}", word)
        return word.replace("_", "_" + mark) if wide else word

    return html.escape(" ".join(map(breakable, str(value).split(" ")))).replace(mark, "<wbr>")


LINK = re.compile(r"\[([^\]]+)\]\((https?://[^)\s]+)\)")  # a table cell's [text](url): a link on the page


def linked_sources(frame: pd.DataFrame, text: str = "source", url: str = "url") -> pd.DataFrame:
    """Published figures as a page shows them: the ``text`` column a link to its ``url`` (``[text](url)``, which
    :func:`html_table` writes as a link), and no column of raw addresses."""
    missing = [column for column in (text, url) if column not in frame]
    if missing:
        raise OptlabError(f"linked_sources needs the columns {missing}; the frame has {list(frame.columns)}")
    linked = [f"[{name}]({address})" for name, address in zip(frame[text], frame[url])]
    return frame.drop(columns=url).assign(**{text: linked})


def in_order(frame: pd.DataFrame, variants: "list[str] | tuple[str, ...]" = ()) -> pd.DataFrame:
    """Rows in the profiles' model order, train before test, and variants in ``variants`` order (the registry's),
    any others after them as found."""
    ranks = {"model": [*ALL_MODELS, *frame["model"]], "phase": [*PHASES, *frame["phase"]],
             "variant": [*variants, *frame["variant"]]}
    ranks = {key: {value: i for i, value in enumerate(dict.fromkeys(values))} for key, values in ranks.items()}
    return frame.sort_values(KEYS, key=lambda column: column.map(ranks[column.name]), kind="stable")


def graphs_skipped(samples: pd.DataFrame | None) -> set[tuple[str, str, str]]:
    """The (model, phase, variant) rows whose compiled model was meant to replay CUDA graphs and Inductor skipped
    them (a mutated input, a CPU tensor): those rows timed plain compiled code."""
    if samples is None or "cudagraph_skips" not in samples:
        return set()
    skipped = samples[samples["cudagraph_skips"].fillna(0) > 0]
    return set(skipped[KEYS].itertuples(index=False, name=None))


def comparison_table(summary: pd.DataFrame, variants: "list[str] | tuple[str, ...]" = (),
                     samples: pd.DataFrame | None = None) -> pd.DataFrame:
    """The summary as a reader reads it: model, phase, variant, the speed-up with its interval, the verdict and peak
    memory first (the repeats after the first; the first repeat's one-off peak is a detail), in the registry's variant
    order (``variants``); repeats, times and throughput as details. With the run's ``samples``, a row whose CUDA
    graphs Inductor skipped says so beside its verdict (:data:`GRAPHS_SKIPPED`)."""
    rows = in_order(summary, variants)
    roles = rows["role"] if "role" in rows else pd.Series(CLAIM, index=rows.index)
    references = rows["reference"] if "reference" in rows else pd.Series(np.nan, index=rows.index)
    skipped = graphs_skipped(samples)
    verdicts = [dependence_warning(verdict_text(v, r), a, n) for v, r, a, n in
                zip(rows["verdict"], roles, rows.get("autocorrelation", pd.Series(np.nan, index=rows.index)),
                    rows["n"] if "n" in rows else [0] * len(rows))]
    details = throughput_details(rows)
    table = pd.DataFrame({
        "model": rows["model"], "phase": rows["phase"], "variant": rows["variant"],
        COMPARED_WITH: [MISSING if pd.isna(r) else str(r) for r in references],
        SPEEDUP: [speedup_text(*values) for values in zip(rows["speedup"], rows["ci_low"], rows["ci_high"],
                                                          rows["n"] if "n" in rows else [None] * len(rows))],
        "verdict": [f"{verdict} ({GRAPHS_SKIPPED})" if key in skipped else verdict
                    for verdict, key in zip(verdicts, rows[KEYS].itertuples(index=False, name=None))],
        "peak MiB": rows["peak_mem_mb"].map(significant),
        **{label: rows[column].map(significant) if column in rows else MISSING for column, label in details.items()},
    }).reset_index(drop=True)
    table.attrs.update(keys=KEYS, details=list(details.values()))
    return table


def throughput_details(rows: pd.DataFrame) -> dict[str, str]:
    """:data:`DETAILS`, with the throughput in the run's own unit where it is not images (tokens/s for the GPT)."""
    units = set(rows["unit"].dropna()) if "unit" in rows else set()
    if len(units) != 1 or units == {"images"} or "items_per_s" not in rows:
        return DETAILS
    return {("items_per_s" if column == "images_per_s" else column): (f"{units.pop()}/s" if column == "images_per_s"
                                                                      else label) for column, label in DETAILS.items()}


STEP_BEFORE = f"vs the step before ({INTERVAL})"
STEP_VERDICT = "verdict (vs the step before)"
BASELINE_ESTIMATE = "vs the baseline (estimate at the same look)"
BASELINE_VERDICT = "verdict (vs the baseline)"


def stack_table(steps: pd.DataFrame) -> pd.DataFrame:
    """A cumulative stack (rows of ``summary.step_by_step``) as a reader reads it: each step's speed-up over the step
    before it with its interval and the verdict the rule waited for, then its speed-up over the baseline with its
    interval read at the same look, an estimate with no verdict, peak memory and epoch time; the rounds of each as
    details. A record whose rule waited for the steps against the baseline (made before stacks were chained) shows
    those verdicts in a column of their own, and "not waited for" against the step before."""
    table = pd.DataFrame({
        "model": steps["model"], "phase": steps["phase"], "step": steps["step"],
        STEP_BEFORE: [speedup_text(*values) for values in zip(steps["vs previous"], steps["ci_low"],
                                                              steps["ci_high"], steps["n"])],
        STEP_VERDICT: steps["verdict"].map(verdict_text),
        BASELINE_ESTIMATE: [speedup_text(*values) for values in zip(steps["vs baseline"], steps["baseline_low"],
                                                                    steps["baseline_high"], steps["baseline_n"])],
        "peak MiB": steps["peak_mem_mb"].map(significant), "epoch s (median)": steps["epoch_s"].map(significant),
        "n (vs the step before)": steps["n"], "n (vs the baseline)": steps["baseline_n"],
    })
    if (steps["verdict"] == NOT_WAITED).any():
        table.insert(list(table.columns).index(BASELINE_ESTIMATE) + 1, BASELINE_VERDICT,
                     steps["baseline_verdict"].map(verdict_text))
    table.attrs.update(keys=["model", "phase", "step"], details=["n (vs the step before)", "n (vs the baseline)"])
    return table.reset_index(drop=True)


def speedups(experiment: "str | Experiment", live: pd.DataFrame | None = None, stored: bool = True) -> pd.DataFrame:
    """Tidy speed-ups of every variant but the baseline, one row per source: the ``live`` summary, and with ``stored``
    each stored reference machine's and the seed's V100 speed-up where one of ours has the same model, phase and
    variant."""
    experiment = get_experiment(experiment)
    frames = [] if live is None or live.empty else [live.assign(source=LIVE)]
    reference = reference_summary(experiment.name) if stored else None
    if reference is not None:
        frames += [rows.assign(source=machine) for machine, rows in reference.groupby("machine")]
    if not frames:
        return pd.DataFrame(columns=TIDY)
    ours = pd.concat([frame.reindex(columns=TIDY) for frame in frames], ignore_index=True)
    ours = ours[ours["variant"] != experiment.baseline_label].assign(role=lambda d: d["role"].fillna(CLAIM))
    ours["versus"] = [versus(experiment, variant) for variant in ours["variant"]]
    seed = seed_speedups(experiment.name).merge(ours[KEYS].drop_duplicates(), on=KEYS) if stored else pd.DataFrame()
    if not seed.empty:
        ours = pd.concat([seed.assign(source=SEED, role=CLAIM).reindex(columns=TIDY), ours], ignore_index=True)
    return in_order(ours, experiment.labels).reset_index(drop=True)


def versus(experiment: Experiment, variant: str) -> str:
    """The reference a variant is compared with when it is not the baseline (the figure says so); else ""."""
    reference = experiment.reference_of(variant)
    return "" if reference == experiment.baseline_label else reference


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


def seed_comparison(technique: str, live: pd.DataFrame | None = None,
                    reference: pd.DataFrame | None = None) -> pd.DataFrame:
    """The seed's V100 seconds and speed-ups beside ours: the ``live`` summary and each machine of ``reference`` (stored
    summaries with a ``machine`` column), one row per model, phase and variant in the registry's variant order."""
    seed = seed_speedups(technique)
    table = pd.DataFrame({**{key: seed[key] for key in KEYS}, "V100 s": seed["seconds"].map(significant),
                          "V100 speed-up": seed["speedup"].map(ratio)})
    for name, rows in _sources(live, reference):
        table = table.merge(_ours(name, rows), on=KEYS, how="outer")
    table.attrs["seed_machine"] = SEED_MACHINE
    return in_order(table, get_experiment(technique).labels).reset_index(drop=True)


def reference_comparison(technique: str, live: pd.DataFrame | None = None) -> pd.DataFrame:
    """A technique beyond the seed: the live speed-ups beside every stored reference machine's, one row per variant."""
    table = pd.DataFrame(columns=KEYS)
    for name, rows in _sources(live, reference_summary(technique)):
        ours = _ours(name, rows, memory=True)
        table = ours if table.empty else table.merge(ours, on=KEYS, how="outer")
    return in_order(table, get_experiment(technique).labels).reset_index(drop=True)


def _sources(live: pd.DataFrame | None, reference: pd.DataFrame | None) -> list[tuple[str, pd.DataFrame]]:
    found = [(LIVE, live)] + (list(reference.groupby("machine")) if reference is not None else [])
    return [(name, rows) for name, rows in found if rows is not None and not rows.empty]


def _ours(name: str, rows: pd.DataFrame, memory: bool = False) -> pd.DataFrame:
    """One source's columns: median epoch seconds, speed-up with its interval, verdict (and peak memory)."""
    roles = rows["role"] if "role" in rows else pd.Series(CLAIM, index=rows.index)
    columns = {key: rows[key] for key in KEYS} | {
        f"{name} s": rows["epoch_s"].map(significant),
        f"{name} speed-up ({INTERVAL})": [speedup_text(*values)
                                          for values in zip(rows["speedup"], rows["ci_low"], rows["ci_high"])],
        f"{name} verdict": [verdict_text(v, r) for v, r in zip(rows["verdict"], roles)],
    }
    if memory:
        columns[f"{name} peak MiB"] = rows["peak_mem_mb"].map(significant)
    return pd.DataFrame(columns).drop_duplicates(KEYS, keep="last")


def reference_summary(technique: str) -> pd.DataFrame | None:
    """Stored reference summaries of ``technique`` from every machine under ``results/reference``, or None."""
    paths = [p for machine in store.reference_machines() for p in (store.REFERENCE_DIR / machine).glob(f"{technique}.json")]
    if not paths:
        return None
    return pd.concat([store.load_summaries(p) for p in paths], ignore_index=True)


def reference_command(technique: str) -> str:
    """The command that makes a stored GPU reference of ``technique`` (the reference set that measures it)."""
    set_name = next((name for name in SET_NAMES if name != "all" and technique in technique_set(name)), "all")
    return f"`python -m optlab reference --set {set_name}`"


def reference_note(technique: str) -> str:
    """One line: which machines have a stored reference of ``technique``, or how to make one."""
    reference = reference_summary(technique)
    if reference is None:
        return (f"no stored GPU reference of {technique} yet: {reference_command(technique)} on a GPU machine writes "
                "one under results/reference/<machine>/")
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
    grid.set_axis_labels("batch size", "")
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
