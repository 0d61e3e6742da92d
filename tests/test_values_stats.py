"""The interval's numbers, checked as values on inputs where a slip gives another number: rounds of equal leverage
(where the leverage correction must leave the plain least-squares interval as it is), the rounds on the trimming
boundary (corrected like every round kept), adjacent outliers (the autocorrelation reads the winsorized rounds), a
chained stack whose middle step failed (its status, never "not waited for"), shifts that do not centre on 0 (the fit
read away from the shifts' mean), and the stopping rule's time limits at equality (a round that ends exactly at the
budget or the deadline still runs)."""
import math

import numpy as np
import pandas as pd
import pytest

from optlab.core.measuring import timing
from optlab.core.stats.sequential import StoppingRule
from optlab.core.stats.summary import NOT_WAITED, step_by_step, summarize_runs


def plain_fit(logs: np.ndarray, shifts: np.ndarray) -> tuple[float, float]:
    """Ordinary least squares of the log ratios on the shift, by numpy's solver: the value at a shift of 0 and its
    textbook standard error, s^2 (X'X)^-1."""
    design = np.column_stack([np.ones_like(shifts), shifts])
    coef, rss, _, _ = np.linalg.lstsq(design, logs, rcond=None)
    variance = float(rss[0]) / (logs.size - 2) * np.linalg.inv(design.T @ design)
    return float(coef[0]), math.sqrt(variance[0, 0])


@pytest.mark.parametrize("rounds", [4, 6, 8])
def test_with_equal_leverage_the_corrected_fit_is_plain_least_squares(rounds):
    """Two variants (shifts +1, -1, in whole pairs): every round has the same leverage, so the HC2 correction,
    normalised by the mean of 1 - h, scales nothing; centre, standard error and degrees of freedom are the textbook
    fit's. Left unnormalised it would widen every interval by sqrt(n / (n - 2))."""
    logs = np.log(np.random.default_rng(rounds).uniform(0.95, 1.10, rounds))
    shifts = np.array([1.0, -1.0] * rounds)[:rounds]
    centre, error, _, df = timing.log_ratio_fit(logs, shifts)
    assert (float(centre), float(error)) == pytest.approx(plain_fit(logs, shifts), rel=1e-12)
    assert df == pytest.approx(rounds - 2, rel=1e-12)


def test_with_equal_leverage_and_trimming_the_correction_changes_nothing():
    """From 10 rounds the centre is trimmed: with equal leverage the standard error is the winsorized rounds' plain
    one, rounds on the boundary included, each counted once."""
    logs = np.log(np.random.default_rng(3).uniform(0.95, 1.10, 12))
    shifts = np.array([1.0, -1.0] * 6)
    centre, error, _, df = timing.log_ratio_fit(logs, shifts)
    at_zero = logs - (logs - logs.mean()) @ shifts / (shifts @ shifts) * shifts
    ordered = np.sort(at_zero)
    wins = np.clip(at_zero, ordered[1], ordered[-2])
    expected = math.sqrt(((wins - wins.mean()) ** 2).sum() / 10) * 12 / 10 * math.sqrt(1 / 12)
    assert float(centre) == pytest.approx(ordered[1:-1].mean(), rel=1e-12)
    assert float(error) == pytest.approx(expected, rel=1e-12)
    assert df == pytest.approx(12 - 2 - 1 - 1)  # two rounds cut, a mean, a slope


def hc2_standard_error(logs: np.ndarray, shifts: np.ndarray) -> float:
    """The docstring of :func:`timing.log_ratio_fit` written out round by round: trim one round from each end of the
    values at a shift of 0, winsorize, scale up each round *not cut* by sqrt(mean(1 - h) / (1 - h))."""
    n, cut = logs.size, int(timing.TRIM * logs.size)
    centred = shifts - shifts.mean()
    at_zero = logs - (logs - logs.mean()) @ centred / (centred @ centred) * shifts
    order = list(np.argsort(at_zero, kind="stable"))
    kept_rounds = set(order[cut:n - cut])
    low, high = at_zero[order[cut]], at_zero[order[n - cut - 1]]
    wins = np.clip(at_zero, low, high)
    leverage = 1 / n + centred ** 2 / (centred @ centred)
    total = 0.0
    for index in range(n):
        deviation = wins[index] - wins.mean()
        if index in kept_rounds:
            deviation *= math.sqrt(((n - 2) / n) / (1 - leverage[index]))
        total += deviation ** 2
    scale = math.sqrt(total / (n - 2)) * n / (n - 2 * cut)
    return scale * math.sqrt(1 / n + shifts.mean() ** 2 / (centred @ centred))


