"""Device-aware step timing and the statistics of a comparison.

On CUDA each step boundary is a CUDA event on the current stream and the clock is read only after a
synchronize; on the CPU it is ``time.perf_counter``. Samples are summarised as ``torch.utils.benchmark`` does:
median and IQR over raw samples, never a lone mean.

A comparison is judged on its repeats, not its steps. The steps within one repeat share that repeat's conditions
(clock, caches, what else the machine runs), so they are not independent draws: resampling them gives an interval far
narrower than a few repeats allow. Instead each repeat gives one epoch-equivalent time per variant; the variants of a
repeat ran side by side, so each repeat gives one paired ratio, and the interval is Student's t on the logs of those
ratios, with n - 1 degrees of freedom.

A run looks at its intervals more than once (``optlab.core.sequential`` adds repeats while any answer is unclear), so
each look spends a fixed share of the error rate: ``ERROR_RATE`` split evenly over at most ``MAX_LOOKS`` looks (a
Bonferroni split), which makes every interval a ``CONFIDENCE`` interval. One interval gives four answers:
"faster" or "slower" when it lies wholly on one side of 1 and the speed-up is beyond ``MIN_EFFECT``; "same within
2 %" when it lies wholly inside (1/1.02, 1.02), which is Schuirmann's two one-sided tests for equivalence; "can't
tell yet" otherwise. ``book/methodology.md`` gives the error rates and the power; ``tests/test_sequential.py`` checks
them over simulated noise, and ``benchmarks/bench.py`` measures the live A/A rate.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

MIN_EFFECT = 0.02  # run-to-run variance floor (MLPerf sees about +-2.5 %): the band of no practical difference
ERROR_RATE = 0.005  # two-sided, over all the looks of a run: at most 1 in 200 A/A comparisons says faster or slower
MAX_LOOKS = 5  # a run looks at its intervals at most this often
CONFIDENCE = 1 - ERROR_RATE / MAX_LOOKS  # of every interval a verdict reads: 99.9 %
FASTER, SLOWER = "faster", "slower"
SAME = "same within 2 %"  # the whole interval inside the band of no practical difference
UNCLEAR = "can't tell yet"  # neither: more repeats would be needed to say
VERDICTS = (FASTER, SLOWER, SAME, UNCLEAR)
CLEAR = (FASTER, SLOWER, SAME)  # the answers that end a run's repeats


def percent(fraction: float) -> str:
    """``fraction`` as a percentage with as many digits as it needs and no more: 0.999 -> "99.9 %", 0.995 -> "99.5 %"."""
    return f"{round(100 * fraction, 6):g} %"


INTERVAL = f"{percent(CONFIDENCE)} interval"  # how tables, figures and pages name the interval


class StepTimer:
    """Marks step boundaries; ``finish`` returns the per-step seconds and the wall time of the timed span."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list = []
        self._marks: list[float] = []
        self._wall_start = 0.0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._wall_start = time.perf_counter()
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        else:
            self._marks.append(time.perf_counter())

    def finish(self) -> tuple[list[float], float]:
        if self.cuda:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self._wall_start
            steps = [a.elapsed_time(b) / 1e3 for a, b in zip(self._events, self._events[1:])]
        else:
            wall = time.perf_counter() - self._wall_start
            steps = list(np.diff(self._marks))
        return [float(s) for s in steps], wall


@dataclass(frozen=True)
class Summary:
    """Median, interquartile range, minimum and count of a set of samples."""

    median: float
    iqr: float
    min: float
    n: int


def summarize(samples: "list[float] | np.ndarray") -> Summary:
    values = np.asarray(samples, dtype=float)
    if values.size == 0:
        return Summary(float("nan"), float("nan"), float("nan"), 0)
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return Summary(float(median), float(q3 - q1), float(values.min()), int(values.size))


def epoch_equivalent(startup_s: float, step_times: "list[float] | np.ndarray", images_per_step: int, epoch_images: int) -> float:
    """Seconds for one pass over ``epoch_images``: loader start-up plus the mean step time per step.

    The mean, not the median, because an epoch pays for every data stall.
    """
    return float(startup_s + np.mean(step_times) * epoch_images / images_per_step)


@dataclass(frozen=True)
class SpeedUp:
    """baseline time / optimized time over paired repeats, with its interval at ``CONFIDENCE`` and a verdict."""

    ratio: float
    low: float
    high: float
    verdict: str


