"""The sequential rule over simulated noise: error rates, power, coverage and bias (seeded, vectorised, no timing).

Noise: a 5 % random walk of the machine's speed between rounds, a slot effect (each later slot of a round faster),
Gaussian noise of each round's paired log ratio (1, 2, 5, 8 %) and outlier steps. The A/A bounds are checked under
heavy noise (1.5 % slot effect, 5 % of rounds with an outlier step); power under the same drift and slot effect with
outlier steps in 0.5 % of rounds. A budget is simulated in rounds: each round takes 1 s of a simulated clock.
"""
import dataclasses

import numpy as np
import pytest

from optlab.core.measuring import timing
from optlab.core.knobs.profiles import get_profile
from optlab.core.stats.sequential import StoppingRule, look_points, visit_order
from tests.noise import Noise, look_plan, sequential_outcomes

HEAVY = dict(slot_effect=0.015, outlier_rate=0.05)
POWER = dict(slot_effect=0.015, outlier_rate=0.005)
A_A_DRAWS = 20_000
# What a rate of at most 0.5 % can show in 20,000 runs: 0.5 % plus two standard errors (0.6 %). A rule at exactly the
# stated rate (one look at 99.5 %) passes; one at 1 % (about 200 false verdicts where 0.5 % gives 100) fails.
A_A_ALLOWED = timing.ERROR_RATE + 2 * np.sqrt(timing.ERROR_RATE * (1 - timing.ERROR_RATE) / A_A_DRAWS)
BUDGETS = [4, 6, 12, 24, 48, None]  # rounds the budget allows (None: up to the smoke profile's cap of 96)


def rule_for(budget: "int | None", cls=StoppingRule, **options) -> StoppingRule:
    prof = get_profile("smoke")
    return cls(prof.repeats, prof.max_repeats, float("inf") if budget is None else budget + 0.5, **options)


def false_rate(outcome: dict) -> float:
    """The share of runs with at least one false "faster" or "slower" (one comparison: its own rate)."""
    return float(np.isin(outcome["verdict"], [timing.FASTER, timing.SLOWER]).any(axis=1).mean())


def a_a_rate(rule: StoppingRule, sd: float = 0.05, seed: int = 0) -> float:
    return false_rate(sequential_outcomes(np.random.default_rng(seed), {"A": 1.0, "B": 1.0}, rule,
                                          Noise(sd, **HEAVY), A_A_DRAWS))


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"{b or 'cap'} rounds")
@pytest.mark.parametrize("sd", [0.05, 0.08], ids=["5 % noise", "8 % noise"])
def test_a_a_comparisons_say_faster_or_slower_at_most_at_the_stated_rate(budget, sd):
    """However many looks a budget allows, one A/A comparison is called faster or slower in at most 0.5 % of runs."""
    assert a_a_rate(rule_for(budget), sd) <= A_A_ALLOWED


class WholeLevelEveryLook(StoppingRule):
    """A broken rule: every look reads at the whole error rate (no split over the looks)."""

    def look(self, repeats):
        look = super().look(repeats)
        return look if look is None or not look.reads else dataclasses.replace(look, confidence=timing.CONFIDENCE)


class FixedLevelEveryRepeat(StoppingRule):
    """A broken rule: a look after every repeat, each at a fixed-n level (the whole error rate at every look)."""

    def look(self, repeats):
        look = super().look(repeats)
        return look if look is None else dataclasses.replace(look, confidence=timing.CONFIDENCE)


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
@pytest.mark.parametrize("broken", [WholeLevelEveryLook, FixedLevelEveryRepeat])
def test_the_same_simulation_catches_a_rule_without_the_split(broken):
    """The A/A check above has the power to fail: these rules, built beside the real one, break it."""
    assert a_a_rate(rule_for(None, broken, look_every=1)) > A_A_ALLOWED


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
def test_looking_after_every_repeat_keeps_the_rate_when_the_error_is_spent():
    """Error spending holds for any number of looks: the real rule looking after every repeat stays within it."""
    assert a_a_rate(rule_for(None, look_every=1)) <= A_A_ALLOWED


