"""The summary page's serving, memory and first-step sections: the results those chapters keep as tables.

Serving, memory and first-step chapters keep their tables under ``results/live/pages/`` (``chapter.downloads``); their
formats change as those chapters grow, so each is read by the columns it has: the labels (text columns) and the
figures whose names say what they are (tokens/s, TTFT, TPOT, ITL, peak, saved, compile seconds, graphs). A table that
is not there reads "not run".
"""
from __future__ import annotations

import re

import pandas as pd

from ..core.results import store
from .downloads import PAGE_RUNS

# (section, page table under results/live/pages, what it is): the names chapter.downloads gives the tables
SERVING_TABLES = (
    ("decoding with a KV cache, compiled", "kv-cache-and-compiled-decoding-timings", "chapter 30"),
    ("weight-only quantization", "weight-only-quantization-decode-timings", "chapter 31"),
    ("speculative decoding", "speculative-decoding-timings", "chapter 32"),
    ("serving latency", "serving-latency", "chapter 33"),
    ("serving throughput", "serving-throughput", "chapter 33"),
)
MEMORY_TABLES = (("memory fixes", "memory-fixes", "chapter 29"),)
FIRST_STEP_TABLES = (
    ("compile starts: each first step against the whole model's cold one", "compile-start-verdicts", "chapter 34"),
    ("compile starts: compile seconds, steady speed-up and break-even", "compile-start-table", "chapter 34"),
    ("graph breaks: a forward with and without them", "graph-breaks-forward-timings", "chapter 35"),
    ("shapes that change: graphs, padding and tokens/s", "shape-strategies", "chapter 36"),
)
FIGURE_COLUMNS = re.compile(r"tokens?/s|tok/s|_per_s|ttft|tpot|itl|latency|\bp\d+ ms|speed-?up|peak|saved|verdict"
                            r"|goodput|times shorter|compile s|break-even steps|graphs|wasted", re.IGNORECASE)
SETTING_COLUMNS = re.compile(r"^(rate|batch)\b", re.IGNORECASE)  # numbers that label a row (a request rate, a batch)
NOT_RUN = "not run"


def page_table(name: str) -> pd.DataFrame | None:
    """A table a chapter kept under ``results/live/pages/<name>.csv``, None where that chapter has not run."""
    path = store.LIVE_DIR / PAGE_RUNS / f"{name}.csv"
    return pd.read_csv(path) if path.exists() else None


def compact(table: pd.DataFrame) -> pd.DataFrame:
    """The labels (text columns and a row's rate or batch, the first four) and the figures a reader compares (named like ``FIGURE_COLUMNS``)
    of a kept table; every column where none is named so."""
    labels = [c for c in table.columns if SETTING_COLUMNS.search(str(c))
              or (not pd.api.types.is_numeric_dtype(table[c]) and not FIGURE_COLUMNS.search(str(c)))][:4]
    figures = [c for c in table.columns if FIGURE_COLUMNS.search(str(c)) and c not in labels]
    return table[labels + figures] if figures else table


def section(tables: tuple[tuple[str, str, str], ...]) -> dict[str, pd.DataFrame | str]:
    """Each kept table of ``tables`` in compact form, by its heading; "not run" where it is not there."""
    found: dict[str, pd.DataFrame | str] = {}
    for heading, name, chapter in tables:
        table = page_table(name)
        found[f"{heading} ({chapter})"] = (f"{NOT_RUN}: {chapter} keeps results/live/pages/{name}.csv" if table is None
                                           else compact(table))
    return found


def serving() -> dict[str, pd.DataFrame | str]:
    """The serving chapters' tables: decode tokens/s per variant, TTFT, TPOT and ITL under load."""
    return section(SERVING_TABLES)


def memory() -> dict[str, pd.DataFrame | str]:
    """The memory chapter's fixes: what each does to the peak, and what it costs."""
    return section(MEMORY_TABLES)


def first_step() -> dict[str, pd.DataFrame | str]:
    """The first step's chapters: compile starts cold and warm, graph breaks, shapes that change."""
    return section(FIRST_STEP_TABLES)
