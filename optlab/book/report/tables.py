"""Every table a page shows: the book's HTML table (no index column, three significant figures, details in a
collapsed block), the comparison table of a summary and the stack's step-by-step table.
"""
from __future__ import annotations

import html
import numbers
import re

import numpy as np
import pandas as pd
import seaborn as sns

from ...core.errors import OptlabError
from ...core.knobs.profiles import ALL_MODELS
from ...core.techniques.registry import PHASES
from ...core.stats.summary import CLAIM, NOT_WAITED
from ...core.measuring.timing import INTERVAL
from .text import COMPARED_WITH, MISSING, dependence_warning, number, significant, speedup_text, verdict_text

KEYS = ["model", "phase", "variant"]


SPEEDUP = f"speed-up ({INTERVAL})"


DETAILS = {"n": "n (pairs)", "epoch_s": "epoch s (median)", "epoch_iqr_s": "IQR s", "epoch_min_s": "min s",
           "step_ms": "step ms", "startup_s": "start-up s", "images_per_s": "img/s", "tflops": "TFLOP/s",
           "first_peak_mem_mb": "first repeat's peak MiB"}


GRAPHS_SKIPPED = "CUDA graphs skipped: timed as plain compile"


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


LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])+)\]\((https?://[^)\s]+)\)")  # a cell's [text](url), text with [brackets] too


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