@pytest.mark.parametrize("budget", [12, None], ids=["12 rounds", "cap"])
def test_a_page_of_seven_a_a_variants_stays_within_the_page_bound(budget):
    """Seven copies of the baseline on one page (one model, one phase): the chance that any says faster or slower
    stays within what the page states, seven times the per-comparison rate."""
    copies = {"A": 1.0} | {f"A, copy {i}": 1.0 for i in range(1, 8)}
    outcome = sequential_outcomes(np.random.default_rng(7), copies, rule_for(budget), Noise(0.05, **HEAVY), 4000)
    page = false_rate(outcome)
    print(f"7 A/A variants, {budget or 'cap'} rounds: a false verdict on {page:.4f} of pages "
          f"(stated bound {timing.page_bound(7):.3f})")
    assert page <= timing.page_bound(7)


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
@pytest.mark.parametrize("budget", [12, None], ids=["12 rounds", "cap"])
def test_an_a_a_comparison_beside_one_answered_early_keeps_the_stated_rate(budget):
    """Comparisons are answered one by one: a clear 1.3 is answered at an early look while an A/A copy of the
    baseline goes on to the later looks, where it is still called faster or slower in at most 0.5 % of runs."""
    outcome = sequential_outcomes(np.random.default_rng(11), {"A": 1.0, "clear": 1.3, "A again": 1.0},
                                  rule_for(budget), Noise(0.05, **HEAVY), A_A_DRAWS)
    copy = np.isin(outcome["verdict"][:, 1], [timing.FASTER, timing.SLOWER]).mean()
    print(f"A/A copy beside an early answer, {budget or 'cap'} rounds: false verdicts {copy:.4f}")
    assert np.mean(outcome["verdict"][:, 0] == timing.FASTER) > 0.99 and copy <= A_A_ALLOWED


@pytest.mark.parametrize("sd,budget,hit", [(0.05, 24, False), (0.08, 24, False), (0.08, 48, False), (0.04, 24, True),
                                           (0.04, 48, True)])
def test_giving_up_what_is_out_of_reach_costs_a_real_gain_beside_it_almost_nothing(sd, budget, hit):
    """A comparison out of reach of the rounds left is closed as can't tell yet while another could still answer: a
    true 5 % gain beside a true 1.003 is called faster about as often as alone (within a point of 4,000 runs), also
    where rounds are hit by other work (read on the trimmed interval's scale, the gain is not given up for a hit), and
    the 1.003 is given up in many runs. (The rounds growing cheaper once a variant leaves is not simulated: that gain
    is measured live.)"""
    noise = Noise(sd, **(HIT if hit else POWER))
    both = sequential_outcomes(np.random.default_rng(5), {"A": 1.0, "gain": 1.05, "near": 1.003}, rule_for(budget),
                               noise, 4000)
    alone = sequential_outcomes(np.random.default_rng(5), {"A": 1.0, "gain": 1.05}, rule_for(budget), noise, 4000)
    beside, by_itself = (np.mean(o["verdict"][:, 0] == timing.FASTER) for o in (both, alone))
    print(f"1.05 at {sd:.0%} noise{' with hit rounds' if hit else ''}, {budget} rounds: faster {beside:.3f} beside a "
          f"1.003 given up in {both['given_up'][:, 1].mean():.3f} of runs, {by_itself:.3f} alone")
    assert beside >= by_itself - 0.01 and both["given_up"][:, 1].mean() > 0.1
    assert not (both["verdict"][:, 0] == timing.SLOWER).any()


FIXED_DRAWS = 200_000
FIXED_ALLOWED = timing.ERROR_RATE + 2 * np.sqrt(timing.ERROR_RATE * (1 - timing.ERROR_RATE) / FIXED_DRAWS)


@pytest.mark.beside_the_book_build  # slow (200,000 runs a cell): it fills the wait for the book
@pytest.mark.parametrize("variants", [2, 5, 8])
def test_a_fixed_run_keeps_the_level_whatever_the_number_of_variants(variants):
    """A fixed run of 10 rounds (``--repeats 10 --max-repeats 10``: one look, at 99.5 %) of copies of the baseline
    under Gaussian noise and a slot effect: every comparison is called faster or slower in at most 0.5 % of runs
    (plus two standard errors of 200,000). With 8 variants the mirrored rotations give some comparisons shifts of 7
    and -7 beside rounds of 1 and -1; the fit is pinned to those two rounds, and without the leverage correction the
    trimmed interval read 0.60 % there."""
    copies = {"A": 1.0} | {f"copy {i}": 1.0 for i in range(1, variants)}
    rule = StoppingRule(10, 10)
    assert [look.confidence for look in look_plan(rule)] == [pytest.approx(timing.CONFIDENCE)]
    outcome = sequential_outcomes(np.random.default_rng(0), copies, rule, Noise(0.05, outlier_rate=0.0), FIXED_DRAWS)
    rates = np.isin(outcome["verdict"], [timing.FASTER, timing.SLOWER]).mean(axis=0)
    print(f"fixed run, {variants} variants: false verdicts " + " ".join(f"{rate:.4f}" for rate in rates))
    assert rates.max() <= FIXED_ALLOWED


