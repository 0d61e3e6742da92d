import time

import numpy as np
import pytest
import torch

from optlab.core.timing import StepTimer, epoch_equivalent, speed_up, summarize, verdict


def test_summary_has_median_iqr_min_n():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.median, s.iqr, s.min, s.n) == (3.0, 2.0, 1.0, 5)
    assert summarize([]).n == 0


def test_cpu_timer_measures_real_time():
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    for _ in range(3):
        time.sleep(0.02)
        timer.mark()
    steps, wall = timer.finish()
    assert len(steps) == 3 and all(s >= 0.019 for s in steps)
    assert wall >= sum(steps) * 0.99


def test_epoch_equivalent_counts_startup_and_every_step():
    assert epoch_equivalent(0.5, [0.1, 0.3], images_per_step=10, epoch_images=100) == pytest.approx(0.5 + 0.2 * 10)


def _repeats(rng, mean, n=5, steps=30, spread=0.03):
    return [(0.01, list(rng.normal(mean, mean * spread, steps))) for _ in range(n)]


def test_clear_speedup_is_faster_with_an_interval_around_it():
    rng = np.random.default_rng(0)
    result = speed_up(_repeats(rng, 0.2), _repeats(rng, 0.1), 100, 100)
    assert result.verdict == "faster"
    assert result.low < result.ratio < result.high and 1.8 < result.ratio < 2.2


def test_clear_slowdown_is_slower():
    rng = np.random.default_rng(1)
    assert speed_up(_repeats(rng, 0.1), _repeats(rng, 0.15), 100, 100).verdict == "slower"


def test_identical_distributions_are_no_clear_difference():
    rng = np.random.default_rng(2)
    result = speed_up(_repeats(rng, 0.1, spread=0.2), _repeats(rng, 0.1, spread=0.2), 100, 100)
    assert result.verdict == "no clear difference" and result.low < 1 < result.high


def test_tiny_but_significant_effect_is_below_the_minimum():
    assert verdict(1.01, 1.005, 1.015) == "no clear difference"
    assert verdict(1.05, 1.03, 1.07) == "faster"
    assert verdict(0.9, 0.85, 0.95) == "slower"


def test_scale_turns_different_batch_sizes_into_epoch_times():
    # same seconds per step, but the optimized side processes twice the images per step: half the epoch time
    rng = np.random.default_rng(3)
    result = speed_up(_repeats(rng, 0.1), _repeats(rng, 0.1), scale_baseline=100, scale_optimized=50)
    assert result.ratio == pytest.approx(2.0, rel=0.05)
