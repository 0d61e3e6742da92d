"""Figures others published, as data with their sources: what THEY measured, on their hardware, to set beside the
seed's and ours, never mixed with them. One table (``optlab/resources/published_figures.csv``), one row a number as
its source prints it, with the source's URL and where in it the number stands.

A row is ``measured`` (a number), ``advice`` (a guide that recommends without a number) or ``searched`` (a source
looked through for a chapter that has no figure from it: the page names it)."""
from __future__ import annotations

import math
from importlib import resources

import pandas as pd

from ..errors import OptlabError

FIGURES = "published_figures.csv"  # under optlab/resources
COLUMNS = ["chapter", "kind", "source", "url", "where", "hardware", "software", "model", "before_setting",
           "after_setting", "metric", "before", "after", "unit", "speedup", "from_plot", "note"]
KINDS = ("measured", "advice", "searched")
# The chapters a row may name: the seed's techniques and those beyond it (chapters 1-16, by their experiment's name),
# then the pages that show published figures of their own.
CHAPTERS = ("data_loading", "non_blocking", "multiple_of_8", "mixed_precision", "set_to_none", "gradient_accumulation",
            "no_grad", "cudnn_benchmark", "channels_last", "compile", "cuda_graphs", "precision", "optimizers",
            "data_pipeline", "profiling", "all_together", "gpt_all_together", "kv_cache", "quantization", "speculative",
            "serving", "compile_time", "graph_breaks", "ceilings")
LOWER_IS_BETTER = ("s", "ms", "µs", "minutes", "hours")  # a time: the speed-up is before / after
HIGHER_IS_BETTER = ("img/s", "samples/s", "tokens/s", "TFLOP/s", "%", "x")  # a rate (or a ratio): after / before
KEYS = ["chapter", "url", "where", "hardware", "model", "before_setting", "after_setting", "metric"]


def published_figures(chapter: str | None = None, name: str = FIGURES) -> pd.DataFrame:
    """Every row of ``name`` (a file under ``optlab/resources``), checked (:func:`check`), or those of ``chapter``
    (one of ``CHAPTERS``; empty where it has none), with the speed-up each row claims or implies
    (``speed-up``: the published one where the source prints it, else before and after in the unit's direction)."""
    with resources.files("optlab.resources").joinpath(name).open() as handle:
        table = pd.read_csv(handle, dtype={"speedup": str}, keep_default_na=False, na_values={
            column: [""] for column in ("before", "after")})
    check(table, name)
    table = table[COLUMNS].assign(**{"speed-up": [speedup_of(row) for row in table.itertuples()]})
    if chapter is None:
        return table
    if chapter not in CHAPTERS:
        raise OptlabError(f"unknown chapter {chapter!r}; published figures are kept for {list(CHAPTERS)}")
    return table[table["chapter"] == chapter].reset_index(drop=True)


def check(table: pd.DataFrame, name: str = FIGURES) -> None:
    """Refuse, in one line naming the row, a table that breaks a schema rule: its columns, a row without a URL, an
    unknown chapter, kind or unit, a measured row without a number or with one that is not positive, a published
    speed-up that its before and after (in the unit's direction) do not give to the digits printed, a duplicate."""
    missing = [column for column in COLUMNS if column not in table]
    if missing:
        raise OptlabError(f"{name}: missing columns {missing}; a published figure has {COLUMNS}")
    for line, row in zip(range(2, len(table) + 2), table.itertuples()):
        where = f"{name} line {line} ({row.chapter}, {row.source})"
        if not str(row.url).startswith("https://"):
            raise OptlabError(f"{where}: no URL of its primary source (an https:// address is required)")
        if row.chapter not in CHAPTERS:
            raise OptlabError(f"{where}: unknown chapter {row.chapter!r}; allowed: {list(CHAPTERS)}")
        if row.kind not in KINDS:
            raise OptlabError(f"{where}: unknown kind {row.kind!r}; allowed: {list(KINDS)}")
        if row.kind == "measured":
            _check_numbers(row, where)
    duplicated = table[table.duplicated(KEYS, keep=False)]
    if not duplicated.empty:
        first = duplicated.iloc[0]
        raise OptlabError(f"{name}: duplicate rows of {first['chapter']} from {first['source']} ({first['metric']}, "
                          f"{first['after_setting']}); one number is one row")


def _check_numbers(row, where: str) -> None:
    if row.unit not in LOWER_IS_BETTER + HIGHER_IS_BETTER:
        raise OptlabError(f"{where}: unknown unit {row.unit!r}; allowed: {list(LOWER_IS_BETTER + HIGHER_IS_BETTER)}")
    numbers = {"before": row.before, "after": row.after, "speedup": _number(row.speedup)}
    given = {key: value for key, value in numbers.items() if not math.isnan(value)}
    if "after" not in given and "speedup" not in given:
        raise OptlabError(f"{where}: a measured row needs an after value or a published speed-up")
    bad = [f"{key} {value}" for key, value in given.items() if value <= 0]
    if bad:
        raise OptlabError(f"{where}: {', '.join(bad)}: every before, after and speed-up must be a positive number")
    if {"before", "after", "speedup"} <= set(given):
        implied = ratio(row.before, row.after, row.unit)
        digits = _decimals(row.speedup)
        if abs(implied - given["speedup"]) > 0.5 * 10 ** -digits + 1e-9:
            direction = "before / after (a time)" if row.unit in LOWER_IS_BETTER else "after / before (a rate)"
            raise OptlabError(f"{where}: published speed-up {row.speedup} but {direction} is {implied:.4g}")


def ratio(before: float, after: float, unit: str) -> float:
    """The speed-up from ``before`` to ``after``: before / after for a time, after / before for a rate."""
    return before / after if unit in LOWER_IS_BETTER else after / before


def speedup_of(row) -> float:
    """A row's speed-up: the published one where printed, else the one its before and after give, else NaN."""
    published = _number(row.speedup)
    if not math.isnan(published) or math.isnan(row.before) or math.isnan(row.after):
        return published
    return ratio(row.before, row.after, row.unit)


def _number(text: object) -> float:
    return float(text) if str(text).strip() not in ("", "nan") else math.nan


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0