def outcomes(speed_up: float, sd: float, budget: "int | None", draws: int = 2000, seed: int = 5) -> dict:
    return sequential_outcomes(np.random.default_rng(seed), {"A": 1.0, "B": speed_up}, rule_for(budget),
                               Noise(sd, **POWER), draws)


def test_a_true_five_percent_gain_at_two_percent_noise_is_found_in_twelve_rounds():
    found = outcomes(1.05, 0.02, 12)
    print(f"5 % gain, 2 % noise, 12 rounds: faster {np.mean(found['verdict'] == timing.FASTER):.3f}, "
          f"repeats {found['repeats'].mean():.1f}")
    assert np.mean(found["verdict"] == timing.FASTER) >= 0.80


def test_no_effect_at_one_percent_noise_is_called_the_same_within_twelve_rounds():
    found = outcomes(1.0, 0.01, 12, seed=1)
    assert np.mean(found["verdict"] == timing.SAME) >= 0.80


def test_the_rounds_a_budget_allows_answer_at_the_cpu_s_noise():
    """At 8 % noise (the CPU book's median) a true 5 % gain is rarely told in 12 rounds; in the 48 a cheap comparison's
    budget allows it mostly is, and never called slower."""
    short, long = outcomes(1.05, 0.08, 12), outcomes(1.05, 0.08, 48)
    short_rate, long_rate = (np.mean(o["verdict"] == timing.FASTER) for o in (short, long))
    print(f"5 % gain at 8 % noise: faster in {short_rate:.3f} (12 rounds), {long_rate:.3f} (48)")
    assert long_rate >= 0.6 and long_rate > short_rate + 0.3 and not (long["verdict"] == timing.SLOWER).any()


@pytest.mark.parametrize("sd", [0.02, 0.05, 0.08])
def test_the_reported_interval_holds_the_true_speed_up_at_its_stated_level(sd):
    found = outcomes(1.05, sd, 12, draws=A_A_DRAWS, seed=3)
    covered = np.mean((found["low"] <= 1.05) & (1.05 <= found["high"]))
    assert covered >= timing.CONFIDENCE


def test_an_early_stop_leans_toward_its_answer_by_what_the_docs_say():
    """Runs of a true 1.05 called faster read high: about 1 % at 5 % noise and 3.5 % at 8 % in 12 rounds, about 1 %
    at 8 % and 2.7 % at 12 % in 48; all runs together hardly at all (timing.EARLY_STOP_BIAS, the methodology
    page)."""
    def bias(sd, budget):
        found = outcomes(1.05, sd, budget, draws=20_000, seed=3)
        faster = found["verdict"][:, 0] == timing.FASTER
        return (np.exp(np.log(found["ratio"][faster, 0] / 1.05).mean()) - 1,
                np.exp(np.log(found["ratio"][:, 0] / 1.05).mean()) - 1)
    (at_5, all_5), (at_8, _) = bias(0.05, 12), bias(0.08, 12)
    (long_8, _), (long_12, _) = bias(0.08, 48), bias(0.12, 48)
    print(f"bias among 'faster': {at_5:+.4f} (5 %, 12 rounds), {at_8:+.4f} (8 %, 12), {long_8:+.4f} (8 %, 48), "
          f"{long_12:+.4f} (12 %, 48)")
    assert 0.01 <= at_5 <= at_8 <= 0.04 and 0 < long_8 < 0.012 and 0.02 <= long_12 <= 0.035 and abs(all_5) < 0.003


def test_looks_are_the_minimum_then_every_second_repeat_and_the_cap():
    assert look_points(4, 12) == [4, 6, 8, 10, 12]
    assert look_points(4, 4) == [4]
    assert look_points(4, 9) == [4, 6, 8, 9]
    with pytest.raises(ValueError, match="below the minimum"):
        look_points(6, 4)


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_shares_of_the_looks_add_up_to_the_error_rate(budget):
    """Whatever the budget, the looks' shares add up to the whole rate by the last look and never past it; early
    looks at a few rounds of a long run read almost nothing."""
    looks = look_plan(rule_for(budget))
    shares = [1 - look.confidence for look in looks if look.reads]
    assert looks[-1].final and looks[-1].fraction == 1.0
    assert sum(shares) == pytest.approx(timing.ERROR_RATE, rel=1e-9) and all(share > 0 for share in shares)
    if budget is None:
        assert not looks[0].reads  # 4 rounds of 96


