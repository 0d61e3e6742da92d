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
