"""Serving figures others published, as data with their sources: what THEY measured, with their model and GPU
(gpt-fast, Hugging Face's static cache, torchao alone and through vLLM), to set beside ours, never mixed with them.
Each row is one number as its source states it; ``speedup`` is ``value`` against ``baseline_setting`` where the
source gives both (a rate: value / baseline's value; a stated speed-up: itself), empty otherwise."""
from __future__ import annotations

from importlib import resources

import pandas as pd

from ...core.errors import OptlabError, choice_error

COLUMNS = ["chapter", "source", "url", "model", "gpu", "setting", "metric", "value", "unit", "baseline_setting",
           "speedup"]
CHAPTERS = ("kv_cache", "quantization", "speculative", "serving")
FIGURES = "published_serving_figures.csv"  # under optlab/resources


def all_figures() -> pd.DataFrame:
    """Every row of ``FIGURES``, its columns and values checked."""
    with resources.files("optlab.resources").joinpath(FIGURES).open() as handle:
        table = pd.read_csv(handle)
    missing = [column for column in COLUMNS if column not in table]
    if missing:
        raise OptlabError(f"{FIGURES}: missing columns {missing}; a published serving figure has {COLUMNS}")
    unknown = sorted(set(table["chapter"]) - set(CHAPTERS))
    if unknown:
        raise OptlabError(f"{FIGURES}: chapters {unknown} are not among {list(CHAPTERS)}")
    if not (table["value"] > 0).all() or (table["speedup"].dropna() <= 0).any():
        raise OptlabError(f"{FIGURES}: every value and speed-up must be a positive number")
    return table[COLUMNS]


def published_serving(chapter: str) -> pd.DataFrame:
    """The published figures of ``chapter`` (one of ``CHAPTERS``), in ``COLUMNS``; empty where none is kept."""
    if chapter not in CHAPTERS:
        raise choice_error("chapter", chapter, CHAPTERS)
    table = all_figures()
    return table[table["chapter"] == chapter].reset_index(drop=True)