def test_the_leverage_correction_reaches_the_two_kept_rounds_on_the_trimming_boundary():
    """Eight variants' shifts (7 and -7 beside rounds of 1 and -1): the two rounds of high leverage are the second
    lowest and second highest, the last ones kept, and are corrected like every round kept (a strict comparison with
    the boundary would skip them and give a narrower interval)."""
    shifts = np.array([7.0, -7.0] + [-1.0, 1.0] * 4)
    at_zero = np.array([0.050, 0.000, 0.030, 0.040, 0.010, 0.045, 0.020, 0.060, -0.020, 0.015])
    ranks = np.argsort(np.argsort(at_zero))
    assert ranks[0] == 8 and ranks[1] == 1  # the high-leverage rounds sit on the boundary
    logs = at_zero + 0.004 * shifts  # a slot effect the fit takes out again
    error = float(timing.log_ratio_fit(logs, shifts)[1])
    assert error == pytest.approx(hc2_standard_error(logs, shifts), rel=1e-12)


def winsorized_lag_one(values: np.ndarray, cut: int) -> float:
    ordered = np.sort(values)
    kept = np.clip(values, ordered[cut], ordered[values.size - cut - 1])
    deviations = kept - kept.mean()
    return float((deviations[1:] * deviations[:-1]).sum() / (deviations ** 2).sum())


def test_two_adjacent_outliers_are_winsorized_before_the_autocorrelation_is_read():
    """Two rounds in a row hit by other work: on the raw rounds they alone make a lag-1 autocorrelation that flags the
    comparison as dependent; winsorized, as the interval sees them, they count no more than the rounds kept."""
    logs = np.random.default_rng(1).normal(0.03, 0.01, 20)
    logs[9:11] += 0.5
    raw = winsorized_lag_one(logs, 0)
    assert timing.dependent_rounds(raw, 20)  # the slip this guards against would flag it
    value = float(timing.round_autocorrelation(logs))
    assert value == pytest.approx(winsorized_lag_one(logs, 2), rel=1e-12)
    assert not timing.dependent_rounds(value, 20)
    assert timing.speed_up(np.exp(logs), np.ones(20)).autocorrelation == pytest.approx(value, rel=1e-12)


def _samples(times: dict[str, list[float]], failed: dict[str, str]) -> pd.DataFrame:
    rows = []
    for slot, (variant, seconds) in enumerate(times.items()):
        for repeat, value in enumerate(seconds):
            status = failed.get(variant, "ok") if repeat == len(seconds) - 1 else "ok"
            rows.append({"model": "m", "phase": "train", "variant": variant, "repeat": repeat, "slot": slot,
                         "status": status, "epoch_equiv_s": value, "step_median_s": value / 10, "startup_s": 0.0,
                         "images_per_s": 1 / value, "peak_mem_mb": 1.0, "tflops": 0.0})
    return pd.DataFrame(rows)


