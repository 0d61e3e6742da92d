"""What both tunes return: the steps tried, the comparisons' samples and summaries, the kept steps, the recommended
configuration with its speed-up measured afresh against the starting point, and the lines of code that make it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from ...core.knobs.config import RunConfig
from ...core.errors import OptlabError
from ...core.measuring.timing import FASTER, INTERVAL, interval_text
from .batch_sweep import OUT_OF_MEMORY

START = "starting point"
FINAL = "recommended"
AFRESH = "all kept steps, against the starting point"
NOTHING_KEPT = "no step was kept, so none is timed afresh"  # on the progress bar, which skips that comparison
FAILED, NOT_DECIDED = "failed", "not decided"  # a step's decision where it, or the configuration before it, failed


@dataclass(kw_only=True)
class Recommendation:
    """One row per step (``steps``), the tidy samples and summaries of every comparison (as ``run_experiment`` gives
    them, with a ``comparison`` column naming the step tried), the kept steps, the starting point and the recommended
    configuration, its speed-up over the starting point measured afresh with its interval and verdict, the lines of
    code (``code``) and the record."""

    model: str
    steps: pd.DataFrame
    samples: pd.DataFrame
    summary: pd.DataFrame
    kept: list[str]
    start: RunConfig
    recommended: RunConfig
    speedup: float
    ci_low: float
    ci_high: float
    verdict: str
    code: list[str]
    record: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def speedups(self) -> pd.DataFrame:
        """One row per measured step (its speed-up over the configuration before it), then the kept steps measured
        afresh against the starting point: ``model``, ``step``, ``speedup``, ``ci_low``, ``ci_high``, ``verdict``."""
        columns = ["step", "speedup", "ci_low", "ci_high", "verdict"]
        rows = self.steps.loc[self.steps["speedup"].notna(), columns]
        if self.kept:
            rows = pd.concat([rows, pd.DataFrame([[AFRESH, self.speedup, self.ci_low, self.ci_high, self.verdict]],
                                                 columns=columns)], ignore_index=True)
        return rows.assign(model=self.model)[["model", *columns]].reset_index(drop=True)

    def headline(self, nothing_kept: str, more: str) -> str:
        """The recommendation in one sentence, worded for one kept step or several: ``nothing_kept`` when no step
        was kept; ``more`` says what would confirm a recommendation that measured afresh was not clearly faster."""
        if not self.kept:
            return nothing_kept
        steps, interval = ", ".join(self.kept), f"{INTERVAL} {interval_text(self.ci_low, self.ci_high)}"
        several = len(self.kept) > 1
        together = ", all together" if several else ""
        if self.verdict == FASTER:
            return (f"recommendation: {steps}: {self.speedup:.2f}x faster than the starting point ({interval}; "
                    f"measured afresh{together})")
        looked = ("each looked faster than the step before" if several else
                  "looked faster than the configuration before it")
        return (f"recommendation, not confirmed: {steps} {looked}, but measured afresh{together}, against the starting "
                f"point: {self.speedup:.2f}x ({interval}): {self.verdict}. {more}")

    def code_block(self, heading: str) -> list[str]:
        """``heading``, then the lines of code, indented by four spaces as a block (empty without lines)."""
        return [heading, *(f"    {line}" for line in self.code)] if self.code else []


def json_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-safe rows: NaN and infinities become null."""
    return json.loads(frame.to_json(orient="records")) if not frame.empty else []


def recommendation_record(result: Recommendation, knobs: Callable[[RunConfig], dict[str, Any]],
                          **fields: Any) -> dict[str, Any]:
    """What both tunes' records hold: ``fields`` first (schema, title, environment, ...), then the starting point and
    the recommended configuration (as ``knobs`` reads them), the kept steps, the speed-up, the code, the steps, the
    samples and the summary."""
    return {
        **fields,
        "start": knobs(result.start),
        "recommended": knobs(result.recommended),
        "kept": result.kept,
        "speedup": {"ratio": result.speedup, "ci_low": result.ci_low, "ci_high": result.ci_high,
                    "verdict": result.verdict},
        "code": result.code,
        "steps": json_rows(result.steps),
        "samples": json_rows(result.samples),
        "summary": json_rows(result.summary),
    }


def decision_before_the_check(verdict: str, before_failed: str, after_failed: str) -> tuple[str, str] | None:
    """A step's decision and why, where it is settled before its outputs or losses are checked: the configuration
    before it failed, the step failed, or it was not faster; None when the check decides."""
    if before_failed:
        return NOT_DECIDED, f"the configuration before it failed: {before_failed}"
    if after_failed:
        return FAILED, after_failed
    if verdict != FASTER:
        return "not kept", ""
    return None


class NothingRecommended(OptlabError):
    """A tune in which every step that was measured failed: it recommends nothing. ``result`` holds its steps and
    samples, the failures among them."""

    def __init__(self, message: str, result: Recommendation) -> None:
        super().__init__(message)
        self.result = result


def check_something_measured(result: Recommendation, batch: int) -> None:
    """Raise :class:`NothingRecommended` where every measured step of ``result`` failed or was not decided (its
    configuration before failed), naming each configuration's failure; nothing where a step was decided or none was
    measured."""
    measured = result.steps[result.steps["decision"] != "skipped"]
    if measured.empty or not measured["decision"].isin([FAILED, NOT_DECIDED]).all():
        return
    failed = result.samples[result.samples["status"] != "ok"].drop_duplicates("variant")
    causes = "; ".join(f"{', '.join(group['variant'])}: {status}"
                       for status, group in failed.groupby("status", sort=False))
    advice = (f"; batch {batch} does not fit: pass a smaller batch size (--batch-size)"
              if (failed["status"] == OUT_OF_MEMORY).any() else "")
    raise NothingRecommended(f"every step tried failed, so nothing is recommended ({causes}){advice}", result)
