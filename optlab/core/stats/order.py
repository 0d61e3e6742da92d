"""A distribution-free interval for a median, from order statistics: for samples whose distribution is unknown
(latencies, a ceiling's timed blocks)."""
from __future__ import annotations

import math

import numpy as np

MEDIAN_CONFIDENCE = 0.95  # the level of the median's order-statistic interval


def median_interval(values: "np.ndarray | list[float]", confidence: float = MEDIAN_CONFIDENCE) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics ``x(j) <= x(k)`` (1-based, ``k = n + 1 -
    j``) with the largest ``j`` such that the binomial(n, 1/2) count of values below the median lies in ``[j, k - 1]``
    with probability at least ``confidence``. NaN ends when ``n`` is too small for that level (n < 6 at 95 %)."""
    ordered = np.sort(np.asarray(values, dtype=float))
    n = ordered.size
    if n == 0:
        return math.nan, math.nan
    # cdf[i] = P(B <= i) for B ~ binomial(n, 1/2), built from log-binomial terms so that large n does not overflow
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2) for i in range(n + 1)]
    cdf = np.cumsum(np.exp(logs))
    best = 0
    for j in range(1, n // 2 + 1):  # coverage of [x(j), x(n+1-j)] is 1 - 2 P(B <= j - 1)
        if 1 - 2 * cdf[j - 1] >= confidence:
            best = j
    if best == 0:
        return math.nan, math.nan
    return float(ordered[best - 1]), float(ordered[n - best])
