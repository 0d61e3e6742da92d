"""Comparisons closed one by one: a comparison keeps the answer of the first look where it is clear, one that the
budget's rounds could not answer gives them up to one that they could, and a variant that no open comparison waits
for leaves the later rounds (the real ``interleave``, rule and summary, with fake runners)."""
import numpy as np
import pandas as pd
from tqdm import tqdm

from optlab.core.measuring import timing
from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import resolve_device
from optlab.core.run.experiments import interleave, stopping_rule
from optlab.core.stats.sequential import ANSWERED, FUTILE_AFTER, OUT_OF_REACH, StoppingRule
from optlab.core.stats.summary import summarize_runs
from optlab.core.measuring.timing import out_of_reach, speed_up
from tests.test_stopping_failures import PHASES, PROFILE, runner


def run(labels: dict, comparisons: dict, seed: int = 0):
    rng = np.random.default_rng(seed)
    runners = {label: runner(label, rng, **options) for label, options in labels.items()}
    configs = {label: RunConfig(batch_size=16, width=0.125, num_workers=0) for label in labels}
    rule = stopping_rule(PROFILE, comparisons, PHASES)
    rounds = interleave(runners, configs, PHASES, PROFILE, resolve_device("cpu"), "t", "m",
                        {"train": 160, "test": 160}, 0, tqdm(disable=True), rule, flops=1)
    return rounds, summarize_runs(pd.DataFrame(rounds.rows), "A", references=comparisons), rule


def test_a_variant_answered_at_the_first_look_leaves_and_keeps_that_look_s_answer():
    comparisons = {"twice as slow": "A", "A again": "A"}
    rounds, summary, rule = run({"A": {}, "twice as slow": {"time_s": 0.02}, "A again": {"noise": 0.03}},
                                comparisons)
    answer = rule.closed[("m", "train", "twice as slow")]
    first = answer.repeats  # the first look that reads and finds it clear
    assert first < PROFILE.max_repeats and answer.verdict == timing.SLOWER
    assert rounds.left == {"twice as slow": first} and rounds.repeats == PROFILE.max_repeats
    assert f"twice as slow after {first}" in rounds.describe() and answer.why == ANSWERED
    rows = pd.DataFrame(rounds.rows)
    assert set(rows.loc[rows["variant"] == "twice as slow", "repeat"]) == set(range(first))
    assert set(rows.loc[rows["repeat"] >= first, "slot"]) == {0, 1}  # slots count the variants still running
    slow = summary[summary["variant"] == "twice as slow"].set_index("phase")
    kept = summary[summary["variant"] == "A again"].set_index("phase")
    assert set(slow["verdict"]) == {timing.SLOWER} and set(slow["n"]) == {first}
    for phase, n in kept["n"].items():  # an open comparison used every round; a closed one, those of its look
        closed = rule.closed.get(("m", phase, "A again"))
        assert n == (rounds.repeats if closed is None else closed.repeats)
    base = rows[(rows["variant"] == "A") & (rows["phase"] == "train")].sort_values("repeat")
    other = rows[(rows["variant"] == "twice as slow") & (rows["phase"] == "train")].sort_values("repeat")
    base = base.head(first)  # the rounds of the look that answered it
    again = speed_up(base["epoch_equiv_s"], other["epoch_equiv_s"], other["slot"].to_numpy() - base["slot"].to_numpy(),
                     confidence=answer.confidence)
    assert slow.loc["train", "ci_low"] == again.low and slow.loc["train", "ci_high"] == again.high
    assert ["train", "twice as slow", first] == rounds.looks["closed"][0][:3]


def test_a_variant_stays_while_an_open_comparison_uses_it_as_its_reference():
    comparisons = {"B": "A", "C": "B"}  # a stack: C is compared with B
    rounds, summary, rule = run({"A": {}, "B": {"time_s": 0.005}, "C": {"time_s": 0.005, "noise": 0.03}},
                                comparisons)
    by_variant = summary.set_index(["variant", "phase"])
    first = rule.closed[("m", "train", "B")].repeats
    assert by_variant.loc[("B", "train"), "verdict"] == timing.FASTER and first < rounds.repeats
    assert by_variant.loc[("B", "train"), "n"] == first
    assert "B" not in rounds.left and rounds.left.get("A") == first  # no open comparison needs A any more
    assert by_variant.loc[("C", "train"), "n"] == rounds.repeats


