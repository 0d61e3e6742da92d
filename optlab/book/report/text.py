"""Numbers and verdicts as words: significant figures, ratios, a speed-up with its interval, the noise line and what a
verdict means.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import pandas as pd

from ...core.techniques.no_effect import is_no_effect
from ...core.stats.summary import CLAIM, CONTROL
from ...core.measuring.timing import (
    DEPENDENT, ERROR_RATE, INTERVAL, SAME, VERDICTS, dependent_rounds, page_bound, percent, too_wide,
    too_wide_to_tell,
)

COMPARED_WITH = "compared with"
MISSING = "—"


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
    interval too wide to tell anything (:func:`timing.too_wide_to_tell`: it holds 1, and its high end is more than
    ``timing.TOO_WIDE`` times its low end) says so, with the ``rounds`` it had."""
    if pd.isna(speedup):
        return MISSING
    if pd.isna(low) or pd.isna(high) or low == high:  # no interval, or the baseline against itself
        return ratio(speedup)
    if too_wide_to_tell(low, high):
        had = "" if rounds is None or pd.isna(rounds) else f" after {int(rounds)} rounds"
        return f"{ratio(speedup)} (interval too wide to tell{had})"
    return f"{ratio(speedup)} ({ratio(low)}–{ratio(high)})"


def noise_line(summary: pd.DataFrame) -> str:
    """What a run measured and what that lets the rule tell: the round-level noise of its comparisons, how far their
    intervals reach at the rounds they had, and the page's bound on a false verdict (:func:`timing.page_bound`)."""
    compared = summary[summary["verdict"].isin(VERDICTS)] if "verdict" in summary else summary.iloc[0:0]
    if compared.empty or "noise" not in compared or compared["noise"].isna().all():
        return "No comparison on this page has an interval yet."
    noise = 100 * compared["noise"].astype(float)
    count = len(compared)
    return (f"Measured: {count} comparisons, a round's noise (standard deviation of its log speed-up) "
            f"{noise.median():.1f} % median ({noise.min():.1f}-{noise.max():.1f} %), {compared['n'].median():.0f} rounds median. At that, "
            f"{reach_text(compared['ci_low'], compared['ci_high'])}. Each is a {INTERVAL} (at most "
            f"{percent(ERROR_RATE)} of comparisons of a configuration with itself say faster or slower); with {count} "
            f"on this page, the chance that any of them does is at most {percent(page_bound(count))}.")


DISTURBED = ("the intervals are too wide to tell anything, as on a machine disturbed by other work: re-run on a quiet "
             "machine")


def reach_text(lows: pd.Series, highs: pd.Series) -> str:
    """How far a page's intervals reach around their speed-ups: the median interval's half-width, "±3.1 %"; where
    half the intervals that could be read or more are too wide to mean anything (``timing.too_wide``), so that the
    median one may be too (a half-width beyond 100 %), :data:`DISTURBED` instead of a percentage in the hundreds or
    thousands."""
    ends = pd.DataFrame({"low": lows, "high": highs}).astype(float).dropna()
    if ends.empty:
        return "no interval could be read"
    with np.errstate(divide="ignore", invalid="ignore"):
        spreads = (ends["high"] / ends["low"]).fillna(np.inf)  # 0 to infinity: too wide for a float
    if 2 * sum(too_wide(1.0, spread) for spread in spreads) >= len(spreads):
        return DISTURBED
    half = 100 * (np.sqrt(spreads.median()) - 1)
    return (f"an interval reaches about ±{half:.1f} % around its speed-up: differences beyond that are told, and "
            f"\"{SAME}\" needs it under 2 %")


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
