import math
import time

import numpy as np
import pandas as pd
import pytest
import torch

from optlab.core.measuring import timing
from optlab.core.stats.summary import summarize_runs
from optlab.core.measuring.timing import (
    CONFIDENCE, StepTimer, epoch_equivalent, speed_up, summarize, t_quantile, verdict,
)
from tests.noise import paired_epoch_times, simulated_samples


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


def test_t_quantiles_match_the_tables():
    for probability, df, expected in [(0.975, 2, 4.303), (0.975, 4, 2.776), (0.975, 9, 2.262), (0.995, 2, 9.925),
                                      (0.995, 4, 4.604), (0.995, 30, 2.750)]:
        assert t_quantile(probability, df) == pytest.approx(expected, abs=2e-3)


def test_the_interval_is_a_paired_t_interval_on_log_ratios():
    baseline, optimized = [2.0, 2.2, 1.9, 2.1, 2.0], [1.0, 1.05, 1.0, 1.1, 0.95]
    logs = np.log(baseline) - np.log(optimized)
    half = t_quantile((1 + CONFIDENCE) / 2, 4) * logs.std(ddof=1) / np.sqrt(5)
    result = speed_up(baseline, optimized)
    assert result.ratio == pytest.approx(np.exp(logs.mean()))
    assert (result.low, result.high) == pytest.approx((np.exp(logs.mean() - half), np.exp(logs.mean() + half)))
    assert result.verdict == "faster"
    assert speed_up(optimized, baseline).verdict == "slower"


def test_pairing_cancels_drift_between_repeats():
    """The machine slows down tenfold over the repeats; a 5 % speed-up inside every repeat is still seen."""
    level = np.array([1.0, 2.0, 4.0, 7.0, 10.0])
    result = speed_up(level * 1.05 * np.array([1.0, 1.002, 0.999, 1.001, 1.0]), level)
    assert result.verdict == "faster" and result.ratio == pytest.approx(1.05, rel=1e-3)


def test_fewer_than_two_pairs_give_no_interval_and_no_verdict():
    result = speed_up([2.0], [1.0])
    assert result.ratio == 2.0 and np.isnan(result.low) and result.verdict == "can't tell yet"
    with pytest.raises(ValueError, match="paired repeats needed"):
        speed_up([1.0, 2.0], [1.0])


def test_four_answers_each_mean_one_thing():
    assert verdict(1.05, 1.03, 1.07) == "faster"
    assert verdict(0.9, 0.85, 0.95) == "slower"
    assert verdict(1.01, 1.005, 1.015) == "same within 2 %"  # real but too small to matter: inside the band
    assert verdict(1.0, 0.99, 1.01) == "same within 2 %"
    assert verdict(1.0, 0.97, 1.03) == "can't tell yet"  # could be a 3 % gain or loss
    assert verdict(1.3, 0.43, 3.65) == "can't tell yet"
    assert verdict(1.0, 1 / 1.02, 1.0) == "can't tell yet"  # the band's edge is outside it


def test_real_effects_still_get_their_verdict():
    rng = np.random.default_rng(7)
    twenty_times_slower = [speed_up(*paired_epoch_times(rng, 0.05, repeats=8)).verdict for _ in range(500)]
    assert twenty_times_slower.count("slower") >= 495
    calm = {"outlier_rate": 0.0, "jitter": 0.02, "drift": 0.03}
    half_again_faster = [speed_up(*paired_epoch_times(rng, 1.5, repeats=8, **calm)).verdict for _ in range(500)]
    assert half_again_faster.count("faster") >= 475


def test_summaries_pair_the_repeats_of_simulated_runs():
    rng = np.random.default_rng(11)
    verdicts = [summarize_runs(simulated_samples(rng, {"A": 1.0, "A again": 1.0}), "A").iloc[1]["verdict"]
                for _ in range(300)]
    assert sum(v in ("faster", "slower") for v in verdicts) <= 3
    samples = simulated_samples(rng, {"A": 1.0, "B": 2.0}, outlier_rate=0.0).query("not (variant == 'B' and repeat == 4)")
    row = summarize_runs(samples, "A").iloc[1]
    assert row["verdict"] == "faster" and row["n"] == 4