def test_the_needed_variants_are_those_of_open_comparisons():
    rows = [{"model": "m", "phase": "train", "variant": label, "repeat": r, "status": "ok", "epoch_equiv_s": t,
             "slot": 0} for r in range(4) for label, t in (("A", 1.0), ("B", 2.0 + 0.01 * r), ("C", 1.0 + 0.02 * r))]
    rule = StoppingRule(4, 12, comparisons={"B": "A", "C": "A"}, phases=("train",))
    rule.start()
    assert rule.needed(rows) == {"A", "B", "C"}
    rule.stop_after(4, rows)  # B is twice as slow in every round: answered; C drifts: open
    assert set(rule.closed) == {("m", "train", "B")} and rule.needed(rows) == {"A", "C"}


def test_the_budget_forecasts_the_rounds_after_variants_left_from_those_rounds():
    now = [0.0]
    rule = StoppingRule(4, 96, time_budget_s=20.0, clock=lambda: now[0])
    rule.start()
    for seconds in (3.0, 3.0, 3.0, 3.0):
        now[0] += seconds
        rule.round_done(seconds)
    rule.look(4)
    rule.variants_left()
    for seconds in (0.5, 0.5):
        now[0] += seconds
        rule.round_done(seconds)
    assert not rule.look(6).final  # 13 s spent: two rounds of 0.5 s fit, two of 3 s would not


def test_out_of_reach_needs_both_a_difference_and_a_match_beyond_the_rounds_possible():
    assert out_of_reach(1.005, 0.08, 24, 30)  # 0.5 % at 8 % noise: 30 rounds tell neither
    assert not out_of_reach(1.005, 0.08, 24, 5000)  # enough rounds would tell it is the same
    assert not out_of_reach(1.06, 0.08, 24, 30)  # 6 % could be told faster in 30
    assert not out_of_reach(1.015, 0.08, 24, 30)  # two standard errors more (4.9 %) could still reach faster
    assert not out_of_reach(1.0, float("nan"), 12, 30)  # no noise known: nothing to judge


def test_a_comparison_out_of_reach_leaves_the_rounds_to_one_within_reach():
    comparisons = {"near": "A", "three percent": "A"}
    labels = {"A": {"noise": 0.03}, "near": {"time_s": 0.01 / 1.003, "noise": 0.03},
              "three percent": {"time_s": 0.01 / 1.03, "noise": 0.03}}
    rounds, summary, rule = run(labels, comparisons, seed=1)  # a seed where both phases of "near" are given up
    near = {phase: closed for (_, phase, variant), closed in rule.closed.items() if variant == "near"}
    assert near and all(c.why == OUT_OF_REACH and c.verdict == timing.UNCLEAR and c.repeats >= FUTILE_AFTER
                        for c in near.values())
    assert rounds.left["near"] == max(c.repeats for c in near.values()) < rounds.repeats
    shown = summary[summary["variant"] == "near"].set_index("phase")["n"]
    assert all(shown[phase] == closed.repeats for phase, closed in near.items())


def rule_at(repeats: int) -> StoppingRule:
    """A rule whose budget allows 2 more rounds of 1 s after ``repeats`` rounds (up to 6 more rounds possible)."""
    now = [0.0]
    rule = StoppingRule(4, 96, time_budget_s=repeats + 2.0, clock=lambda: now[0])
    rule.start()
    for _ in range(repeats):
        now[0] += 1.0
        rule.round_done(1.0)
    return rule


def unclear(ratio: float, noise: float = 0.08) -> timing.SpeedUp:
    return timing.SpeedUp(ratio, ratio * 0.9, ratio * 1.1, timing.UNCLEAR, noise, scale=noise)


def key(variant: str, phase: str = "train") -> tuple:
    return ("m", phase, variant)


