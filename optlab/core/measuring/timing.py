"""Device-aware step timing and the statistics of a comparison.

On CUDA each step boundary is a CUDA event on the current stream and the clock is read only after a
synchronize; on the CPU it is ``time.perf_counter``. Samples are summarised as ``torch.utils.benchmark`` does:
median and IQR over raw samples, never a lone mean.

A comparison is judged on its repeats, not its steps. The steps within one repeat share that repeat's conditions
(clock, caches, what else the machine runs), so they are not independent draws: resampling them gives an interval far
narrower than a few repeats allow. Instead each repeat gives one epoch-equivalent time per variant; the variants of a
repeat ran side by side, so each repeat gives one paired ratio, and the interval is Student's t on the logs of those
ratios (regressed on the slot shift, and from 10 rounds on trimmed: see :func:`log_ratio_fit`).

A run looks at its intervals more than once (``optlab.core.stats.sequential`` adds repeats while any answer is unclear), so
the error rate is spent over the looks (Lan and DeMets' error spending with O'Brien-Fleming-like shape,
:func:`error_spent`): each look reads its interval at its own share of ``ERROR_RATE``, the increase of the spent
error since the last look, so that all the looks of a comparison together hold the true speed-up with probability at
least ``CONFIDENCE`` (a union bound: it holds for any number and timing of looks). That is what ``INTERVAL`` names.
One interval gives four answers: "faster" or "slower" when it lies wholly on one side of 1 and the speed-up is beyond
``MIN_EFFECT``; "same within 2 %" when it lies wholly inside (1/1.02, 1.02), which is Schuirmann's two one-sided tests
for equivalence; "can't tell yet" otherwise. ``book/methodology.md`` gives the error rates and the power;
``tests/test_sequential.py`` checks them over simulated noise, and ``benchmarks/bench.py`` measures the live A/A rate.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

TRIM = 0.1  # the share of rounds cut from each end of the log ratios (Yuen's trimmed mean; none below 10 rounds)
MIN_EFFECT = 0.02  # run-to-run variance floor (MLPerf sees about +-2.5 %): the band of no practical difference
ERROR_RATE = 0.005  # two-sided, over all the looks of a run: at most 1 in 200 A/A comparisons says faster or slower
CONFIDENCE = 1 - ERROR_RATE  # what a comparison's intervals guarantee together, over all its looks: 99.5 %
SMALLEST_LOOK_ERROR = 1e-9  # a look whose share of the error rate is smaller reads no verdict (its share is kept)
DEPENDENT_Z, DEPENDENT_FROM = 2.0, 10  # a lag-1 autocorrelation above 2 / sqrt(rounds), from 10 rounds: dependent
DEPENDENT = ("rounds not independent (lag-1 autocorrelation {autocorrelation:.2f}): the interval assumes they are "
             "and may be too narrow")
REACH_ERRORS = 2.0  # out of reach only if the estimate this many standard errors further its way could not be answered
TOO_WIDE = 4.0  # an interval holding 1 whose high end is this many times its low end reads "too wide", not digits
FASTER, SLOWER = "faster", "slower"
SAME = "same within 2 %"  # the whole interval inside the band of no practical difference
UNCLEAR = "can't tell yet"  # neither: more repeats would be needed to say
VERDICTS = (FASTER, SLOWER, SAME, UNCLEAR)
CLEAR = (FASTER, SLOWER, SAME)  # the answers that end a run's repeats
BAD_TIME = "failed: a time that is not a positive number"  # NaN, infinite, zero or negative: the comparison fails
ZERO_WIDTH = "no spread between rounds: a zero-width interval says nothing"  # why such an interval is not read
ROUNDING = 1e-12  # a spread of log ratios below this is a float's rounding, not timing: no clock resolves 1 part in 1e12
EARLY_STOP_BIAS = ("an estimate read where a run stopped early leans toward the answer it stopped on: in simulation, "
                   "a true 1.05 called faster reads about 1 %, 3.5 % and 6 % high at 5, 8 and 12 % round noise when "
                   "12 rounds fit the budget, and about 0.2 %, 1 % and 2.7 % when 48 do; a speed-up to copy comes "
                   "from a fresh measurement")


def percent(fraction: float) -> str:
    """``fraction`` as a percentage with as many digits as it needs and no more: 0.999 -> "99.9 %", 0.995 -> "99.5 %"."""
    return f"{round(100 * fraction, 6):g} %"


INTERVAL = f"{percent(CONFIDENCE)} sequential interval"  # how tables, figures, records and pages name the interval


TIMES_BESIDE = ("ms before and ms after are each side's own median; the speed-up is the paired estimate over the same "
                "rounds (at a slot shift of 0), so at a few rounds the two can disagree: the speed-up and its interval "
                "are the answer")


def too_wide(low: float, high: float) -> bool:
    """Whether an interval is too wide to mean anything: its high end more than ``TOO_WIDE`` times its low end."""
    return bool(high > TOO_WIDE * low)


def too_wide_to_tell(low: float, high: float) -> bool:
    """Whether an interval is shown as "too wide to tell" instead of its digits: too wide (:func:`too_wide`) and
    holding 1, so that it answers nothing ("can't tell yet"). One wholly above or below 1 answers "faster" or "slower"
    however wide it is, and every table, sentence and figure shows its ends: "too wide to tell" never sits beside an
    answer."""
    return too_wide(low, high) and low <= 1.0 <= high


def interval_text(low: float, high: float, rounds: "int | None" = None) -> str:
    """"1.02-1.10", "" without an interval, or "too wide to tell (N rounds)" (:func:`too_wide_to_tell`)."""
    if math.isnan(low) or math.isnan(high):
        return ""
    if too_wide_to_tell(low, high):
        return "too wide to tell" + ("" if rounds is None else f" ({rounds} rounds)")
    return f"{low:.2f}-{high:.2f}"


def page_bound(comparisons: int) -> float:
    """The chance that any of ``comparisons`` A/A comparisons on one page says "faster" or "slower": at most their
    number times ``ERROR_RATE`` (a union bound: it holds however they depend on each other), and at most 1."""
    return min(1.0, comparisons * ERROR_RATE)


class StepTimer:
    """Marks step boundaries; ``finish`` returns the per-step seconds and the wall time of the timed span. On a CPU,
    the time between ``pause`` and ``resume`` (another variant's step, in a lockstep round) counts in neither."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list = []
        self._marks: list[float] = []
        self._wall_start = 0.0
        self._paused_at: float | None = None
        self._paused_s = 0.0  # CPU: time spent paused so far, left out of every mark and of the wall time

    def pause(self) -> None:
        if not self.cuda:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None

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
            self._marks.append(time.perf_counter() - self._paused_s)

    def finish(self) -> tuple[list[float], float]:
        if self.cuda:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self._wall_start
            steps = [a.elapsed_time(b) / 1e3 for a, b in zip(self._events, self._events[1:])]
        else:
            wall = time.perf_counter() - self._wall_start - self._paused_s
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
    """baseline time / optimized time over paired repeats, with its interval, a verdict, the round-level noise (the
    standard deviation of one round's log ratio about the fit), where the verdict is not read off the interval, why,
    ``scale``: the round noise the trimmed interval sees (its standard error times the square root of the rounds;
    a round hit by other work raises ``noise`` but hardly this), and the lag-1 ``autocorrelation`` of the rounds."""

    ratio: float
    low: float
    high: float
    verdict: str
    noise: float = float("nan")
    reason: str = ""
    scale: float = float("nan")
    autocorrelation: float = float("nan")  # lag-1, of its rounds in the order they ran (:func:`round_autocorrelation`)


@functools.lru_cache(maxsize=None)
def normal_quantile(probability: float) -> float:
    """The ``probability`` quantile of the standard normal (``probability`` above 0.5), by bisection on ``erfc``."""
    if not 0.5 < probability < 1:
        raise ValueError(f"normal_quantile needs 0.5 < probability < 1, got {probability}")
    low, high = 0.0, 40.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if math.erfc(middle / math.sqrt(2)) / 2 > 1 - probability else (low, middle)
    return (low + high) / 2


def error_spent(fraction: float, error_rate: float = ERROR_RATE) -> float:
    """The error rate spent by ``fraction`` (0 to 1) of a run: Lan and DeMets' O'Brien-Fleming-like spending
    function, 2 - 2 Phi(z / sqrt(fraction)) with z the two-sided normal quantile of ``error_rate``. It spends almost
    nothing early, when a few rounds could only tell a huge effect, and all of ``error_rate`` by the end."""
    if fraction <= 0:
        return 0.0
    z = normal_quantile(1 - error_rate / 2)
    return math.erfc(z / math.sqrt(min(fraction, 1.0)) / math.sqrt(2))


def _continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return result


def t_two_sided_tail(t: float, df: float) -> float:
    """P(|T| > t) for Student's t with ``df`` degrees of freedom: the regularized incomplete beta function
    I_x(df/2, 1/2) at x = df / (df + t^2), accurate far into the tail."""
    x = df / (df + t * t)
    a, b = df / 2, 0.5
    if x <= 0.0:
        return 0.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _continued_fraction(a, b, x) / a
    return 1.0 - front * _continued_fraction(b, a, 1 - x) / b


@functools.lru_cache(maxsize=None)
def t_quantile(probability: float, df: float) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (``probability`` above 0.5), by
    bisection on the tail: accurate to about 1e-9 relative, far into the tail, with nothing beyond the standard
    library (the GPU reference machine has no scipy)."""
    if not (0.5 < probability < 1 and df > 0):
        raise ValueError(f"t_quantile needs 0.5 < probability < 1 and df > 0, got {probability}, {df}")
    tail = 2 * (1 - probability)
    low, high = 0.0, 1.0
    while t_two_sided_tail(high, df) > tail:
        low, high = high, 2 * high
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if t_two_sided_tail(middle, df) > tail else (low, middle)
    return (low + high) / 2


def round_leverage(shifts: np.ndarray) -> np.ndarray:
    """Each round's leverage in the least-squares fit of the log ratio on the slot shift: 1/n plus its share of the
    shifts' spread. Mirrored rounds with unequal shifts (8 variants: shifts of 7 and -7 beside rounds of 1 and -1) pin
    the slope to a few rounds of high leverage, whose residuals then look less variable than the rounds are."""
    centred = shifts - shifts.mean()
    return 1 / shifts.size + centred ** 2 / float((centred ** 2).sum())


@functools.lru_cache(maxsize=None)
def slot_fit_df(shifts: tuple[float, ...]) -> float:
    """Bell and McCaffrey's degrees of freedom of the fit's value at a shift of 0, for these slot shifts: the
    Satterthwaite approximation for its leverage-corrected (HC2) standard error, (sum of lambda)^2 / (sum of
    lambda^2) over the eigenvalues lambda of G'G, G = (I - H) diag(a / sqrt(1 - h)) with a the fit's weights at a
    shift of 0 and h the rounds' leverage. It is n - 2 when every round has the same leverage, and less when a few
    rounds pin the slope. A round of leverage 1 (alone at its shift) tells nothing about the noise and is left out."""
    s = np.asarray(shifts, dtype=float)
    n, centred = s.size, s - s.mean()
    spread = float((centred ** 2).sum())
    hat = 1 / n + np.outer(centred, centred) / spread
    weights = 1 / n - s.mean() * centred / spread
    free = 1 - np.diag(hat)
    scaled = np.divide(weights, np.sqrt(np.clip(free, 0.0, None)), out=np.zeros(n), where=free > 1e-12)
    g = (np.eye(n) - hat) * scaled[None, :]
    gram = g.T @ g
    return float(np.trace(gram) ** 2 / (gram ** 2).sum())


def at_shift_zero(logs: np.ndarray, shifts: "np.ndarray | None") -> tuple[np.ndarray, bool]:
    """Each round's log ratio at a slot shift of 0 (less the least-squares slope times its shift, along the last axis)
    and whether a slope was fitted: only where the shifts vary and leave a degree of freedom."""
    n = logs.shape[-1]
    if shifts is not None and shifts.shape != (n,):
        raise ValueError(f"one slot shift per pair needed: {shifts.size} shifts for {n} pairs")
    centred = None if shifts is None else shifts - shifts.mean()
    spread = 0.0 if centred is None else float((centred ** 2).sum())
    if n < 3 or spread == 0.0:
        return logs, False
    slope = ((logs - logs.mean(axis=-1, keepdims=True)) @ centred) / spread
    return logs - slope[..., None] * shifts, True


def round_autocorrelation(log_ratios: np.ndarray, slot_shifts: "np.ndarray | list | None" = None) -> np.ndarray:
    """The lag-1 autocorrelation of a comparison's rounds in the order they ran, along the last axis: of the log
    ratios at a shift of 0, winsorized as the interval's scale is (a round hit by other work counts no more than the
    rounds kept). Near 0 (a little below) for independent rounds; NaN below 3 rounds or with no spread (none beyond
    ``ROUNDING``)."""
    logs = np.asarray(log_ratios, dtype=float)
    n = logs.shape[-1]
    if n < 3:
        return np.full(logs.shape[:-1], np.nan)
    at_zero, _ = at_shift_zero(logs, None if slot_shifts is None else np.asarray(slot_shifts, dtype=float))
    cut = int(TRIM * n) if n >= 10 else 0
    ordered = np.sort(at_zero, axis=-1)
    kept = np.clip(at_zero, ordered[..., cut:cut + 1], ordered[..., n - cut - 1:n - cut])
    deviations = kept - kept.mean(axis=-1, keepdims=True)
    squares = (deviations ** 2).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(squares > n * ROUNDING ** 2, (deviations[..., 1:] * deviations[..., :-1]).sum(axis=-1) / squares,
                        np.nan)


def dependent_rounds(autocorrelation: float, rounds: int) -> bool:
    """Whether a comparison's rounds look dependent: from ``DEPENDENT_FROM`` rounds on, a lag-1 autocorrelation above
    ``DEPENDENT_Z`` / sqrt(rounds) (chosen by simulation: ``book/methodology.md``)."""
    return bool(rounds >= DEPENDENT_FROM and autocorrelation > DEPENDENT_Z / math.sqrt(rounds))


def _ranked_between(values: np.ndarray, low: np.ndarray, high: np.ndarray, first: int, end: int) -> np.ndarray:
    """Which of ``values`` (along the last axis) rank from ``first`` to before ``end`` in a stable sort, where ``low``
    and ``high`` are the sorted values at ``first`` and ``end - 1``, without the sort: the rounds from ``low`` to
    ``high``, and in a row where another round ties with a boundary, each tied round by its place among the ties, as
    a stable argsort ranks it (a row with a NaN has a NaN scale whichever rounds are kept)."""
    rows, low, high = values.reshape(-1, values.shape[-1]), low.reshape(-1, 1), high.reshape(-1, 1)
    inside = (rows >= low) & (rows <= high)
    tied = ((rows == low).sum(axis=-1) > 1) | ((rows == high).sum(axis=-1) > 1)
    if tied.any():
        ties, low, high = rows[tied], low[tied], high[tied]
        rank_low = (ties < low).sum(axis=-1, keepdims=True) + np.cumsum(ties == low, axis=-1) - 1
        rank_high = (ties < high).sum(axis=-1, keepdims=True) + np.cumsum(ties == high, axis=-1) - 1
        inside[tied] = (((ties > low) | ((ties == low) & (rank_low >= first)))
                        & ((ties < high) | ((ties == high) & (rank_high < end))))
    return inside.reshape(values.shape)


def log_ratio_fit(log_ratios: np.ndarray, slot_shifts: "np.ndarray | list | None" = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The log speed-up at a slot shift of 0, its standard error, the round-level noise (the standard deviation of one
    round's log ratio about the fit) and the degrees of freedom, along the last axis of ``log_ratios`` (one row per
    simulated run, or a single run).

    The log ratio is regressed on the slot shift when the shifts vary and leave a degree of freedom. The centre is
    then Yuen's trimmed mean of the rounds at a shift of 0: ``TRIM`` of them cut from each end (none below 10
    rounds), with the standard error of the winsorized rounds and one degree of freedom less for each round cut. A
    round in which one variant was hit by other work moves the centre and the interval no further than the rounds
    kept; with nothing cut it is the least-squares fit (the plain mean where the shifts do not vary).

    Where the rounds' leverage differs (:func:`round_leverage`), each round not cut counts its deviation scaled up by
    sqrt(mean(1 - h) / (1 - h)), as an HC2 standard error does, and the degrees of freedom shrink by Bell and
    McCaffrey's ratio (:func:`slot_fit_df`): with equal leverage (two variants, or whole rotations) both are the
    plain fit's."""
    logs = np.asarray(log_ratios, dtype=float)
    n = logs.shape[-1]
    mean = logs.mean(axis=-1)
    shifts = None if slot_shifts is None else np.asarray(slot_shifts, dtype=float)
    at_zero, fitted = at_shift_zero(logs, shifts)
    spread = float(((shifts - shifts.mean()) ** 2).sum()) if fitted else 0.0
    residuals = at_zero - at_zero.mean(axis=-1, keepdims=True)
    residual_df = n - 1 - int(fitted)
    noise = np.sqrt((residuals ** 2).sum(axis=-1) / residual_df) if residual_df > 0 else np.full_like(mean, np.nan)
    cut = int(TRIM * n) if n >= 10 else 0
    kept = n - 2 * cut
    ordered = np.sort(at_zero, axis=-1)
    centre = ordered[..., cut:n - cut].mean(axis=-1)
    low, high = ordered[..., cut:cut + 1], ordered[..., n - cut - 1:n - cut]
    winsorized = np.clip(at_zero, low, high)
    deviations = winsorized - winsorized.mean(axis=-1, keepdims=True)
    df = float(kept - 1 - int(fitted))
    if fitted:
        free = 1 - round_leverage(shifts)
        inflation = np.sqrt(np.divide(residual_df / n, free, out=np.ones(n), where=free > 1e-12))
        inside = _ranked_between(at_zero, low, high, cut, n - cut)  # every round not cut, the two on the boundary too
        deviations = np.where(inside, deviations * inflation, deviations)
        df *= slot_fit_df(tuple(shifts.tolist())) / residual_df
    scale = (np.sqrt((deviations ** 2).sum(axis=-1) / residual_df) * n / kept if residual_df > 0
             else np.full_like(mean, np.nan))
    leverage = 1 / n + (shifts.mean() ** 2 / spread if fitted else 0.0)
    return centre, scale * math.sqrt(leverage), noise, df