def test_slower_and_same_meet_so_every_narrow_ratio_gets_an_answer():
    edge = 1 / 1.02
    assert verdict(0.9802, 0.975, 0.985) == "slower"  # between 0.98 and 1/1.02
    assert verdict(edge + 1e-4, edge + 5e-5, 0.999) == "same within 2 %"
    for ratio in np.linspace(0.95, 1.05, 201):  # a narrow interval around any ratio: never "can't tell yet"
        assert verdict(ratio, ratio * 0.9999, ratio * 1.0001) != "can't tell yet" or 1.0195 < ratio < 1.02


def test_t_quantiles_hold_far_into_the_tail():
    """A look with a tiny share of the error rate needs the tail: df 1 and 2 have closed forms."""
    for tail in (1e-3, 1e-6, 1e-9):
        assert t_quantile(1 - tail / 2, 1) == pytest.approx(np.tan(np.pi * (0.5 - tail / 2)), rel=1e-6)
        assert t_quantile(1 - tail / 2, 2) == pytest.approx(np.sqrt(2 * (1 - tail) ** 2 / (1 - (1 - tail) ** 2)),
                                                            rel=1e-6)


def test_the_round_noise_is_the_spread_of_a_round_s_log_ratio():
    rng = np.random.default_rng(3)
    logs = 0.05 + rng.normal(0, 0.03, 400)
    assert speed_up(np.exp(logs), np.ones(400)).noise == pytest.approx(0.03, rel=0.1)


def test_a_too_wide_interval_is_named_not_printed():
    from optlab.book import report
    from optlab.core.measuring.timing import interval_text
    assert report.speedup_text(0.89, 0.0001, 3e7, 3) == "0.890 (interval too wide to tell after 3 rounds)"
    assert report.speedup_text(1.10, 1.05, 1.15, 8) == "1.10 (1.05–1.15)"
    assert interval_text(0.0, 3e7) == "too wide to tell" and interval_text(1.0, 1.1) == "1.00-1.10"


def test_a_chapter_line_says_the_noise_what_it_lets_the_rule_tell_and_the_page_bound():
    from optlab.book import report
    summary = pd.DataFrame({"verdict": ["baseline", "can't tell yet", "faster", "out of memory"],
                            "noise": [np.nan, 0.08, 0.04, np.nan], "n": [np.nan, 12, 8, 5],
                            "ci_low": [1.0, 0.9, 1.05, np.nan], "ci_high": [1.0, 1.1, 1.15, np.nan]})
    line = report.noise_line(summary)
    assert "2 comparisons" in line and "6.0 % median (4.0-8.0 %)" in line and "10 rounds median" in line
    assert "99.5 % sequential interval" in line and "at most 1 %" in line  # 2 x 0.5 %
    assert report.noise_line(summary.iloc[[0, 3]]).startswith("No comparison")


def test_intervals_too_wide_to_mean_anything_read_as_a_disturbed_machine_not_a_percentage():
    from optlab.book import report
    summary = pd.DataFrame({"verdict": ["can't tell yet", "can't tell yet", "faster"], "noise": [2.5, 3.0, 0.04],
                            "n": [4, 4, 8], "ci_low": [0.01, 0.02, 1.05], "ci_high": [200.0, 90.0, 1.15]})
    line = report.noise_line(summary)
    assert "disturbed by other work: re-run on a quiet machine" in line and "±" not in line, line
    assert "±" in report.noise_line(summary.iloc[[2]])  # one clear interval still says how far it reaches


def test_from_ten_rounds_a_round_hit_by_other_work_does_not_decide_the_answer(monkeypatch):
    """One round of twelve 60 % off (another job took the core): the trimmed interval keeps the clean rounds' answer
    and about their speed-up, while the recorded noise still shows the hit; the plain mean could not tell."""
    logs = np.log(1.03) + np.random.default_rng(0).normal(0, 0.01, 12)
    hit = logs.copy()
    hit[5] += np.log(1.6)
    clean, spoilt = (timing.speed_up(np.exp(values), np.ones(12)) for values in (logs, hit))
    assert clean.verdict == spoilt.verdict == timing.FASTER
    assert abs(math.log(spoilt.ratio / clean.ratio)) < 0.01 and spoilt.noise > 5 * clean.noise
    monkeypatch.setattr(timing, "TRIM", 0.0)
    assert timing.speed_up(np.exp(hit), np.ones(12)).verdict == timing.UNCLEAR


