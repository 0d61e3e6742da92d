"""The timer and the small functions of the interval, as values: the t tail against its closed forms, the boundaries
of the dependent-rounds flag and of "too wide", the leverage of uneven shifts, and the timer's own arithmetic on a
clock it does not own (CPU pauses, CUDA events in milliseconds)."""
import math

import pytest
import torch

from optlab.core.measuring import timing
from optlab.core.measuring.timing import StepTimer


def closed_form_tail(t: float, df: int) -> float:
    """P(|T| > t) for 1, 2 and 3 degrees of freedom."""
    if df == 1:
        return 1 - 2 / math.pi * math.atan(t)
    if df == 2:
        return 1 - t / math.sqrt(2 + t * t)
    x = t / math.sqrt(3)
    return 1 - 2 / math.pi * (math.atan(x) + x / (1 + x * x))


@pytest.mark.parametrize("df", [1, 2, 3])
@pytest.mark.parametrize("t", [0.05, 0.5, 1.0, 2.0, 5.0, 30.0, 1e4])
def test_the_t_tail_is_its_closed_form_to_ten_digits(t, df):
    assert timing.t_two_sided_tail(t, df) == pytest.approx(closed_form_tail(t, df), rel=1e-10)


def test_percent_names_the_level_with_the_digits_it_needs():
    assert [timing.percent(p) for p in (0.995, 0.999, 0.5, 0.99999)] == ["99.5 %", "99.9 %", "50 %", "99.999 %"]
    assert timing.INTERVAL == "99.5 % sequential interval"


def test_too_wide_and_its_text_at_the_boundary():
    assert not timing.too_wide(1.0, 4.0) and timing.too_wide(1.0, 4.0001)
    assert timing.interval_text(1.0, 4.0) == "1.00-4.00"
    assert timing.interval_text(1.0, 4.5, rounds=12) == "too wide to tell (12 rounds)"
    assert timing.interval_text(1.0, 4.5) == "too wide to tell"
    assert timing.interval_text(math.nan, 1.1) == timing.interval_text(0.9, math.nan) == ""


def test_a_page_bound_is_the_union_bound_up_to_one():
    assert timing.page_bound(7) == pytest.approx(0.035) and timing.page_bound(1000) == 1.0


def test_dependent_rounds_from_ten_rounds_and_strictly_above_the_line():
    assert timing.dependent_rounds(0.9, 10) and not timing.dependent_rounds(0.9, 9)
    assert not timing.dependent_rounds(0.5, 16) and timing.dependent_rounds(0.5001, 16)  # 2 / sqrt(16) = 0.5


def test_the_leverage_of_uneven_shifts():
    """Three rounds at +1, -1, +1: the round alone at its shift has leverage 1, the other two 1/2 (the leverages add
    up to the fit's two coefficients)."""
    assert timing.round_leverage(torch.tensor([1.0, -1.0, 1.0]).numpy()).tolist() == pytest.approx([0.5, 1.0, 0.5])


def test_an_empty_summary_is_nan_with_no_samples():
    empty = timing.summarize([])
    assert all(math.isnan(value) for value in (empty.median, empty.iqr, empty.min)) and empty.n == 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_cpu_timer_leaves_paused_time_out_of_every_step_and_the_wall(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    timer = StepTimer(torch.device("cpu"))
    timer.resume()  # a resume without a pause changes nothing
    timer.start()
    clock.now += 1.0
    timer.mark()
    timer.pause()
    clock.now += 5.0  # another variant's step
    timer.resume()
    clock.now += 2.0
    timer.mark()
    clock.now += 0.5
    timer.mark()
    assert timer.finish() == ([1.0, 2.0, 0.5], 3.5)


class FakeEvent:
    """A CUDA event on a clock the test turns: elapsed_time in milliseconds, as CUDA's."""

    clock = Clock()

    def __init__(self, enable_timing: bool = False) -> None:
        self.timing, self.at = enable_timing, None

    def record(self) -> None:
        self.at = FakeEvent.clock.now

    def elapsed_time(self, other: "FakeEvent") -> float:
        assert self.timing and other.timing, "an event made without enable_timing cannot be timed"
        return 1e3 * (other.at - self.at)


def test_a_cuda_timer_reads_its_events_in_seconds_after_a_synchronize(monkeypatch):
    clock = FakeEvent.clock
    synchronized = []
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synchronized.append(clock.now))
    timer = StepTimer(torch.device("cuda"))
    timer.start()
    for seconds in (0.25, 0.5, 0.125):
        clock.now += seconds
        timer.mark()
    clock.now += 0.1
    steps, wall = timer.finish()
    assert steps == pytest.approx([0.25, 0.5, 0.125]) and wall == pytest.approx(0.975)
    assert len(synchronized) == 2


