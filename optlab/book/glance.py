"""The summary page at a glance: a compact matrix of technique by model (each speed-up coloured by its verdict, the
seed's V100 figure beside), and the serving, memory and first-step results the chapters keep as tables.

Serving, memory and first-step chapters keep their tables under ``results/live/pages/`` (``chapter.downloads``); their
formats change as those chapters grow, so each is read by the columns it has: the labels (text columns) and the
figures whose names say what they are (tokens/s, TTFT, TPOT, ITL, peak, saved, compile seconds, graphs). A table that
is not there reads "not run".
"""
from __future__ import annotations

import re

import pandas as pd
from pandas.io.formats.style import Styler

from ..core.measuring.timing import FASTER, SAME, SLOWER
from ..core.results import store
from ..core.stats.summary import CLAIM
from ..core.techniques.registry import REGISTRY
from .downloads import PAGE_RUNS
from .report import SEED, VERDICT_COLOURS
from .summary_page import COLUMNS, seed_rows

TINTS = {FASTER: VERDICT_COLOURS[FASTER], SLOWER: VERDICT_COLOURS[SLOWER], SAME: VERDICT_COLOURS[SAME]}
UNCLEAR_TINT = "#bbbbbb"
TINT_ALPHA = "40"  # a light background: the text stays readable
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


def every_speedup(found: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The seed's rows and every source's rows of every technique (seed, beyond the seed, transformer track), in
    training, or in inference for a technique timed only there."""
    frames = [seed_rows()]
    for name, rows in found.items():
        if rows.empty or "technique" not in rows:
            continue
        phase = rows["technique"].map(lambda t: "train" if t not in REGISTRY or "train" in REGISTRY[t].phases
                                      else "test")
        frames.append(rows[rows["phase"] == phase].assign(source=name).reindex(columns=COLUMNS))
    return pd.concat([f for f in frames if not f.empty], ignore_index=True)


def _cell(speedup: float, seed: float) -> str:
    ours = "—" if pd.isna(speedup) else f"{speedup:.2f}x"
    return ours if pd.isna(seed) else f"{ours} (seed {seed:.2f}x)"


def matrix_frame(tidy: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Technique: variant by model (a block per source of ours; blank where not run): the speed-up text with the
    seed's beside, and each cell's verdict; rows only where some source of ours measured the variant (``tidy``:
    :func:`every_speedup`'s rows)."""
    ours = tidy[(tidy["source"] != SEED) & (tidy["verdict"].fillna("") != "baseline")]
    ours = ours[ours["role"].fillna(CLAIM) == CLAIM].drop_duplicates(["source", "technique", "variant", "model"],
                                                                      keep="last")
    if ours.empty:
        return pd.DataFrame(), pd.DataFrame()
    seed = tidy[tidy["source"] == SEED].set_index(["technique", "variant", "model"])["speedup"]
    seed = seed[~seed.index.duplicated(keep="last")]
    sources = list(dict.fromkeys(ours["source"]))
    ours = ours.assign(row=ours["technique"] + ": " + ours["variant"],
                       column=ours["model"] if len(sources) == 1 else ours["source"] + ": " + ours["model"])
    seeds = [seed.get((t, v, m), float("nan")) for t, v, m in zip(ours["technique"], ours["variant"], ours["model"])]
    ours = ours.assign(text=[_cell(s, z) for s, z in zip(ours["speedup"], seeds)])
    order, columns = list(dict.fromkeys(ours["row"])), list(dict.fromkeys(ours["column"]))  # as the records come
    texts = ours.pivot(index="row", columns="column", values="text").reindex(index=order, columns=columns).fillna("")
    verdicts = ours.pivot(index="row", columns="column", values="verdict").reindex(index=order, columns=columns)
    texts.index.name = verdicts.index.name = "technique: variant"
    return texts, verdicts


def matrix(tidy: pd.DataFrame) -> "Styler | str":
    """:func:`matrix_frame` styled: each cell's background tinted by its verdict (blue faster, orange slower, green
    the same, grey can't tell)."""
    texts, verdicts = matrix_frame(tidy)
    if texts.empty:
        return "no measured speed-ups yet"

    def tint(verdict: object) -> str:
        if pd.isna(verdict):
            return ""
        colour = next((c for v, c in TINTS.items() if str(verdict).startswith(v)), UNCLEAR_TINT)
        return f"background-color: {colour}{TINT_ALPHA}"

    return texts.style.apply(lambda column: [tint(v) for v in verdicts[column.name]], axis=0)


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
