"""Repeats until the answer is clear: the order of the variants in each round, when a run looks, at what level, and
when it stops.

A run times every variant once per *round*. Rounds come in mirrored pairs: a rotation of the variants, then the same
order reversed (A B C, C B A; B C A, A C B; ...), so that after every pair each variant has sat, on average, in the
middle slot (a slot effect that grows or shrinks along the round cancels in every pair), and after ``2 k`` rounds
each of ``k`` variants has sat in every slot equally often.

After the minimum number of rounds, and then after every pair, the run *looks*: it computes the interval and verdict
(:func:`optlab.core.timing.speed_up`) of every comparison not yet answered. A comparison whose answer is clear (faster,
slower, same within 2 %) is *answered* there: it keeps that look's verdict, interval and rounds, and a variant that no
comparison still waits for (as the variant or as its reference) leaves the later rounds (:meth:`StoppingRule.needed`),
so that the rounds left are cheaper and the budget goes where an answer is still missing. The run stops when every
comparison is answered, at the hard cap on rounds, or at the last look that fits the time budget: for cheap comparisons
the budget, not the cap, ends the run. How many looks a run takes is not known in advance, so the error rate is *spent*
(:func:`optlab.core.timing.error_spent`): a look's share is the error spent by then, less the error spent at the looks
before, where "by then" is the share of the run done (rounds over the cap or seconds over the budget, whichever is
further along, and all of it at the last look). Each look reads its intervals at ``1 - share``; the shares add up to at
most ``ERROR_RATE``, so the chance that any look of an A/A comparison says "faster" or "slower" is at most
``ERROR_RATE``, however many looks the budget allows; a comparison answered at its first clear look is one of those
looks, so answering each comparison where it clears keeps that bound. A look whose share is below
``SMALLEST_LOOK_ERROR`` reads nothing and keeps its share for the looks after it.

A variant that fails leaves the rule at once: its comparisons (and those against it) are no longer waited for, and
the others settle as if it had never run.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from . import shutdown
from .summary import failed_variants, paired_epoch_times
from .timing import CLEAR, CONFIDENCE, SMALLEST_LOOK_ERROR, error_spent, speed_up

LOOK_EVERY = 2  # rounds between looks: one mirrored pair


def visit_order(labels: list[str], round_index: int) -> list[str]:
    """The order in which round ``round_index`` visits the variants: rounds 2j and 2j + 1 are the list rotated by j
    and that order reversed (A B, B A, B A, A B; A B C, C B A, B C A, A C B, C A B, B A C)."""
    if not labels:
        return []
    shift = (round_index // 2) % len(labels)
    order = labels[shift:] + labels[:shift]
    return order[::-1] if round_index % 2 else order


def look_points(min_repeats: int, max_repeats: int) -> list[int]:
    """The repeat counts after which a run may look: the minimum, then every second repeat, and the cap."""
    if max_repeats < min_repeats:
        raise ValueError(f"the cap on repeats ({max_repeats}) is below the minimum ({min_repeats})")
    points = list(range(min_repeats, max_repeats + 1, LOOK_EVERY))
    return points if points[-1] == max_repeats else points + [max_repeats]


@dataclass(frozen=True)
class Answer:
    """Where a comparison was answered: after how many rounds, at what level, and its verdict there."""

    repeats: int
    confidence: float
    verdict: str


@dataclass(frozen=True)
class Look:
    """One look of a run: after how many rounds, how far along the run was (1 at its last look), whether it was the
    last, and the level of its intervals (``1 - its share of the error rate``; NaN for a look too early to read)."""

    repeats: int
    fraction: float
    final: bool
    confidence: float

    @property
    def reads(self) -> bool:
        return not math.isnan(self.confidence)


def pair_verdicts(samples: pd.DataFrame, comparisons: dict[str, str], phases: "tuple[str, ...] | list[str]",
                  confidence: float = CONFIDENCE) -> dict:
    """The verdict of every ``variant -> reference`` comparison in ``phases`` (per model), read at ``confidence``
    from tidy samples so far: ``{(model, phase, variant): verdict}``. A comparison with a side that failed in any
    phase has left the rule and is left out."""
    verdicts: dict = {}
    if samples.empty:
        return verdicts
    failed = failed_variants(samples)
    ok = samples[(samples["status"] == "ok") & samples["phase"].isin(phases)]
    for (model, phase), group in ok.groupby(["model", "phase"], sort=False):
        runs = dict(tuple(group.groupby("variant")))
        for variant, reference in comparisons.items():
            if (model, variant) in failed or (model, reference) in failed:
                continue
            if variant in runs and reference in runs:
                result = speed_up(*paired_epoch_times(runs[reference], runs[variant]), confidence=confidence)
                verdicts[(model, phase, variant)] = result.verdict
    return verdicts


@dataclass
class StoppingRule:
    """When a run of rounds stops: ``min_repeats`` always, more in pairs while a comparison is unanswered, at most
    ``max_repeats`` (a hard cap), and no new pair once ``time_budget_s`` would be passed; every look at its own
    share of the error rate. ``comparisons`` maps each variant to its reference, waited for in ``phases``.
    ``clock`` is where the seconds come from (a simulation passes its own); ``look_every``: rounds between looks.
    ``deadline`` (on :func:`optlab.core.shutdown.now`'s clock) is hard: no round starts that would end past it,
    the minimum of repeats notwithstanding."""

    min_repeats: int
    max_repeats: int
    time_budget_s: float = math.inf
    comparisons: dict[str, str] = field(default_factory=dict)
    phases: tuple[str, ...] = ("train", "test")
    clock: Callable[[], float] = time.perf_counter
    look_every: int = LOOK_EVERY
    deadline: float = math.inf
    past_deadline: bool = field(init=False, default=False)
    _mark: float = field(init=False, default=0.0)  # the deadline clock at the last round's end
    _longest: float = field(init=False, default=0.0)  # the longest round so far, on that clock
    looks: list[Look] = field(init=False, default_factory=list)
    _started: float = field(init=False, default=0.0)
    _round_s: list[float] = field(init=False, default_factory=list)
    _spent: float = field(init=False, default=0.0)
    _since: int = field(init=False, default=0)  # the budget's forecast reads the rounds from this one on
    answered: dict[tuple, Answer] = field(init=False, default_factory=dict)  # (model, phase, variant) -> its answer

    def __post_init__(self) -> None:
        look_points(self.min_repeats, self.max_repeats)  # raises on a cap below the minimum

    def start(self) -> None:
        self._started, self._round_s, self.looks, self._spent = self.clock(), [], [], 0.0
        self._mark, self._longest, self._since, self.answered = shutdown.now(), 0.0, 0, {}

    def round_done(self, seconds: float) -> None:
        """Record how long a timed round took. The budget's forecast of the next rounds is the longest one after the
        first, whose one-off costs (the CPU's profiled memory step, a first compile) the later rounds do not pay, and
        after the last change of the variants that run (:meth:`variants_left`)."""
        self._round_s.append(seconds)

    def variants_left(self) -> None:
        """Some variants left the rounds: the rounds after this one are cheaper, so the budget's forecast reads those
        only."""
        self._since = len(self._round_s)

    def _forecast_round_s(self) -> float:
        """The seconds of the next round: the longest since the variants last changed, else the longest after the
        first (:meth:`round_done`)."""
        recent = self._round_s[self._since:] if self._since else self._round_s[1:] or self._round_s
        return max(recent or self._round_s, default=0.0)

    @property
    def confidence(self) -> float:
        """The level of the last look that read its intervals: the level the comparisons still open at the end are
        read at."""
        read = [look.confidence for look in self.looks if look.reads]
        return read[-1] if read else CONFIDENCE

    def look(self, repeats: int) -> Look | None:
        """The look after ``repeats`` rounds (None where the run does not look), with its share of the error rate
        spent; call once per round count, in order."""
        if repeats < self.min_repeats or not (repeats == self.max_repeats
                                              or (repeats - self.min_repeats) % self.look_every == 0):
            return None
        elapsed = self.clock() - self._started
        next_look = min(repeats + self.look_every, self.max_repeats)
        forecast = (next_look - repeats) * self._forecast_round_s()
        final = repeats >= self.max_repeats or elapsed + forecast > self.time_budget_s
        fraction = 1.0 if final else min(1.0, max(repeats / self.max_repeats, elapsed / self.time_budget_s))
        share = error_spent(fraction) - self._spent
        confidence = math.nan
        if share >= SMALLEST_LOOK_ERROR:
            self._spent += share
            confidence = 1.0 - share
        self.looks.append(Look(repeats, fraction, final, confidence))
        return self.looks[-1]

    def stop_after(self, repeats: int, rows: list[dict[str, Any]]) -> bool:
        """Whether the run stops after ``repeats`` timed rounds with these sample ``rows``; a look that reads answers
        every comparison whose verdict is clear there (:attr:`answered`)."""
        frame = pd.DataFrame(rows)

        def settled(confidence: float) -> bool:
            verdicts = pair_verdicts(frame, self.comparisons, self.phases, confidence)
            for key, verdict in verdicts.items():
                if key not in self.answered and verdict in CLEAR:
                    self.answered[key] = Answer(repeats, confidence, verdict)
            return all(key in self.answered for key in verdicts)

        return self.stop_on(repeats, settled, lambda: self.waits_for(rows))

    def stop_on(self, repeats: int, settled: Callable[[float], bool],
                waiting: Callable[[], bool] = lambda: True) -> bool:
        """The rule itself: never before the minimum, always at the last look (the cap, or the last that fits the
        budget), and at every look in between that reads when ``settled(confidence)`` (every comparison is answered,
        asked at every look that reads, the last one too); and after any round once the next would end past the
        deadline. A run with no comparison left to wait for (``waiting()`` false, asked at looks only: none timed on
        this device, or every one left the rule) stops at its first look."""
        now = shutdown.now()
        self._longest, self._mark = max(self._longest, now - self._mark), now
        if now + self._longest > self.deadline:
            self.past_deadline = True
            return True
        look = self.look(repeats)
        if look is None:
            return False
        waits = waiting()
        clear = look.reads and waits and settled(look.confidence)
        return look.final or not waits or clear

    def waits_for(self, rows: list[dict[str, Any]]) -> bool:
        """Whether any comparison is still in the rule: both sides timed in these ``rows`` and neither failed."""
        return bool(pair_verdicts(pd.DataFrame(rows), self.comparisons, self.phases))

    def open_comparisons(self, rows: list[dict[str, Any]]) -> list[tuple]:
        """The comparisons still in the rule and not yet answered: ``(model, phase, variant)`` each."""
        return [key for key in pair_verdicts(pd.DataFrame(rows), self.comparisons, self.phases)
                if key not in self.answered]

    def needed(self, rows: list[dict[str, Any]]) -> set[str]:
        """The variants an open comparison still waits for: its variant and its reference."""
        return {label for _, _, variant in self.open_comparisons(rows)
                for label in (variant, self.comparisons[variant])}

    def record(self) -> dict[str, Any]:
        """What the record keeps of the looks: each look's rounds and level, the level the comparisons still open at
        the end were read at, and where each other comparison was answered (phase, variant, rounds, level, verdict)."""
        return {"looks": [[look.repeats, None if not look.reads else round(look.confidence, 10)]
                          for look in self.looks],
                "read_at": self.confidence,
                "answered": [[phase, variant, answer.repeats, round(answer.confidence, 10), answer.verdict]
                             for (_, phase, variant), answer in self.answered.items()]}