def test_the_rule_waits_for_unclear_claims_and_stops_at_the_cap_or_the_budget():
    rule = StoppingRule(4, 12)
    rule.start()
    assert not rule.stop_on(3, lambda level: True)  # never before the minimum
    assert rule.stop_on(4, lambda level: True)
    rule.start()
    assert not rule.stop_on(4, lambda level: False) and not rule.stop_on(5, lambda level: True)  # 5 is not a look
    assert rule.stop_on(12, lambda level: False)  # the cap
    now = [0.0]
    tight = StoppingRule(4, 48, time_budget_s=1.0, clock=lambda: now[0])
    tight.start()
    now[0] = 0.3
    tight.round_done(0.4)  # the next two rounds would take 0.8 s: past the budget
    assert tight.stop_on(4, lambda level: False)
    assert tight.looks[-1].final and tight.confidence == pytest.approx(1 - timing.ERROR_RATE)


def test_a_run_with_no_comparison_to_wait_for_stops_at_its_first_look():
    """Only the baseline timed (every variant has no effect on this device, or failed): no round after the minimum,
    although the first looks of a long run read nothing."""
    rows = [{"model": "m", "phase": "train", "variant": "A", "status": "ok", "repeat": r, "epoch_equiv_s": 1.0}
            for r in range(4)]
    alone = StoppingRule(4, 48, comparisons={})
    alone.start()
    assert not alone.waits_for(rows) and alone.stop_after(4, rows) and not alone.looks[-1].reads
    waiting = StoppingRule(4, 48, comparisons={"B": "A"})
    waiting.start()
    with_b = rows + [{**row, "variant": "B", "epoch_equiv_s": 1.5} for row in rows]
    assert waiting.waits_for(with_b) and not waiting.stop_after(4, with_b)  # 4 rounds of 48 read nothing yet
    assert not waiting.waits_for(rows)  # B not timed: nothing left to wait for
    assert not StoppingRule(4, 48).stop_on(3, lambda level: True, waiting=lambda: False)  # never before the minimum


def test_the_budget_forecasts_from_the_rounds_after_the_first():
    """A first round that paid one-off costs (3 s here) does not end a run whose later rounds fit the budget."""
    now = [0.0]
    rule = StoppingRule(4, 48, time_budget_s=5.0, clock=lambda: now[0])
    rule.start()
    for seconds in (3.0, 0.2, 0.2, 0.2):
        rule.round_done(seconds)
    now[0] = 3.6
    assert not rule.stop_on(4, lambda level: False)  # 3.6 s + 2 x 0.2 s fits; 2 x 3 s would not
    rule.round_done(0.2), rule.round_done(0.9)
    now[0] = 4.7
    assert rule.stop_on(6, lambda level: False) and rule.looks[-1].final  # 4.7 s + 2 x 0.9 s does not fit


def test_mirrored_rounds_put_every_variant_in_every_slot_and_cancel_a_slot_trend():
    labels = ["A", "B", "C"]
    orders = [visit_order(labels, r) for r in range(6)]
    assert orders[:2] == [["A", "B", "C"], ["C", "B", "A"]]
    for label in labels:
        slots = [order.index(label) for order in orders]
        assert sorted(slots) == [0, 0, 1, 1, 2, 2]  # every slot twice in six rounds
        assert all(a + b == 2 for a, b in zip(slots[::2], slots[1::2]))  # each pair averages the middle slot


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
    assert with_shift.noise == pytest.approx(0.002, rel=0.5) and without.noise > 0.01


def test_the_estimate_is_the_geometric_mean_after_whole_pairs_and_at_shift_zero_otherwise():
    """What timing.speed_up and the methodology page say: whole mirrored pairs give the geometric mean; an odd count
    gives the regression's value at a shift of 0, the geometric mean less the slot effect times the mean shift."""
    logs = np.log([1.02, 1.05, 1.01, 1.06, 1.03])
    shifts = np.array([1, -1, 1, -1, 1], dtype=float)
    even = timing.speed_up(np.exp(logs[:4]), np.ones(4), shifts[:4])
    assert even.ratio == pytest.approx(np.exp(logs[:4].mean()))
    odd = timing.speed_up(np.exp(logs), np.ones(5), shifts)
    slope = np.polyfit(shifts, logs, 1)[0]
    assert odd.ratio == pytest.approx(np.exp(logs.mean() - slope * shifts.mean()))
    assert odd.ratio != pytest.approx(np.exp(logs.mean()), rel=1e-4)