def fit_interval(centre: np.ndarray, standard_error: np.ndarray, df: float, confidence: float = CONFIDENCE
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The speed-up and the low and high ends of its ``confidence`` interval from :func:`log_ratio_fit`'s centre,
    standard error and degrees of freedom. A zero standard error (none beyond ``ROUNDING``: rounds equal up to a float's
    rounding) gives NaN ends; an interval too wide for a float ends at 0 and infinity."""
    half_width = t_quantile((1 + confidence) / 2, df) * np.where(standard_error > ROUNDING, standard_error, np.nan)
    with np.errstate(over="ignore"):
        return np.exp(centre), np.exp(centre - half_width), np.exp(centre + half_width)


def intervals(log_ratios: np.ndarray, slot_shifts: "np.ndarray | list | None" = None,
              confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The speed-up, the low and high ends of its ``confidence`` interval and the round-level noise, along the last
    axis of ``log_ratios`` (at least two pairs). A zero-width interval (no spread at all) has NaN ends; one too wide
    for a float (a look at a few rounds, read at a level near 1) ends at 0 and infinity."""
    centre, standard_error, noise, df = log_ratio_fit(log_ratios, slot_shifts)
    return (*fit_interval(centre, standard_error, df, confidence), noise)


def speed_up(
    baseline_s: "list[float] | np.ndarray",
    optimized_s: "list[float] | np.ndarray",
    slot_shifts: "list[float] | np.ndarray | None" = None,
    confidence: float = CONFIDENCE,
    min_effect: float = MIN_EFFECT,
) -> SpeedUp:
    """Speed-up of ``optimized`` over ``baseline`` from their epoch-equivalent times, paired by repeat.

    Repeat ``r`` of both ran side by side (interleaved), so drift between repeats cancels in the per-repeat ratio.
    The interval is a Student t interval on the logs of those ratios: as wide as n numbers allow, however many steps
    each repeat timed. ``slot_shifts`` (how many slots later ``optimized`` ran than ``baseline`` in each repeat) lets
    the estimate take out an effect of the slot: the log ratio is regressed on the shift, and the speed-up and its
    interval are those at a shift of 0, with n - 2 degrees of freedom. After whole mirrored pairs of rounds the shifts
    sum to 0 and the speed-up is the geometric mean of the ratios; at an odd number of rounds it is the regression's
    value at a shift of 0, which differs from the geometric mean by the slot effect times the mean shift. From 10
    rounds on, the centre is a trimmed mean (:func:`log_ratio_fit`), so that a round hit by other work does not widen
    the interval by itself. ``confidence`` is the level of this one interval (a run's look reads its own share, see
    ``sequential``).

    Not read off an interval, with the reason: fewer than two pairs and a zero-width interval ("can't tell yet"); a
    time that is NaN, infinite, zero or negative (:data:`BAD_TIME`, a failed comparison).
    """
    baseline_s, optimized_s = np.asarray(baseline_s, dtype=float), np.asarray(optimized_s, dtype=float)
    if baseline_s.shape != optimized_s.shape:
        raise ValueError(f"paired repeats needed: {baseline_s.size} baseline and {optimized_s.size} optimized times")
    n = baseline_s.size
    if n == 0:
        return SpeedUp(float("nan"), float("nan"), float("nan"), UNCLEAR, reason="no pairs")
    bad = ~(np.isfinite(baseline_s) & np.isfinite(optimized_s) & (baseline_s > 0) & (optimized_s > 0))
    if bad.any():
        first = int(np.argmax(bad))
        return SpeedUp(float("nan"), float("nan"), float("nan"), BAD_TIME,
                       reason=f"pair {first + 1}: {baseline_s[first]:g} s against {optimized_s[first]:g} s")
    log_ratios = np.log(baseline_s) - np.log(optimized_s)
    if n < 2:
        return SpeedUp(float(np.exp(log_ratios.mean())), float("nan"), float("nan"), UNCLEAR,
                       reason="one pair: no interval")
    centre, standard_error, noise, df = log_ratio_fit(log_ratios, slot_shifts)
    ratio, low, high = (float(value) for value in fit_interval(centre, standard_error, df, confidence))
    scale, noise = float(standard_error) * math.sqrt(n), float(noise)
    autocorrelation = float(round_autocorrelation(log_ratios, slot_shifts))
    if math.isnan(low):  # no spread: rounds equal up to rounding read as rounds exactly equal
        return SpeedUp(ratio, float("nan"), float("nan"), UNCLEAR, 0.0, ZERO_WIDTH, 0.0, autocorrelation)
    return SpeedUp(ratio, low, high, verdict(ratio, low, high, min_effect), noise, scale=scale,
                   autocorrelation=autocorrelation)


def out_of_reach(ratio: "float | np.ndarray", noise: "float | np.ndarray", rounds: int, possible_rounds: float,
                 error_rate: float = ERROR_RATE, min_effect: float = MIN_EFFECT) -> "bool | np.ndarray":
    """Whether a comparison read at ``ratio`` with round noise ``noise`` after ``rounds`` could not be answered in
    ``possible_rounds``, even with its estimate ``REACH_ERRORS`` standard errors further its way: the interval it would
    have there (normal, at the whole ``error_rate``: narrower than any look's) would neither clear 1 and the band of no
    practical difference nor fit inside that band. ``noise`` is the scale the trimmed interval sees
    (:attr:`SpeedUp.scale`), so that a round hit by other work does not make a real difference look out of reach.
    False where the noise is unknown. Arrays of ``ratio`` and ``noise`` (simulated runs) give an array of answers."""
    ratio, noise = np.asarray(ratio, dtype=float), np.asarray(noise, dtype=float)
    known = np.isfinite(noise) & (noise > 0) & (ratio > 0) & (rounds > 0) & (possible_rounds > 0)
    ratio, noise = np.where(known, ratio, 1.0), np.where(known, noise, 1.0)  # no log or root of what is not judged
    band = math.log1p(min_effect)
    centre, error = np.abs(np.log(ratio)), REACH_ERRORS * noise / np.sqrt(max(rounds, 1))
    half = normal_quantile(1 - error_rate / 2) * noise / np.sqrt(max(possible_rounds, 1e-300))
    could_differ = centre + error > np.maximum(half, band)
    could_match = np.maximum(centre - error, 0.0) + half < band
    beyond = known & ~(could_differ | could_match)
    return bool(beyond) if beyond.ndim == 0 else beyond


def verdicts(ratio: "np.ndarray | float", low: "np.ndarray | float", high: "np.ndarray | float",
             min_effect: float = MIN_EFFECT) -> np.ndarray:
    """:func:`verdict` for arrays of speed-ups and interval ends (NaN ends: "can't tell yet")."""
    ratio, low, high = np.broadcast_arrays(*(np.asarray(value, dtype=float) for value in (ratio, low, high)))
    band = 1.0 + min_effect
    return np.select([(low > 1.0) & (ratio >= band), (high < 1.0) & (ratio <= 1.0 / band),
                      (low > 1.0 / band) & (high < band)], [FASTER, SLOWER, SAME], UNCLEAR)


def verdict(ratio: float, low: float, high: float, min_effect: float = MIN_EFFECT) -> str:
    """"faster" when the whole interval is above 1 and the ratio at least 1 + ``min_effect``; "slower" when the whole
    interval is below 1 and the ratio at most 1/(1 + ``min_effect``) (where "same" begins, so that the two meet);
    "same within 2 %" when the whole interval lies inside (1/(1 + min_effect), 1 + min_effect); "can't tell yet"
    otherwise."""
    return str(verdicts(ratio, low, high, min_effect)[()])