def test_rounds_the_slot_fit_is_pinned_to_cost_degrees_of_freedom():
    """Bell and McCaffrey's degrees of freedom: the plain fit's n - 2 where every round has the same leverage (two
    variants), fewer where two rounds of shifts 7 and -7 pin the slope (8 variants), and a number, not NaN, where one
    round sits alone at its shift (leverage 1)."""
    assert timing.slot_fit_df((1.0, -1.0) * 5) == pytest.approx(8)
    assert timing.slot_fit_df((7.0, -7.0) + (-1.0, 1.0) * 4) < 7.6
    assert 0 < timing.slot_fit_df((1.0, -1.0, 1.0)) < 1.01
    logs = np.log([1.02, 1.05, 1.01, 1.06, 1.03, 1.00, 1.04, 1.02, 1.05, 1.03])
    plain_df = timing.log_ratio_fit(logs, [1.0, -1.0] * 5)[3]
    pinned_df = timing.log_ratio_fit(logs, [7.0, -7.0] + [-1.0, 1.0] * 4)[3]
    assert pinned_df < plain_df == pytest.approx(10 - 2 - 2)  # two rounds cut, one slope fitted


def test_the_lag_one_autocorrelation_tells_carried_noise_from_independent_rounds():
    """Rounds whose noise carries over (AR(1), rho 0.6) read a lag-1 autocorrelation well above 0; independent rounds
    read about 0, and neither is flagged below 10 rounds or by a slot effect the fit takes out."""
    rng = np.random.default_rng(0)
    shocks = rng.normal(0, 0.05, (2000, 48))
    carried = shocks.copy()
    for index in range(1, 48):
        carried[:, index] = 0.6 * carried[:, index - 1] + 0.8 * shocks[:, index]
    shifts = np.array([1.0, -1.0] * 24)
    independent = timing.round_autocorrelation(shocks + 0.03 * shifts, shifts)
    dependent = timing.round_autocorrelation(carried, shifts)
    assert abs(np.median(independent)) < 0.05 and np.median(dependent) > 0.4
    flagged = [np.mean([timing.dependent_rounds(a, 48) for a in values]) for values in (independent, dependent)]
    assert flagged[0] < 0.05 and flagged[1] > 0.9
    assert not timing.dependent_rounds(0.9, 8)
    assert timing.speed_up(np.exp(carried[0]), np.ones(48), shifts).autocorrelation == pytest.approx(dependent[0])


def test_a_comparison_with_dependent_rounds_says_so_beside_its_verdict_in_the_table():
    from optlab.book.report import comparison_table

    summary = pd.DataFrame([
        {"model": "m", "phase": "train", "variant": "B", "n": 48, "speedup": 1.05, "ci_low": 1.03, "ci_high": 1.07,
         "verdict": timing.FASTER, "autocorrelation": 0.45, "peak_mem_mb": 1.0},
        {"model": "m", "phase": "train", "variant": "C", "n": 48, "speedup": 1.05, "ci_low": 1.03, "ci_high": 1.07,
         "verdict": timing.FASTER, "autocorrelation": 0.05, "peak_mem_mb": 1.0}])
    verdicts = list(comparison_table(summary)["verdict"])
    assert "may be too narrow" in verdicts[0] and "0.45" in verdicts[0] and verdicts[1] == timing.FASTER


def test_verdicts_at_equality_exactly_two_percent_and_exactly_at_an_edge():
    """A speed-up of exactly 1.02 is a real gain (at least 1 + MIN_EFFECT) and exactly 1/1.02 a real loss; an
    interval that touches 1 is not wholly above or below it, and one that touches the band's edge is not inside it."""
    band = 1 + timing.MIN_EFFECT
    assert verdict(band, 1.01, 1.03) == timing.FASTER and verdict(1 / band, 0.97, 0.99) == timing.SLOWER
    assert verdict(1.05, 1.0, 1.1) == verdict(0.95, 0.9, 1.0) == timing.UNCLEAR
    assert verdict(1.0, 0.99, band) == verdict(1.0, 1 / band, 1.01) == timing.UNCLEAR
    assert verdict(1.0, 0.99, band - 1e-9) == verdict(1.0, 1 / band + 1e-9, 1.01) == timing.SAME


def test_the_scale_the_rule_reads_is_one_rounds_spread():
    """``scale`` is the standard error times sqrt(rounds): with no trim and no slot fit, the rounds' sample standard
    deviation (n - 1 in the denominator), which the budget's reach is judged on."""
    logs = np.log([1.02, 1.05, 1.01, 1.06, 1.03])
    assert speed_up(np.exp(logs), np.ones(5)).scale == pytest.approx(logs.std(ddof=1), rel=1e-12)
