"""Figures others published for the transformer track's techniques, as data with their sources: what THEY measured,
on their hardware (modded-nanogpt's records, torchao's float8 training), to set beside ours, never mixed with them."""
from __future__ import annotations

from importlib import resources

import pandas as pd

from ..errors import OptlabError

COLUMNS = ["source", "claim", "hardware", "before", "after", "unit", "url"]
TIME_UNIT = "minutes"  # a unit starting with it is a time (lower is better); any other is a rate (higher is better)
FIGURES = "published_transformer_figures.csv"  # under optlab/resources


def published_figures(name: str | None = None) -> pd.DataFrame:
    """The published figures (``COLUMNS``) of ``name`` (a file under ``optlab/resources``; default ``FIGURES``)
    and the speed-up each claims: before / after for a time, after / before for a rate."""
    name = name or FIGURES
    with resources.files("optlab.resources").joinpath(name).open() as handle:
        table = pd.read_csv(handle)
    missing = [column for column in COLUMNS if column not in table]
    if missing:
        raise OptlabError(f"{name}: missing columns {missing}; a published figure has {COLUMNS}")
    if not ((table["before"] > 0) & (table["after"] > 0)).all():
        raise OptlabError(f"{name}: every before and after must be a positive number")
    time = table["unit"].str.startswith(TIME_UNIT)
    speedup = (table["before"] / table["after"]).where(time, table["after"] / table["before"])
    return table[COLUMNS].assign(**{"speed-up (as published)": speedup})