HIT = dict(slot_effect=0.015, outlier_rate=0.07, steps=4)  # about 1 round in 7: one variant 25-100 % slower


@pytest.mark.parametrize("budget", [12, 24, None], ids=lambda b: f"{b or 'cap'} rounds")
def test_rounds_hit_by_other_work_keep_the_a_a_rate(budget):
    """Rounds in which one variant was slowed by other work (as on a shared 2-core machine) do not raise the A/A rate
    of the trimmed interval above the stated one."""
    outcome = sequential_outcomes(np.random.default_rng(0), {"A": 1.0, "B": 1.0}, rule_for(budget),
                                  Noise(0.04, **HIT), A_A_DRAWS)
    assert false_rate(outcome) <= A_A_ALLOWED


def test_the_trim_finds_a_real_gain_through_rounds_hit_by_other_work(monkeypatch):
    """A true 5 % gain under such rounds: the trimmed mean calls it faster in most runs of a cheap comparison's 48
    rounds, the plain mean in few (each hit round widens its interval), and neither ever calls it slower."""
    def faster_share() -> tuple[float, bool]:
        found = sequential_outcomes(np.random.default_rng(1), {"A": 1.0, "B": 1.05}, rule_for(48), Noise(0.04, **HIT),
                                    4000)
        return float(np.mean(found["verdict"] == timing.FASTER)), bool((found["verdict"] == timing.SLOWER).any())

    trimmed, trimmed_slower = faster_share()
    monkeypatch.setattr(timing, "TRIM", 0.0)
    plain, plain_slower = faster_share()
    print(f"5 % gain through hit rounds: faster in {trimmed:.3f} trimmed, {plain:.3f} plain")
    assert trimmed >= 0.6 and trimmed > plain + 0.3 and not (trimmed_slower or plain_slower)


@pytest.mark.beside_the_book_build  # slow: it fills the wait for the book
@pytest.mark.parametrize("dependence", [dict(rho=0.3), dict(burst=5)], ids=["AR(1) 0.3", "a burst of 5 rounds"])
def test_dependent_rounds_are_flagged_far_more_often_than_independent_ones(dependence):
    """The rule assumes independent rounds. Where each variant's noise carries from round to round, or one variant is
    slowed by other work for 5 rounds in a row, an A/A comparison's lag-1 autocorrelation is flagged
    (timing.dependent_rounds) several times as often as under independent rounds, where it is flagged in at most 3 %
    of comparisons (the threshold is about the 99th percentile there); the methodology page states the A/A rates."""
    def flagged(noise: Noise) -> float:
        found = sequential_outcomes(np.random.default_rng(0), {"A": 1.0, "B": 1.0}, rule_for(48), noise, 4000)
        return float(np.mean([timing.dependent_rounds(a, n) for a, n in zip(found["autocorrelation"][:, 0],
                                                                              found["rounds"][:, 0])]))
    independent, dependent = flagged(Noise(0.05, **HEAVY)), flagged(Noise(0.05, **HEAVY, **dependence))
    print(f"flagged: {dependent:.3f} with {dependence}, {independent:.3f} independent")
    assert independent <= 0.03 and dependent >= 5 * independent


def test_the_rounds_kept_beside_the_trim_are_those_a_stable_sort_ranks_inside_ties_included():
    """The rounds whose deviations the slot fit scales (every round not cut) are found without a sort; where rounds
    tie with a cut's boundary (times rounded alike), each tied round is kept by its place among the ties, as a stable
    argsort ranks it: which tied round is kept changes the scale when the rounds' leverage differs."""
    from optlab.core.measuring.timing import _ranked_between

    rng = np.random.default_rng(0)
    for n in (3, 10, 24, 96):
        cut = int(timing.TRIM * n) if n >= 10 else 0
        for values in (rng.integers(0, 3, (2000, n)).astype(float), rng.normal(size=(2000, n))):
            ordered = np.sort(values, axis=-1)
            rank = np.argsort(np.argsort(values, axis=-1, kind="stable"), axis=-1, kind="stable")
            kept = _ranked_between(values, ordered[:, cut:cut + 1], ordered[:, n - cut - 1:n - cut], cut, n - cut)
            assert np.array_equal(kept, (rank >= cut) & (rank < n - cut)), n
            one = _ranked_between(values[0], ordered[0, cut:cut + 1], ordered[0, n - cut - 1:n - cut], cut, n - cut)
            assert np.array_equal(one, kept[0])
