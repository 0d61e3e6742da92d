"""Repeats until the answer is clear: the order of the variants in each round, when a run looks, and when it stops.

A run times every variant once per *round*. Rounds come in mirrored pairs: a rotation of the variants, then the same
order reversed (A B C, C B A; B C A, A C B; ...), so that after every pair each variant has sat, on average, in the
middle slot (a slot effect that grows or shrinks along the round cancels in every pair), and after ``2 k`` rounds
each of ``k`` variants has sat in every slot equally often.

After the minimum number of rounds, and then after every pair, the run *looks*: it computes every comparison's
interval and verdict (:func:`optlab.core.timing.speed_up`). It stops when every comparison has a
clear answer (faster, slower, same within 2 %), when the next pair of rounds would pass the cap on repeats, or when
it would pass the time budget. A run looks at most ``MAX_LOOKS`` times (looks are spread evenly between the minimum
and the cap when the cap allows more), and every look reads a ``CONFIDENCE`` interval, so the chance that any look
of an A/A comparison says "faster" or "slower" is at most ``ERROR_RATE`` (Bonferroni), however the looks fall.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pandas as pd

from . import shutdown
from .summary import paired_epoch_times
from .timing import CLEAR, MAX_LOOKS, speed_up


def visit_order(labels: list[str], round_index: int) -> list[str]:
    """The order in which round ``round_index`` visits the variants: rounds 2j and 2j + 1 are the list rotated by j
    and that order reversed (A B, B A, B A, A B; A B C, C B A, B C A, A C B, C A B, B A C)."""
    if not labels:
        return []
    shift = (round_index // 2) % len(labels)
    order = labels[shift:] + labels[:shift]
    return order[::-1] if round_index % 2 else order


def look_points(min_repeats: int, max_repeats: int, max_looks: int = MAX_LOOKS) -> list[int]:
    """The repeat counts after which a run looks: the minimum, then every second repeat up to the cap, thinned to at
    most ``max_looks`` evenly spread looks (the last one at the cap)."""
    if max_repeats < min_repeats:
        raise ValueError(f"the cap on repeats ({max_repeats}) is below the minimum ({min_repeats})")
    points = list(range(min_repeats, max_repeats + 1, 2))
    if points[-1] != max_repeats:
        points.append(max_repeats)
    if len(points) <= max_looks:
        return points
    picks = [round(i * (len(points) - 1) / (max_looks - 1)) for i in range(max_looks)]
    return [points[i] for i in picks]


def pair_verdicts(samples: pd.DataFrame, comparisons: dict[str, str], phases: "tuple[str, ...] | list[str]") -> dict:
    """The verdict of every ``variant -> reference`` comparison in ``phases`` (per model), from tidy samples so far:
    ``{(model, phase, variant): verdict}``; comparisons with a failed side are left out."""
    verdicts = {}
    ok = samples[(samples["status"] == "ok") & samples["phase"].isin(phases)] if not samples.empty else samples
    for (model, phase), group in ok.groupby(["model", "phase"], sort=False):
        runs = dict(tuple(group.groupby("variant")))
        for variant, reference in comparisons.items():
            if variant in runs and reference in runs:
                result = speed_up(*paired_epoch_times(runs[reference], runs[variant]))
                verdicts[(model, phase, variant)] = result.verdict
    return verdicts


def all_clear(verdicts: Iterable[str]) -> bool:
    """Whether every verdict is one of the answers that end a run: faster, slower, same within 2 %."""
    return all(verdict in CLEAR for verdict in verdicts)


@dataclass
class StoppingRule:
    """When a run of rounds stops: ``min_repeats`` always, more in pairs while an answer is unclear, at most
    ``max_repeats``, and no new pair once ``time_budget_s`` would be passed. ``comparisons`` maps each variant to
    its reference, waited for in ``phases``. ``deadline`` (on :func:`optlab.core.shutdown.now`'s clock) is hard: no
    round starts that would end past it, the minimum of repeats notwithstanding."""

    min_repeats: int
    max_repeats: int
    time_budget_s: float = math.inf
    comparisons: dict[str, str] = field(default_factory=dict)
    phases: tuple[str, ...] = ("train", "test")
    deadline: float = math.inf
    past_deadline: bool = field(init=False, default=False)
    _mark: float = field(init=False, default=0.0)  # the deadline clock at the last round's end
    _longest: float = field(init=False, default=0.0)  # the longest round so far, on that clock
    looks: list[int] = field(init=False)
    _started: float = field(init=False, default=0.0)
    _round_s: list[float] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.looks = look_points(self.min_repeats, self.max_repeats)

    def start(self) -> None:
        self._started, self._round_s = time.perf_counter(), []
        self._mark, self._longest = shutdown.now(), 0.0

    def round_done(self, seconds: float) -> None:
        """Record how long a timed round took (the budget's forecast of the next ones)."""
        self._round_s.append(seconds)

    def stop_after(self, repeats: int, rows: list[dict[str, Any]]) -> bool:
        """Whether the run stops after ``repeats`` timed rounds with these sample ``rows``."""
        return self.stop_on(repeats, lambda: self.settled(rows))

    def stop_on(self, repeats: int, settled: Callable[[], bool]) -> bool:
        """The rule itself: never before the minimum, always at the cap, and at every look in between when
        ``settled()`` (every comparison has a clear answer) or when the rounds up to the next look would not fit in the
        time budget; and after any round once the next would end past the deadline."""
        now = shutdown.now()
        self._longest, self._mark = max(self._longest, now - self._mark), now
        if now + self._longest > self.deadline:
            self.past_deadline = True
            return True
        if repeats < self.min_repeats:
            return False
        if repeats >= self.max_repeats:
            return True
        if repeats not in self.looks:
            return False
        if settled():
            return True
        next_look = min(point for point in self.looks if point > repeats)
        forecast = (next_look - repeats) * max(self._round_s, default=0.0)
        return time.perf_counter() - self._started + forecast > self.time_budget_s

    def settled(self, rows: list[dict[str, Any]]) -> bool:
        """Every comparison has a clear answer (failed variants have none to wait for)."""
        return all_clear(pair_verdicts(pd.DataFrame(rows), self.comparisons, self.phases).values())
