"""Device-aware step timing and the statistics of a comparison.

On CUDA each step boundary is a CUDA event on the current stream and the clock is read only after a
synchronize; on the CPU it is ``time.perf_counter``. Samples are summarised as ``torch.utils.benchmark`` does:
median and IQR over raw samples, never a lone mean.

A comparison is judged on its repeats, not its steps. The steps within one repeat share that repeat's conditions
(clock, caches, what else the machine runs), so they are not independent draws: resampling them, or the three
repeats as if they were many, gives an interval far narrower than three numbers allow, and about 6 % of A/A
comparisons came out "faster" or "slower" that way. Instead each repeat gives one epoch-equivalent time per
variant; the variants of a repeat ran side by side (their order rotating from repeat to repeat), so each repeat
gives one paired ratio, and the interval is Student's t on the logs of those ratios, with n - 1 degrees of freedom.
The verdict asks for a 99.5 % interval that excludes 1 and a speed-up beyond 2 %: about 0.5 % of A/A comparisons
pass the first test by chance under normal noise (a 99 % interval gave 1.0-1.3 % in simulation, too close to the 1 %
target), and fewer under the heavier tails of real timings. ``benchmarks/bench.py`` measures the live
A/A rate and ``tests/test_timing.py`` bounds it over simulated noise.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

MIN_EFFECT = 0.02  # run-to-run variance floor (MLPerf sees about +-2.5 %): the band of no practical difference
CONFIDENCE = 0.995  # of the interval the verdict reads: about 0.5 % of A/A comparisons exclude 1 by chance
FASTER, SLOWER = "faster", "slower"
SAME = "same within 2 %"  # the whole interval inside the band of no practical difference
UNCLEAR = "can't tell yet"  # neither: more repeats would be needed to say
VERDICTS = (FASTER, SLOWER, SAME, UNCLEAR)


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
    confidence: float = CONFIDENCE,
    min_effect: float = MIN_EFFECT,
) -> SpeedUp:
    """Speed-up of ``optimized`` over ``baseline`` from their epoch-equivalent times, paired by repeat.

    Repeat ``r`` of both ran side by side (interleaved), so drift between repeats cancels in the per-repeat ratio.
    The speed-up is the geometric mean of those ratios, and its interval is a Student t interval on their logs with
    n - 1 degrees of freedom: as wide as n numbers allow, however many steps each repeat timed. With fewer than two
    pairs there is no interval, and the verdict is "can't tell yet".
    """
    baseline_s, optimized_s = np.asarray(baseline_s, dtype=float), np.asarray(optimized_s, dtype=float)
    if baseline_s.shape != optimized_s.shape:
        raise ValueError(f"paired repeats needed: {baseline_s.size} baseline and {optimized_s.size} optimized times")
    log_ratios = np.log(baseline_s) - np.log(optimized_s)
    n = log_ratios.size
    if n == 0:
        return SpeedUp(float("nan"), float("nan"), float("nan"), UNCLEAR)
    ratio = float(np.exp(log_ratios.mean()))
    if n < 2:
        return SpeedUp(ratio, float("nan"), float("nan"), UNCLEAR)
    half_width = t_quantile((1 + confidence) / 2, n - 1) * log_ratios.std(ddof=1) / math.sqrt(n)
    low, high = float(np.exp(log_ratios.mean() - half_width)), float(np.exp(log_ratios.mean() + half_width))
    return SpeedUp(ratio, low, high, verdict(ratio, low, high, min_effect))


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
