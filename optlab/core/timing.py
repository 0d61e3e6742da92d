"""Device-aware step timing and the statistics of a comparison.

On CUDA each step boundary is a CUDA event on the current stream and the clock is read only after a
synchronize; on the CPU it is ``time.perf_counter``. The statistics follow ``torch.utils.benchmark``:
median and IQR over raw samples, never a lone mean.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

MIN_EFFECT = 0.02  # run-to-run variance floor (MLPerf sees about +-2.5 %): smaller speed-ups are "no clear difference"
VERDICTS = ("faster", "slower", "no clear difference")


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
    """baseline time / optimized time, with a bootstrap 95 % interval and a verdict."""

    ratio: float
    low: float
    high: float
    verdict: str


def _resampled_epoch_times(rng: np.random.Generator, repeats: list[tuple[float, np.ndarray]], draws: int, scale: float) -> np.ndarray:
    """Hierarchical bootstrap: resample the repeats, then the steps within each, and take the median epoch time."""
    n = len(repeats)
    picks = rng.integers(0, n, size=(draws, n))
    per_repeat = np.empty((draws, n))
    for column in range(n):
        for index, (startup, steps) in enumerate(repeats):
            rows = picks[:, column] == index
            count = int(rows.sum())
            if count:
                resampled = steps[rng.integers(0, len(steps), size=(count, len(steps)))]
                per_repeat[rows, column] = startup + resampled.mean(axis=1) * scale
    return np.median(per_repeat, axis=1)


def speed_up(
    baseline: list[tuple[float, list[float]]],
    optimized: list[tuple[float, list[float]]],
    scale_baseline: float,
    scale_optimized: float,
    draws: int = 2000,
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
) -> SpeedUp:
    """Speed-up of ``optimized`` over ``baseline`` from their repeats, each ``(startup_s, step_times)``.

    ``scale_*`` is steps per epoch, so each repeat becomes an epoch-equivalent time. The verdict is "faster" or
    "slower" only when the whole 95 % interval is on one side of 1 and the ratio is beyond ``min_effect``.
    """
    def median_epoch(repeats, scale):
        return float(np.median([s + np.mean(t) * scale for s, t in repeats]))

    ratio = median_epoch(baseline, scale_baseline) / median_epoch(optimized, scale_optimized)
    rng = np.random.default_rng(seed)
    as_arrays = lambda repeats: [(float(s), np.asarray(t, dtype=float)) for s, t in repeats]  # noqa: E731
    boot = _resampled_epoch_times(rng, as_arrays(baseline), draws, scale_baseline) / _resampled_epoch_times(
        rng, as_arrays(optimized), draws, scale_optimized
    )
    low, high = (float(x) for x in np.percentile(boot, [2.5, 97.5]))
    return SpeedUp(ratio, low, high, verdict(ratio, low, high, min_effect))


def verdict(ratio: float, low: float, high: float, min_effect: float = MIN_EFFECT) -> str:
    """"faster", "slower" or "no clear difference" for a speed-up and its interval."""
    if low > 1.0 and ratio >= 1.0 + min_effect:
        return "faster"
    if high < 1.0 and ratio <= 1.0 - min_effect:
        return "slower"
    return "no clear difference"
