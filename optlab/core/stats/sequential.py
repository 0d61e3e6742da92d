"""Repeats until the answer is clear: the order of the variants in each round, when a run looks, at what level, and
when it stops.

A run times every variant once per *round*. Rounds come in mirrored pairs: a rotation of the variants, then the same
order reversed (A B C, C B A; B C A, A C B; ...), so that after every pair each variant has sat, on average, in the
middle slot (a slot effect that grows or shrinks along the round cancels in every pair), and after ``2 k`` rounds
each of ``k`` variants has sat in every slot equally often.

After the minimum number of rounds, and then after every pair, the run *looks*: it computes the interval and verdict
(:func:`optlab.core.measuring.timing.speed_up`) of every comparison still open. A comparison whose answer is clear (faster,
slower, same within 2 %) is *answered* and closed there: it keeps that look's verdict, interval and rounds. From
``FUTILE_AFTER`` rounds on, a comparison that even twice the rounds the budget has left could not answer
(:func:`optlab.core.measuring.timing.out_of_reach`, on the round noise the trimmed interval sees) is closed too, as *can't tell
yet* at that look, where that lets a variant leave the later rounds and another open comparison (not an A/A control)
could still be answered; otherwise all go on to the end. A variant that no open comparison waits for (as the
variant or as its reference) leaves the later rounds (:meth:`StoppingRule.needed`), so that the rounds left are cheaper
and the budget goes where an answer is still possible. The run stops when every comparison is closed, at the hard cap on
rounds, or at the last look that fits the time budget: for cheap comparisons the budget, not the cap, ends the run. How
many looks a run takes is not known in advance, so the error rate is *spent* (:func:`optlab.core.measuring.timing.error_spent`): a
look's share is the error spent by then, less the error spent at the looks before, where "by then" is the share of the
run done (rounds over the cap or seconds over the budget, whichever is further along, and all of it at the last look).
Each look reads its intervals at ``1 - share``; the shares add up to at most ``ERROR_RATE``, so the chance that any look
of an A/A comparison says "faster" or "slower" is at most ``ERROR_RATE``, however many looks the budget allows; a
comparison answered at its first clear look is one of those looks, so answering each comparison where it clears keeps
that bound. A look whose share is below ``SMALLEST_LOOK_ERROR`` reads nothing and keeps its share for the looks after
it.

A variant that fails leaves the rule at once: its comparisons (and those against it) are no longer waited for, and
the others settle as if it had never run.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from ..process import shutdown
from .summary import failed_variants, paired_epoch_times
from ..measuring.timing import CLEAR, CONFIDENCE, SMALLEST_LOOK_ERROR, SpeedUp, error_spent, out_of_reach, speed_up

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


ANSWERED = "answered"  # a comparison closed at a look where its verdict was clear
OUT_OF_REACH = "out of the budget's reach"  # closed where the rounds left could not answer it and others' could
FUTILE_AFTER = 10  # rounds before a comparison may be found out of reach: its noise means something by then


@dataclass(frozen=True)
class Closed:
    """Where a comparison was closed: after how many rounds, at what level, its verdict there, and why
    (:data:`ANSWERED` or :data:`OUT_OF_REACH`)."""

    repeats: int
    confidence: float
    verdict: str
    why: str = ANSWERED


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


def pair_results(samples: pd.DataFrame, comparisons: dict[str, str], phases: "tuple[str, ...] | list[str]",
                 confidence: float = CONFIDENCE) -> dict:
    """The speed-up, interval, verdict and noise of every ``variant -> reference`` comparison in ``phases`` (per
    model), read at ``confidence`` from tidy samples so far: ``{(model, phase, variant): SpeedUp}``. A comparison with
    a side that failed in any phase has left the rule and is left out."""
    results: dict = {}
    if samples.empty:
        return results
    failed = failed_variants(samples)
    ok = samples[(samples["status"] == "ok") & samples["phase"].isin(phases)]
    for (model, phase), group in ok.groupby(["model", "phase"], sort=False):
        runs = dict(tuple(group.groupby("variant")))
        for variant, reference in comparisons.items():
            if (model, variant) in failed or (model, reference) in failed:
                continue
            if variant in runs and reference in runs:
                results[(model, phase, variant)] = speed_up(*paired_epoch_times(runs[reference], runs[variant]),
                                                            confidence=confidence)
    return results


@dataclass
class StoppingRule:
    """When a run of rounds stops: ``min_repeats`` always, more in pairs while a comparison is open, at most
    ``max_repeats`` (a hard cap), and no new pair once ``time_budget_s`` would be passed; every look at its own
    share of the error rate. ``comparisons`` maps each variant to its reference, waited for in ``phases``.
    ``clock`` is where the seconds come from (a simulation passes its own); ``look_every``: rounds between looks.
    ``deadline`` (on :func:`optlab.core.process.shutdown.now`'s clock) is hard: no round starts that would end past it,
    the minimum of repeats notwithstanding. ``controls``: the phases that are A/A controls."""

    min_repeats: int
    max_repeats: int
    time_budget_s: float = math.inf
    comparisons: dict[str, str] = field(default_factory=dict)
    phases: tuple[str, ...] = ("train", "test")
    clock: Callable[[], float] = time.perf_counter
    look_every: int = LOOK_EVERY
    deadline: float = math.inf
    controls: tuple[str, ...] = ()  # A/A control phases: never the comparison within reach that another gives way to
    past_deadline: bool = field(init=False, default=False)
    _mark: float = field(init=False, default=0.0)  # the deadline clock at the last round's end
    _longest: float = field(init=False, default=0.0)  # the longest round so far, on that clock
    looks: list[Look] = field(init=False, default_factory=list)
    _started: float = field(init=False, default=0.0)
    _round_s: list[float] = field(init=False, default_factory=list)
    _spent: float = field(init=False, default=0.0)
    _since: int = field(init=False, default=0)  # the budget's forecast reads the rounds from this one on
    closed: dict[tuple, Closed] = field(init=False, default_factory=dict)  # (model, phase, variant) -> where

    def __post_init__(self) -> None:
        look_points(self.min_repeats, self.max_repeats)  # raises on a cap below the minimum

    def start(self) -> None:
        self._started, self._round_s, self.looks, self._spent = self.clock(), [], [], 0.0
        self._mark, self._longest, self._since, self.closed = shutdown.now(), 0.0, 0, {}

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

    @property
    def read_rounds(self) -> int | None:
        """The rounds of the last look that read its intervals (None before any): a run stopped at its deadline after
        more rounds reads its open comparisons there, at that look's level, so that no read goes unspent."""
        read = [look.repeats for look in self.looks if look.reads]
        return read[-1] if read else None

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
        """Whether the run stops after ``repeats`` timed rounds with these sample ``rows``; a look that reads closes
        the comparisons it answers and, before the last look, those out of reach while others are not
        (:meth:`close`)."""
        frame = pd.DataFrame(rows)

        def settled(confidence: float) -> bool:
            results = pair_results(frame, self.comparisons, self.phases, confidence)
            self.close({key: result for key, result in results.items() if key not in self.closed}, repeats,
                       confidence)
            return all(key in self.closed for key in results)

        return self.stop_on(repeats, settled, lambda: self.waits_for(rows))

    def close(self, open_results: dict[tuple, SpeedUp], repeats: int, confidence: float) -> None:
        """Close the open comparisons whose verdict is clear at this look (answered), and, before the last look and
        after :data:`FUTILE_AFTER` rounds, those that even the rounds left could not answer
        (:func:`optlab.core.measuring.timing.out_of_reach` of their :attr:`SpeedUp.scale` at :meth:`rounds_possible`), where
        closing them lets a variant leave the later rounds (:meth:`freeing`) and another open comparison, not an A/A
        control, could still be answered: those leave the rounds to it. Otherwise all stay to the end, and their
        intervals narrow with every round."""
        for key, result in open_results.items():
            if result.verdict in CLEAR:
                self.closed[key] = Closed(repeats, confidence, result.verdict)
        still = {key: result for key, result in open_results.items() if key not in self.closed}
        if repeats < FUTILE_AFTER or (self.looks and self.looks[-1].final):
            return
        possible = self.rounds_possible(repeats)
        beyond = {key for key, result in still.items() if out_of_reach(result.ratio, result.scale, repeats, possible)}
        if not any(key not in beyond and key[1] not in self.controls for key in still):
            return
        for key in self.freeing(beyond, set(still)):
            self.closed[key] = Closed(repeats, confidence, still[key].verdict, OUT_OF_REACH)

    def freeing(self, beyond: set[tuple], still: set[tuple]) -> set[tuple]:
        """The comparisons of ``beyond`` whose closing lets a variant leave the later rounds: closed together, each
        leaves its variant or its reference needed by no comparison of ``still`` that stays open (a variant runs every
        phase of a round, so a claim out of reach in training frees nothing while its test phase is open)."""
        closing = set(beyond)
        while True:
            staying = still - closing
            needed = {label for key in staying for label in (key[2], self.comparisons[key[2]])}
            freeing = {key for key in closing if {key[2], self.comparisons[key[2]]} - needed}
            if freeing == closing:
                return closing
            closing = freeing

    def rounds_possible(self, repeats: int) -> float:
        """The most rounds an open comparison could still reach: those done and twice the rounds the budget has left
        at the forecast round (rounds grow cheaper as variants leave), at most the cap."""
        left = float(self.max_repeats - repeats)
        forecast = self._forecast_round_s()
        if math.isfinite(self.time_budget_s) and forecast > 0:
            left = min(left, max(0.0, self.time_budget_s - (self.clock() - self._started)) / forecast)
        return min(float(self.max_repeats), repeats + 2 * left)

    def stop_on(self, repeats: int, settled: Callable[[float], bool],
                waiting: Callable[[], bool] = lambda: True) -> bool:
        """The rule itself: never before the minimum, always at the last look (the cap, or the last that fits the
        budget), and at every look in between that reads when ``settled(confidence)`` (every comparison is closed,
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
        return bool(pair_results(pd.DataFrame(rows), self.comparisons, self.phases))

    def open_comparisons(self, rows: list[dict[str, Any]]) -> list[tuple]:
        """The comparisons still in the rule and not yet closed: ``(model, phase, variant)`` each."""
        return [key for key in pair_results(pd.DataFrame(rows), self.comparisons, self.phases)
                if key not in self.closed]

    def needed(self, rows: list[dict[str, Any]]) -> set[str]:
        """The variants an open comparison still waits for: its variant and its reference."""
        return {label for _, _, variant in self.open_comparisons(rows)
                for label in (variant, self.comparisons[variant])}

    def record(self) -> dict[str, Any]:
        """What the record keeps of the looks: each look's rounds and level, the level the comparisons still open at
        the end were read at, and where each other comparison was closed (phase, variant, rounds, level, verdict,
        why)."""
        return {"looks": [[look.repeats, None if not look.reads else round(look.confidence, 10)]
                          for look in self.looks],
                "read_at": self.confidence,
                "closed": [[phase, variant, closed.repeats, round(closed.confidence, 10), closed.verdict, closed.why]
                           for (_, phase, variant), closed in self.closed.items()]}
