"""Comparisons answered one by one: a comparison keeps the answer of the first look where it is clear, and a variant
that no open comparison waits for leaves the later rounds, so the budget goes to the answers still missing (the real
``interleave``, rule and summary, with fake runners)."""
import numpy as np
import pandas as pd
from tqdm import tqdm

from optlab.core import timing
from optlab.core.config import RunConfig
from optlab.core.device import resolve_device
from optlab.core.experiments import interleave, stopping_rule
from optlab.core.sequential import StoppingRule
from optlab.core.summary import summarize_runs
from optlab.core.timing import speed_up
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
    answer = rule.answered[("m", "train", "twice as slow")]
    first = answer.repeats  # the first look that reads and finds it clear
    assert first < PROFILE.max_repeats and answer.verdict == timing.SLOWER
    assert rounds.left == {"twice as slow": first} and rounds.repeats == PROFILE.max_repeats
    assert f"twice as slow after {first}" in rounds.describe()
    rows = pd.DataFrame(rounds.rows)
    assert set(rows.loc[rows["variant"] == "twice as slow", "repeat"]) == set(range(first))
    assert set(rows.loc[rows["repeat"] >= first, "slot"]) == {0, 1}  # slots count the variants still running
    slow = summary[summary["variant"] == "twice as slow"].set_index("phase")
    kept = summary[summary["variant"] == "A again"].set_index("phase")
    assert set(slow["verdict"]) == {timing.SLOWER} and set(slow["n"]) == {first}
    assert set(kept["n"]) == {rounds.repeats}  # the open comparison used every round
    base = rows[(rows["variant"] == "A") & (rows["phase"] == "train")].sort_values("repeat")
    other = rows[(rows["variant"] == "twice as slow") & (rows["phase"] == "train")].sort_values("repeat")
    base = base.head(first)  # the rounds of the look that answered it
    again = speed_up(base["epoch_equiv_s"], other["epoch_equiv_s"], other["slot"].to_numpy() - base["slot"].to_numpy(),
                     confidence=answer.confidence)
    assert slow.loc["train", "ci_low"] == again.low and slow.loc["train", "ci_high"] == again.high
    assert ["train", "twice as slow", first] == rounds.looks["answered"][0][:3]


def test_a_variant_stays_while_an_open_comparison_uses_it_as_its_reference():
    comparisons = {"B": "A", "C": "B"}  # a stack: C is compared with B
    rounds, summary, rule = run({"A": {}, "B": {"time_s": 0.005}, "C": {"time_s": 0.005, "noise": 0.03}},
                                comparisons)
    by_variant = summary.set_index(["variant", "phase"])
    first = rule.answered[("m", "train", "B")].repeats
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
    assert set(rule.answered) == {("m", "train", "B")} and rule.needed(rows) == {"A", "C"}


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
