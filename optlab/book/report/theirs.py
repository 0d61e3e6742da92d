"""What others measured, on their hardware, as every page shows it: one block per chapter (:func:`published_block`),
apart from the seed's and ours; the sentences that say where the seed and a published figure, or two sources,
disagree; and the one cell per technique that the summary sets beside the seed's."""
from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass

import pandas as pd

from ...core.results.published import published_figures
from ...core.results.seed import seed_speedups
from .tables import LINK, html_table, linked_sources
from .text import number, ratio

SUMMARY_COLUMN = "published, modern GPU"  # the summary's column: what others measured, linked
HEADING = "What they measured, on their hardware (published figures, not ours)"
SEED_APART = 1.25  # a published speed-up this many times above or below the seed's range is said to disagree
SOURCES_APART = 1.5  # two published speed-ups of one chapter this many times apart are said to disagree
SHOWN = ["source", "hardware", "model", "before_setting", "after_setting", "metric", "before", "after", "unit",
         "speed-up"]
DETAILS = ["where", "software", "note"]


@dataclass(frozen=True)
class PublishedBlock:
    """A chapter's published figures: a heading, sentences, and the table (or the sources searched)."""

    chapter: str
    lines: tuple[str, ...]
    table: pd.DataFrame | None

    def _repr_html_(self) -> str:
        text = "".join("<p>" + LINK.sub(r'<a href="\2">\1</a>', html.escape(line, quote=False)) + "</p>"
                       for line in self.lines)
        table = "" if self.table is None else html_table(self.table)
        return f'<div class="optlab-published"><p><strong>{HEADING}</strong></p>{text}{table}</div>'

    def __repr__(self) -> str:
        lines = [HEADING, *(LINK.sub(r"\1 (\2)", line) for line in self.lines)]
        return "\n".join(lines + ([] if self.table is None else [self.table.to_string(index=False)]))


def published_block(chapter: str) -> PublishedBlock:
    """The block every chapter shows beside the seed's numbers: its published figures (measured, then advice) with
    the sentences on disagreements, or, where it has none, the sources searched."""
    rows = published_figures(chapter)
    shown = rows[rows["kind"] != "searched"]
    if shown.empty:
        searched = rows[rows["kind"] == "searched"]
        names = ", ".join(f"[{source}]({url}) ({where})" for source, url, where in
                          zip(searched["source"], searched["url"], searched["where"]))
        line = ("No published figure on a GPU of 2020 or later was found for this chapter"
                + (f"; sources searched: {names}." if names else ", and no search is recorded yet."))
        return PublishedBlock(chapter, (line,), None)
    return PublishedBlock(chapter, tuple(disagreements(chapter, rows)), page_table(shown))


def page_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Published rows as a page shows them: the source a link, the speed-up as published (or "computed" from before
    and after where the source prints none, "—" where neither), where in the source and the rest one click away."""
    speedups = [_speedup_text(printed, value) for printed, value in zip(rows["speedup"], rows["speed-up"])]
    table = linked_sources(rows.assign(**{"speed-up": speedups}))
    table = table.assign(source=[f"{source} (advice only)" if kind == "advice" else source
                                 for source, kind in zip(table["source"], table["kind"])])
    table = table[SHOWN + DETAILS].reset_index(drop=True)
    table.attrs.update(keys=["source", "metric"], details=DETAILS)
    return table


def _speedup_text(printed: str, value: float) -> str:
    if math.isnan(value):
        return ""
    return ratio(value) + ("" if str(printed).strip() not in ("", "nan") else " (computed)")


def disagreements(chapter: str, rows: pd.DataFrame | None = None) -> list[str]:
    """Sentences, from the data: where a published speed-up lies outside the seed's V100 range by more than
    ``SEED_APART``, and where two published speed-ups of the chapter are more than ``SOURCES_APART`` apart."""
    rows = published_figures(chapter) if rows is None else rows
    measured = rows[(rows["kind"] == "measured") & rows["speed-up"].notna()].reset_index(drop=True)
    if measured.empty:
        return []
    lines = []
    seed = seed_speedups(chapter)
    seed = seed[seed["speedup"] != 1.0] if not seed.empty else seed
    if not seed.empty:
        low, high = seed["speedup"].min(), seed["speedup"].max()
        apart = measured[(measured["speed-up"] > high * SEED_APART) | (measured["speed-up"] < low / SEED_APART)]
        if not apart.empty:
            row = apart.loc[(apart["speed-up"] - (low + high) / 2).abs().idxmax()]
            lines.append(f"The seed and the published figures disagree: the seed's V100 speed-ups run from "
                         f"{ratio(low)}x to {ratio(high)}x, while {_figure(row)}; {len(apart)} of {len(measured)} "
                         "published figures lie that far outside the seed's range.")
    low_row, high_row = measured.loc[measured["speed-up"].idxmin()], measured.loc[measured["speed-up"].idxmax()]
    if high_row["speed-up"] > low_row["speed-up"] * SOURCES_APART:
        lines.append(f"The published figures disagree with each other: {_figure(low_row)}, but {_figure(high_row)}; "
                     "their models, sizes and settings differ.")
    return lines


def _figure(row: pd.Series) -> str:
    return (f"[{row['source']}]({row['url']}) gives {ratio(row['speed-up'])}x on {row['hardware']} "
            f"({row['model']}, {row['before_setting'] or 'before'} to {row['after_setting']})")


def summary_cell(chapter: str) -> str:
    """One technique's published figure for the summary, as a link to its source: a speed-up on the fewest GPUs named
    (``[2.63x, 1x A100 80GB](url)``), else a figure without a before (``[3.09 s, 1x A100](url)``); "none found" where
    the chapter has none."""
    rows = published_figures(chapter)
    measured = rows[rows["kind"] == "measured"]
    if measured.empty:
        return "none found"
    order = measured.assign(_gpus=measured["hardware"].map(_gpu_count), _none=measured["speed-up"].isna())
    row = order.sort_values(["_none", "_gpus"], kind="stable").iloc[0]
    figure = (f"{ratio(row['speed-up'])}x" if not math.isnan(row["speed-up"])
              else f"{number(row['after'])} {row['unit']}")
    return f"[{figure}, {row['hardware']}]({row['url']})"


def summary_column(techniques: "pd.Index | list[str]") -> list[str]:
    """:func:`summary_cell` for each entry of ``techniques`` (a table's technique level), one read per technique."""
    cells = {name: summary_cell(name) for name in dict.fromkeys(techniques)}
    return [cells[name] for name in techniques]


def _gpu_count(hardware: str) -> float:
    """GPUs a row names ("8x A100", "272 GPUs"); unnamed counts last."""
    count = re.match(r"(\d+)x ", hardware) or re.match(r"(\d+) GPUs", hardware)
    return int(count.group(1)) if count else math.inf
