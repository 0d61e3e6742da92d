"""The median's order-statistic interval: its coverage at its level, its exact ranks, and too few values."""
import math

import numpy as np
import pytest

from optlab.core.stats.order import median_interval


def test_median_interval_covers_at_its_level() -> None:
    rng = np.random.default_rng(1)
    for n in (6, 15, 60):
        covered = [low <= 0 <= high for low, high in (median_interval(rng.standard_normal(n)) for _ in range(2000))]
        assert 0.93 <= np.mean(covered) <= 0.995, (n, np.mean(covered))  # at least 95 %, binomial noise of 2000 draws


def test_the_interval_of_the_median_of_100_is_the_40th_and_61st_values() -> None:
    assert median_interval(np.arange(1.0, 101.0)[::-1]) == pytest.approx((40.0, 61.0))  # tables give 40 and 61


def test_too_few_values_for_the_level_give_nan() -> None:
    assert all(math.isnan(end) for end in median_interval([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)
