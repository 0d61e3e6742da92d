"""The sequential rule over simulated noise: error rates and power (seeded, no timing).

Noise: a 5 % random walk of the machine's speed between rounds, a slot effect (each later slot of a round faster),
Gaussian per-repeat noise of the paired log ratio (the table's 1, 2, 5 %) and outlier steps. The A/A bound is
checked under heavy noise (1.5 % slot effect, 5 % of repeats with an outlier step); the power goals under the same
drift and slot effect with outlier steps in 0.5 % of repeats.
"""
import numpy as np
import pytest

from optlab.core import timing
from optlab.core.profiles import get_profile
from optlab.core.sequential import StoppingRule, look_points, visit_order
from tests.noise import Noise, sequential_outcome

HEAVY = dict(slot_effect=0.015, outlier_rate=0.05)
POWER = dict(slot_effect=0.015, outlier_rate=0.005)


def outcomes(profile: str, speed_up: float, noise: Noise, draws: int, seed: int) -> tuple[dict[str, float], list[int]]:
    prof = get_profile(profile)
    rule = StoppingRule(prof.repeats, prof.max_repeats)
    rng = np.random.default_rng(seed)
    results = [sequential_outcome(rng, speed_up, rule, noise) for _ in range(draws)]
    verdicts = [verdict for verdict, _ in results]
    return {v: verdicts.count(v) / draws for v in timing.VERDICTS}, [repeats for _, repeats in results]


@pytest.mark.parametrize("profile", ["quick", "smoke"])
@pytest.mark.parametrize("noise", [HEAVY, POWER], ids=["heavy outliers", "rare outliers"])
def test_a_a_comparisons_rarely_say_faster_or_slower(profile, noise):
    """5 % noise: the widest intervals, where an A/A comparison most often clears the 2 % floor by chance."""
    rates, _ = outcomes(profile, 1.0, Noise(0.05, **noise), draws=3000, seed=len(profile))
    assert rates[timing.FASTER] + rates[timing.SLOWER] <= 0.01


def test_a_true_five_percent_gain_at_two_percent_noise_is_found_within_the_cap():
    rates, repeats = outcomes("quick", 1.05, Noise(0.02, **POWER), draws=1000, seed=5)
    print(f"5 % gain, 2 % noise: faster {rates[timing.FASTER]:.3f}; repeats: mean {np.mean(repeats):.1f}, "
          f"95th percentile {np.percentile(repeats, 95):.0f}")
    assert rates[timing.FASTER] >= 0.80


def test_no_effect_at_one_percent_noise_is_called_the_same_within_two_percent():
    rates, repeats = outcomes("quick", 1.0, Noise(0.01, **POWER), draws=1000, seed=1)
    print(f"1.00, 1 % noise: same {rates[timing.SAME]:.3f}; repeats: mean {np.mean(repeats):.1f}, "
          f"95th percentile {np.percentile(repeats, 95):.0f}")
    assert rates[timing.SAME] >= 0.80


@pytest.mark.parametrize("confidence", [0.995, 0.99], ids=["fixed-n 99.5 %", "fixed-n 99 %"])
def test_the_same_simulation_fails_without_the_error_split(monkeypatch, confidence):
    """Every look at a fixed-n level (the error rate not split over the looks): the A/A test above would fail."""
    monkeypatch.setattr(timing.speed_up, "__defaults__", (None, confidence, timing.MIN_EFFECT))
    rates, _ = outcomes("quick", 1.0, Noise(0.05, **POWER), draws=3000, seed=len("quick"))
    assert rates[timing.FASTER] + rates[timing.SLOWER] > 0.01


def test_the_interval_is_named_by_its_true_level():
    assert timing.CONFIDENCE == pytest.approx(0.999)
    assert timing.INTERVAL == "99.9 % interval"
    assert timing.percent(0.995) == "99.5 %" and timing.percent(0.95) == "95 %"


def test_looks_are_the_minimum_then_every_second_repeat_thinned_to_the_most_looks():
    assert look_points(4, 12) == [4, 6, 8, 10, 12]
    assert look_points(4, 4) == [4]
    assert look_points(4, 9) == [4, 6, 8, 9]
    spread = look_points(4, 40)
    assert len(spread) == timing.MAX_LOOKS and spread[0] == 4 and spread[-1] == 40
    with pytest.raises(ValueError, match="below the minimum"):
        look_points(6, 4)


def test_mirrored_rounds_put_every_variant_in_every_slot_and_cancel_a_slot_trend():
    labels = ["A", "B", "C"]
    orders = [visit_order(labels, r) for r in range(6)]
    assert orders[:2] == [["A", "B", "C"], ["C", "B", "A"]]
    for label in labels:
        slots = [order.index(label) for order in orders]
        assert sorted(slots) == [0, 0, 1, 1, 2, 2]  # every slot twice in six rounds
        assert all(a + b == 2 for a, b in zip(slots[::2], slots[1::2]))  # each pair averages the middle slot


def test_the_rule_waits_for_unclear_claims_and_stops_at_the_cap_or_the_budget():
    rule = StoppingRule(4, 12)
    rule.start()
    assert not rule.stop_on(3, lambda: True)  # never before the minimum
    assert rule.stop_on(4, lambda: True)
    assert not rule.stop_on(4, lambda: False) and not rule.stop_on(5, lambda: True)  # 5 is not a look
    assert rule.stop_on(12, lambda: False)  # the cap
    tight = StoppingRule(4, 12, time_budget_s=1.0)
    tight.start()
    tight.round_done(0.6)  # the next two rounds would take 1.2 s: past the budget
    assert tight.stop_on(4, lambda: False)


def test_a_slot_effect_is_taken_out_of_the_interval():
    """Mirrored rounds alternate which variant goes first; a 3 % slot effect then alternates the ratio. Regressed
    on the slot shift, the interval is as narrow as the noise without it."""
    rng = np.random.default_rng(0)
    shifts = np.array([1, -1] * 5, dtype=float)
    logs = 0.05 + 0.015 * shifts + rng.normal(0, 0.002, 10)
    base, other = np.exp(logs), np.ones(10)
    with_shift, without = timing.speed_up(base, other, shifts), timing.speed_up(base, other)
    assert with_shift.ratio == pytest.approx(np.exp(0.05), rel=0.01)
    assert with_shift.high / with_shift.low < 1.02 < without.high / without.low