def test_a_failed_step_of_a_chained_stack_keeps_its_failure_in_both_verdicts():
    """A chained stack (each step waited for against the step before) whose middle step failed: its verdicts, against
    the step before and against the baseline, are its failure, and the next step says it was not compared; only the
    next step's read comparison with the baseline, which its run did not wait for, is "not waited for"."""
    why = "failed: out of memory"
    labels = ["base", "+a", "+b", "+c"]
    samples = _samples({"base": [1.0, 1.01, 0.99, 1.0], "+a": [0.8, 0.81, 0.79, 0.8], "+b": [0.7, 0.71, 0.69, 0.7],
                        "+c": [0.6, 0.61, 0.59, 0.6]}, {"+b": why})
    steps = step_by_step(samples, labels, dict(zip(labels[1:], labels))).set_index("step")
    assert steps.loc["+b", "verdict"] == steps.loc["+b", "baseline_verdict"] == why
    assert steps.loc["+c", "verdict"] == f"not compared: +b {why}"
    assert steps.loc["+c", "baseline_verdict"] == NOT_WAITED
    assert steps.loc["+a", "verdict"] in timing.VERDICTS and steps.loc["+a", "baseline_verdict"] in timing.VERDICTS
    summary = summarize_runs(samples, "base").set_index("variant")
    assert summary.loc["+b", "n"] == 3 and math.isnan(summary.loc["+b", "speedup"])  # the rounds it finished


def test_a_pair_that_would_end_exactly_at_the_budget_still_runs():
    """The next pair's forecast (2 x 0.125 s) ends exactly at the 1 s budget after 0.75 s: not past it, so the look
    is not the last; a moment later it is."""
    for elapsed, final in ((0.75, False), (0.75 + 2**-10, True)):
        now = [0.0]
        rule = StoppingRule(4, 48, time_budget_s=1.0, clock=lambda: now[0])
        rule.start()
        for seconds in (0.125,) * 4:
            rule.round_done(seconds)
        now[0] = elapsed
        assert rule.stop_on(4, lambda level: False) == final and rule.looks[-1].final == final


def test_a_round_that_would_end_exactly_at_the_deadline_still_runs(monkeypatch):
    """Rounds of 0.5 s; after one ends at 1.5 s the next would end exactly at the 2 s deadline: it runs. One that
    would end past it does not."""
    from optlab.core.process import shutdown

    for deadline, stops in ((2.0, False), (2.0 - 2**-10, True)):
        now = [0.0]
        monkeypatch.setattr(shutdown, "now", lambda: now[0])
        rule = StoppingRule(4, 48, deadline=deadline)
        rule.start()
        for end in (0.5, 1.0, 1.5):
            now[0] = end
            stopped = rule.stop_on(int(end * 2), lambda level: False)
        assert stopped == stops and rule.past_deadline == stops


def test_shifts_that_do_not_centre_on_zero_read_the_fit_where_the_shift_is_zero():
    """Slot shifts of 2 and 0 (equal leverage, mean 1): the value at a shift of 0 lies one shift from the shifts'
    mean, so it is the mean of the three rounds at shift 0 and its standard error the textbook
    s * sqrt(1/n + mean^2 / Sxx), twice the variance of a centred fit's; only those three rounds weigh in it, so
    Bell and McCaffrey's degrees of freedom are 2."""
    logs = np.log(np.random.default_rng(5).uniform(0.95, 1.10, 6))
    shifts = np.array([2.0, 0.0] * 3)
    centre, error, _, df = timing.log_ratio_fit(logs, shifts)
    assert (float(centre), float(error)) == pytest.approx(plain_fit(logs, shifts), rel=1e-12)
    assert float(centre) == pytest.approx(logs[1::2].mean(), rel=1e-12) and df == pytest.approx(2, rel=1e-9)


def test_the_budgets_forecast_is_the_longest_round_after_the_first_and_only_the_first_left_out():
    """Rounds of 3 s (one-off costs), 0.875 s, 0.25 s and 0.25 s against a 5 s budget: the next pair is forecast at
    2 x 0.875 s, so after 3 s it fits (a forecast with the first round would not) and after 3.5 s it does not (one
    that also left out the second round would say it does)."""
    for elapsed, final in ((3.0, False), (3.5, True)):
        now = [0.0]
        rule = StoppingRule(4, 48, time_budget_s=5.0, clock=lambda: now[0])
        rule.start()
        for seconds in (3.0, 0.875, 0.25, 0.25):
            rule.round_done(seconds)
        now[0] = elapsed
        assert rule.stop_on(4, lambda level: False) == final, elapsed