@pytest.mark.parametrize("rounds", [3, 4, 9, 10, 12])
def test_each_row_of_simulated_runs_gets_its_own_fit(rounds):
    """The simulations pass thousands of runs as rows: every number along the last axis must be the row's own, as if
    it were read alone (a mean or a sort over the whole array would mix runs)."""
    import numpy as np

    rng = np.random.default_rng(rounds)
    logs = rng.normal(0.03, 0.05, (6, rounds)) + np.arange(6)[:, None] * 0.1  # rows far apart
    shifts = np.array([1.0, -1.0] * rounds)[:rounds] * 2 + 0.5  # an odd count leaves their mean off 0
    together = timing.log_ratio_fit(logs, shifts)
    together_autocorrelation = timing.round_autocorrelation(logs, shifts)
    together_intervals = timing.intervals(logs, shifts)
    for row in range(6):
        alone = timing.log_ratio_fit(logs[row], shifts)
        for part in range(3):
            assert together[part][row] == pytest.approx(alone[part], rel=1e-9, nan_ok=True, abs=1e-15)
        assert together[3] == pytest.approx(alone[3])
        assert together_autocorrelation[row] == pytest.approx(
            float(timing.round_autocorrelation(logs[row], shifts)), rel=1e-9, nan_ok=True)
        for part, value in zip(together_intervals, timing.intervals(logs[row], shifts)):
            assert part[row] == pytest.approx(value, rel=1e-9, nan_ok=True)