@functools.lru_cache(maxsize=None)
def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (``probability`` above 0.5).

    The density is integrated on a grid and the quantile read off by interpolation: accurate to about 1e-4, with
    nothing beyond numpy (the GPU reference machine has no scipy).
    """
    if not (0.5 < probability < 1 and df >= 1):
        raise ValueError(f"t_quantile needs 0.5 < probability < 1 and df >= 1, got {probability}, {df}")
    x = np.linspace(0.0, 2000.0 if df == 1 else 200.0, 2_000_001)
    log_density = (math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
                   - (df + 1) / 2 * np.log1p(x * x / df))
    density = np.exp(log_density)
    cdf = 0.5 + np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2 * np.diff(x))])
    return float(np.interp(probability, cdf, x))


def speed_up(
    baseline_s: "list[float] | np.ndarray",
    optimized_s: "list[float] | np.ndarray",
    slot_shifts: "list[float] | np.ndarray | None" = None,
    confidence: float = CONFIDENCE,
    min_effect: float = MIN_EFFECT,
) -> SpeedUp:
    """Speed-up of ``optimized`` over ``baseline`` from their epoch-equivalent times, paired by repeat.

    Repeat ``r`` of both ran side by side (interleaved), so drift between repeats cancels in the per-repeat ratio.
    The speed-up is the geometric mean of those ratios, and its interval is a Student t interval on their logs with
    n - 1 degrees of freedom: as wide as n numbers allow, however many steps each repeat timed. ``slot_shifts`` (how
    many slots later ``optimized`` ran than ``baseline`` in each repeat) lets the interval take out an effect of the
    slot: the log ratio is regressed on the shift, and the speed-up and its interval are those at a shift of 0, with
    n - 2 degrees of freedom (mirrored rounds make the shifts sum to 0, so the point estimate is the same). With fewer
    than two pairs there is no interval, and the verdict is "can't tell yet".
    """
    baseline_s, optimized_s = np.asarray(baseline_s, dtype=float), np.asarray(optimized_s, dtype=float)
    if baseline_s.shape != optimized_s.shape:
        raise ValueError(f"paired repeats needed: {baseline_s.size} baseline and {optimized_s.size} optimized times")
    log_ratios = np.log(baseline_s) - np.log(optimized_s)
    n = log_ratios.size
    if n == 0:
        return SpeedUp(float("nan"), float("nan"), float("nan"), UNCLEAR)
    if n < 2:
        return SpeedUp(float(np.exp(log_ratios.mean())), float("nan"), float("nan"), UNCLEAR)
    centre, standard_error, df = _log_ratio_estimate(log_ratios, slot_shifts)
    half_width = t_quantile((1 + confidence) / 2, df) * standard_error
    ratio = float(np.exp(centre))
    low, high = float(np.exp(centre - half_width)), float(np.exp(centre + half_width))
    return SpeedUp(ratio, low, high, verdict(ratio, low, high, min_effect))


def _log_ratio_estimate(log_ratios: np.ndarray, slot_shifts) -> tuple[float, float, int]:
    """The mean log ratio, its standard error and degrees of freedom; at a slot shift of 0 when the shifts vary
    and leave at least one degree of freedom."""
    n = log_ratios.size
    shifts = None if slot_shifts is None else np.asarray(slot_shifts, dtype=float)
    if shifts is not None and shifts.shape != log_ratios.shape:
        raise ValueError(f"one slot shift per pair needed: {shifts.size} shifts for {n} pairs")
    spread = 0.0 if shifts is None else float(((shifts - shifts.mean()) ** 2).sum())
    if shifts is None or n < 3 or spread == 0.0:
        return float(log_ratios.mean()), float(log_ratios.std(ddof=1) / math.sqrt(n)), n - 1
    slope = float(((shifts - shifts.mean()) * (log_ratios - log_ratios.mean())).sum() / spread)
    intercept = float(log_ratios.mean() - slope * shifts.mean())
    residuals = log_ratios - intercept - slope * shifts
    sigma = math.sqrt(float((residuals ** 2).sum()) / (n - 2))
    return intercept, sigma * math.sqrt(1 / n + shifts.mean() ** 2 / spread), n - 2


def verdict(ratio: float, low: float, high: float, min_effect: float = MIN_EFFECT) -> str:
    """"faster" or "slower" when the whole interval is on one side of 1 and the ratio is beyond ``min_effect``;
    "same within 2 %" when the whole interval lies inside (1/(1 + min_effect), 1 + min_effect); "can't tell yet"
    otherwise."""
    if low > 1.0 and ratio >= 1.0 + min_effect:
        return FASTER
    if high < 1.0 and ratio <= 1.0 - min_effect:
        return SLOWER
    if low > 1.0 / (1.0 + min_effect) and high < 1.0 + min_effect:
        return SAME
    return UNCLEAR