def test_the_rule_closes_out_of_reach_comparisons_only_while_another_is_within_reach():
    rule = rule_at(12)
    rule.comparisons = {"a": "A", "b": "A", "c": "A"}
    assert rule.rounds_possible(12) == 16  # 12 done, twice the 2 left
    rule.close({key("a"): unclear(1.004), key("b"): unclear(0.997)}, 12, 0.999)
    assert not rule.closed  # nothing within reach: both go on to the end
    rule.close({key("a"): unclear(1.004), key("b"): unclear(0.997), key("c"): unclear(1.15)}, 12, 0.999)
    assert {k: closed.why for k, closed in rule.closed.items()} == {key("a"): OUT_OF_REACH, key("b"): OUT_OF_REACH}
    early = rule_at(FUTILE_AFTER - 2)
    early.comparisons = rule.comparisons
    early.close({key("a"): unclear(1.004), key("c"): unclear(1.15)}, FUTILE_AFTER - 2, 0.999)
    assert not early.closed  # too few rounds to judge


def test_out_of_reach_closes_only_what_lets_a_variant_leave():
    """A claim out of reach in training is not closed while its variant still runs for an open test phase (closing
    it would free no round); closed with its test phase, the variant leaves, and it is."""
    rule = rule_at(12)
    rule.comparisons = {"near": "A", "gain": "A"}
    rule.close({key("near"): unclear(1.004), key("near", "test"): unclear(1.15), key("gain"): unclear(1.15)}, 12,
               0.999)
    assert not rule.closed
    rule.close({key("near"): unclear(1.004), key("near", "test"): unclear(0.997), key("gain"): unclear(1.15)}, 12,
               0.999)
    assert set(rule.closed) == {key("near"), key("near", "test")}


def test_an_a_a_control_phase_is_not_the_comparison_within_reach():
    """Out of reach gives rounds to a claim that could still be answered, not to an A/A control: with only the
    control phase within reach, nothing is given up."""
    rule = rule_at(12)
    rule.comparisons, rule.controls = {"near": "A", "gain": "A"}, ("test",)
    beside_control = {key("near"): unclear(1.004), key("near", "test"): unclear(0.997),
                      key("gain", "test"): unclear(1.15)}
    rule.close(beside_control, 12, 0.999)
    assert not rule.closed
    rule.close(beside_control | {key("gain"): unclear(1.15)}, 12, 0.999)
    assert set(rule.closed) == {key("near"), key("near", "test")}


def test_a_real_gain_whose_rounds_were_hit_is_not_given_up():
    """Out of reach reads the scale the trimmed interval sees: a 3 % gain whose plain round noise a few hit rounds
    raised to 30 % (trimmed: 3 %) stays open beside a 1.004 that is given up."""
    rule = rule_at(12)
    rule.comparisons = {"near": "A", "hit": "A"}
    hit = timing.SpeedUp(1.03, 0.99, 1.07, timing.UNCLEAR, noise=0.3, scale=0.03)
    rule.close({key("near"): unclear(1.004), key("hit"): hit}, 12, 0.999)
    assert set(rule.closed) == {key("near")}


def test_a_run_stopped_at_its_deadline_reads_its_open_comparisons_at_its_last_look():
    """The rounds after the last look were never looked at: an open comparison is read on the rounds and at the
    level of the last look that read (that look's share of the error rate), not once more, unspent, on every round."""
    from optlab.core.run.experiments import answer_columns
    from optlab.core.stats.sequential import Look
    from optlab.core.stats.summary import LOOK_CONFIDENCE, LOOK_ROUNDS

    rule = StoppingRule(4, 96, comparisons={"B": "A"})
    rule.start()
    rule.looks = [Look(4, 0.1, False, float("nan")), Look(6, 0.2, False, 0.9999)]
    row = {"phase": "train", "variant": "B"}
    assert answer_columns(rule, "m", row) == {LOOK_CONFIDENCE: 0.9999, LOOK_ROUNDS: None}  # read at the last look
    rule.past_deadline = True
    assert answer_columns(rule, "m", row) == {LOOK_CONFIDENCE: 0.9999, LOOK_ROUNDS: 6}