@pytest.mark.parametrize("rounds, cut", [(3, 0), (9, 0), (10, 1), (20, 2)])
def test_the_autocorrelation_trims_from_ten_rounds_and_reads_from_three(rounds, cut):
    import numpy as np

    logs = np.random.default_rng(7).normal(0.0, 0.05, rounds)
    logs[rounds // 2] += 1.0
    ordered = np.sort(logs)
    kept = np.clip(logs, ordered[cut], ordered[rounds - cut - 1])
    deviations = kept - kept.mean()
    expected = (deviations[1:] * deviations[:-1]).sum() / (deviations ** 2).sum()
    assert float(timing.round_autocorrelation(logs)) == pytest.approx(expected, rel=1e-12)
    assert math.isnan(float(timing.round_autocorrelation(logs[:2])))


def test_three_rounds_fit_a_slope_and_two_do_not():
    import numpy as np

    logs, shifts = np.array([0.10, 0.00, 0.06]), np.array([1.0, -1.0, 1.0])
    at_zero, fitted = timing.at_shift_zero(logs, shifts)
    slope = (0.08 - 0.0) / 2  # the mean at +1 less the value at -1, over the distance
    assert fitted and at_zero.tolist() == pytest.approx((logs - slope * shifts).tolist())
    kept, fitted = timing.at_shift_zero(logs[:2], shifts[:2])
    assert not fitted and kept.tolist() == logs[:2].tolist()


def _all_nan(result: timing.SpeedUp) -> bool:
    return all(math.isnan(value) for value in (result.ratio, result.low, result.high))


def test_a_comparison_with_no_pairs_one_pair_or_a_bad_time_says_why_in_its_reason():
    empty = timing.speed_up([], [])
    assert _all_nan(empty) and (empty.verdict, empty.reason) == (timing.UNCLEAR, "no pairs")
    one = timing.speed_up([2.0], [1.0])
    assert one.ratio == pytest.approx(2.0) and math.isnan(one.low) and math.isnan(one.high)
    assert (one.verdict, one.reason) == (timing.UNCLEAR, "one pair: no interval")
    for baseline, optimized, said in [([1.0, 1.0, 1.0], [1.0, 0.0, 1.0], "pair 2: 1 s against 0 s"),
                                      ([1.0, 0.0, 1.0], [1.0, 1.0, 1.0], "pair 2: 0 s against 1 s"),
                                      ([1.0, 1.0, -1.0], [1.0, 1.0, 1.0], "pair 3: -1 s against 1 s"),
                                      ([math.nan, 1.0], [1.0, 1.0], "pair 1: nan s against 1 s"),
                                      ([1.0, 1.0], [1.0, math.inf], "pair 2: 1 s against inf s")]:
        bad = timing.speed_up(baseline, optimized)
        assert _all_nan(bad) and (bad.verdict, bad.reason) == (timing.BAD_TIME, said)


def test_two_pairs_give_an_interval_and_equal_ratios_a_zero_width_one_that_is_not_read():
    two = timing.speed_up([1.1, 1.2], [1.0, 1.0])
    assert two.low < two.ratio < two.high and not two.reason
    same = timing.speed_up([1.5, 1.5, 1.5], [1.0, 1.0, 1.0])
    assert same.ratio == pytest.approx(1.5) and math.isnan(same.low) and math.isnan(same.high)
    assert (same.verdict, same.reason) == (timing.UNCLEAR, timing.ZERO_WIDTH)


def test_a_speed_up_is_read_at_its_slot_shifts_and_its_level():
    import numpy as np

    baseline = np.array([1.10, 1.00, 1.12, 0.99, 1.09, 1.01, 1.11])
    shifts = np.array([1.0, -1.0] * 4)[:7]
    logs = np.log(baseline)
    for level in (0.9, 0.995):
        result = timing.speed_up(baseline, np.ones(7), shifts, confidence=level)
        ratio, low, high, noise = timing.intervals(logs, shifts, level)
        assert (result.ratio, result.low, result.high, result.noise) == pytest.approx((ratio, low, high, noise))
    plain = timing.speed_up(baseline, np.ones(7))
    assert plain.ratio == pytest.approx(float(np.exp(logs.mean())))
    assert timing.speed_up(baseline, np.ones(7), shifts).ratio != pytest.approx(plain.ratio, rel=1e-3)


@pytest.mark.parametrize("shifts", [None, [0, 1, 0, 1, 0, 1]], ids=["no shifts", "shifts"])
def test_rounds_equal_up_to_a_float_s_rounding_read_as_rounds_exactly_equal(shifts):
    """Every round 1.5x, computed as a/(a/1.5): the log ratios differ by a float's rounding only. That is no spread:
    the answer is the exactly-equal rounds' (no interval, "can't tell yet", no autocorrelation), not a zero-width
    "faster" with a dependence flag drawn from the rounding."""
    times = [1.0, 1.1, 0.9, 1.2, 1.05, 0.95]
    rounded = timing.speed_up(times, [t / 1.5 for t in times], slot_shifts=shifts)
    exact = timing.speed_up([2.0] * 6, [2.0 / 1.5] * 6, slot_shifts=shifts)
    for answer in (rounded, exact):
        assert answer.ratio == pytest.approx(1.5) and math.isnan(answer.low) and math.isnan(answer.high)
        assert (answer.verdict, answer.reason) == (timing.UNCLEAR, timing.ZERO_WIDTH)
        assert answer.noise == answer.scale == 0.0 and math.isnan(answer.autocorrelation), answer
    wobble = [1, -2, 0.5, 1.5, -1, 0]  # parts in 10,000, not along the shifts
    real = timing.speed_up(times, [t / 1.5 * (1 + 1e-4 * w) for t, w in zip(times, wobble)], slot_shifts=shifts)
    assert real.verdict == timing.FASTER and real.low < 1.5 < real.high  # a spread a clock can see is read


class QueuedDevice:
    """A fake CUDA device whose work runs behind the host: a launch queues seconds of work and returns at once, an
    event is stamped when the queue reaches it, and ``synchronize`` (counted) holds the host until the queue is
    empty."""

    def __init__(self) -> None:
        self.host, self.busy_until, self.synchronized = 100.0, 100.0, 0
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at = None

            def record(self) -> None:
                self.at = max(device.busy_until, device.host)

            def elapsed_time(self, other: "Event") -> float:
                return 1e3 * (other.at - self.at)

        self.Event = Event

    def launch(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, self.host) + seconds

    def synchronize(self) -> None:
        self.synchronized += 1
        self.host = max(self.host, self.busy_until)


def test_a_cuda_timer_waits_for_the_queue_before_it_starts_and_before_it_reads_the_wall(monkeypatch):
    """3 s of another variant's work are still queued when the timer starts; its steps queue 0.25 s and 0.5 s and the
    host returns at once. The wall is the steps' 0.75 s only where ``start`` synchronizes before it reads the clock
    (else 3.75 s) and ``finish`` synchronizes before it reads it (else 0 s), and each synchronizes exactly once."""
    device = QueuedDevice()
    monkeypatch.setattr(timing.time, "perf_counter", lambda: device.host)
    monkeypatch.setattr(torch.cuda, "Event", device.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", device.synchronize)
    device.launch(3.0)
    timer = StepTimer(torch.device("cuda"))
    timer.start()
    assert device.synchronized == 1 and device.host == 103.0
    for seconds in (0.25, 0.5):
        device.launch(seconds)
        timer.mark()
    assert device.synchronized == 1  # no synchronize between steps: that would stall the queue
    steps, wall = timer.finish()
    assert steps == [0.25, 0.5] and wall == 0.75 and device.synchronized == 2
