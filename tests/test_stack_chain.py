"""A stack's "vs the step before" verdicts are comparisons the rule waited for: every step of a stack is compared with
the step before it, and under simulated noise (the real rule's looks and levels, its closing of answered and
out-of-reach comparisons and its variants leaving, vectorised over seeded draws) a step with no effect is called
faster or slower no more often than the rule promises, while a real 5 % step is found when the budget allows 48
rounds. The real ``interleave`` and ``step_by_step`` show each verdict row coming from a closed comparison."""
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from optlab.core.measuring import timing
from optlab.core.techniques.gpt import GPT_ALL_TOGETHER, gpt_all_together, gpt_stack
from optlab.core.knobs.profiles import get_profile
from optlab.core.stats.sequential import FUTILE_AFTER, StoppingRule
from optlab.core.stats.summary import NOT_WAITED, step_by_step
from optlab.core.techniques.registry import chained
from optlab.core.techniques.cnn import ALL_TOGETHER, COMPILE_STEP, WORKERS_STEP, all_together
from tests.noise import Noise, look_plan, simulated_round_times
from tests.test_answered_early import run

HEAVY = Noise(0.05, slot_effect=0.015, outlier_rate=0.05)  # the A/A noise of test_sequential
POWER = Noise(0.05, slot_effect=0.015, outlier_rate=0.005)  # its power noise
STEPS = (1.3, 1.0, 1.05, 1.0, 1.05, 1.3)  # each step's true speed-up over the step before
NO_EFFECT = [i for i, step in enumerate(STEPS) if step == 1.0]
FIVE_PERCENT = [i for i, step in enumerate(STEPS) if step == 1.05]
STACKS = {"CNN": ALL_TOGETHER, "GPT": gpt_all_together("gpt_tiny", skip=("+ bf16 autocast",))}


def upper_count(total: int, rate: float = timing.ERROR_RATE, tail: float = 1e-3) -> int:
    """The most false verdicts ``total`` comparisons at exactly ``rate`` give but in ``tail`` of seeded runs: more
    than that says the rate is above ``rate``."""
    def mass(k: int) -> float:
        return math.exp(math.lgamma(total + 1) - math.lgamma(k + 1) - math.lgamma(total - k + 1)
                        + k * math.log(rate) + (total - k) * math.log1p(-rate))
    count, above = 0, 1.0 - mass(0)
    while above > tail:
        count += 1
        above -= mass(count)
    return count


def read(times: dict, slots: dict, variant: str, reference: str, rounds: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """The verdict of ``variant`` against ``reference`` in each draw, read on its first ``rounds`` at ``levels``."""
    verdict = np.full(rounds.shape, timing.UNCLEAR, dtype=object)
    for n, level in {(int(n), float(c)) for n, c in zip(rounds, levels)}:
        chosen = (rounds == n) & (levels == level)
        logs = np.log(times[reference][chosen, :n]) - np.log(times[variant][chosen, :n])
        ratio, low, high, _ = timing.intervals(logs, slots[variant][:n] - slots[reference][:n], level)
        verdict[chosen] = timing.verdicts(ratio, low, high)
    return verdict


def needed_by(pairs: list[tuple[str, str]], labels: list[str], open_: np.ndarray) -> dict[str, np.ndarray]:
    """Per variant, the draws in which an open comparison (a column of ``open_``) still waits for it."""
    return {label: (open_ & np.array([label in pair for pair in pairs])).any(axis=1) for label in labels}


def freeing(pairs: list[tuple[str, str]], labels: list[str], beyond: np.ndarray, still: np.ndarray) -> np.ndarray:
    """``StoppingRule.freeing`` per draw: of the comparisons ``beyond`` reach, those whose closing (together) lets their
    variant or their reference leave, needed by none of ``still`` that stays open."""
    closing = beyond
    while True:
        needed = needed_by(pairs, labels, still & ~closing)
        frees = np.stack([~needed[variant] | ~needed[reference] for variant, reference in pairs], axis=1)
        if (closing & frees == closing).all():
            return closing
        closing = closing & frees


def step_before_verdicts(comparisons: dict[str, str], labels: list[str], noise: Noise, draws: int, budget: int,
                         seed: int = 0) -> np.ndarray:
    """Seeded runs of a stack whose steps have the true speed-ups ``STEPS`` over the step before, under the rule that
    waits for ``comparisons`` with a budget of ``budget`` one-second rounds: each step's verdict against the step before
    as ``step_by_step`` reads it (at the look that closed the step's own comparison, on that look's rounds that both
    sides ran), draws x steps. As the rule does, a comparison is closed at its first clear look, or given up out of
    reach where another is within reach and closing it lets a variant leave; a variant that no open comparison needs
    leaves the later rounds (which the simulated clock does not make cheaper)."""
    prof = get_profile("smoke")
    rule = StoppingRule(prof.repeats, prof.max_repeats, budget + 0.5)
    possible: list = []
    looks = look_plan(rule, 1.0, possible)
    speeds = dict(zip(labels, np.cumprod((1.0, *STEPS[:len(labels) - 1]))))
    times, slots = simulated_round_times(np.random.default_rng(seed), speeds, looks[-1].repeats, noise, draws)
    pairs = list(comparisons.items())
    open_ = np.ones((draws, len(pairs)), dtype=bool)
    levels, closed_at = np.zeros((draws, len(pairs))), np.zeros((draws, len(pairs)), dtype=int)
    ran = {label: np.full(draws, looks[-1].repeats) for label in labels}
    beyond_reach = np.vectorize(timing.out_of_reach)
    for look, reach in zip(looks, possible):
        if not look.reads:
            continue
        n, now = look.repeats, np.empty((4, draws, len(pairs)))
        for column, (variant, reference) in enumerate(pairs):
            logs = np.log(times[reference][:, :n]) - np.log(times[variant][:, :n])
            centre, error, _, df = timing.log_ratio_fit(logs, slots[variant][:n] - slots[reference][:n])
            now[:3, :, column] = timing.fit_interval(centre, error, df, look.confidence)
            now[3, :, column] = error * np.sqrt(n)  # the scale the trimmed interval sees
        answering = open_ & (np.isin(timing.verdicts(*now[:3]), timing.CLEAR) | look.final)
        still = open_ & ~answering
        if n >= FUTILE_AFTER and not look.final and still.any():
            beyond = np.zeros_like(still)
            beyond[still] = beyond_reach(now[0][still], now[3][still], n, reach)
            beyond &= (still & ~beyond).any(axis=1, keepdims=True)  # only while another is within reach
            answering |= freeing(pairs, labels, beyond, still)
        levels[answering], closed_at[answering] = look.confidence, n
        open_ &= ~answering
        needed = needed_by(pairs, labels, open_)
        for label in labels:
            ran[label] = np.where(~needed[label] & (ran[label] > n), n, ran[label])
    verdicts = []
    for before, after in zip(labels, labels[1:]):
        column = [variant for variant, _ in pairs].index(after)
        rounds = np.minimum(closed_at[:, column], np.minimum(ran[before], ran[after]))
        verdicts.append(read(times, slots, after, before, rounds, levels[:, column]))
    return np.stack(verdicts, axis=1)


def stated_counts() -> dict[str, tuple[int, int]]:
    """The false verdicts and comparisons book/methodology.md states for each stack's no-effect steps."""
    text = " ".join((Path(__file__).parents[1] / "book" / "methodology.md").read_text().split())
    found = re.search(r"in (\d+) of ([\d,]+) comparisons for the CNN stack and (\d+) of ([\d,]+) for the GPT's", text)
    assert found, "book/methodology.md states no figures for the stacks' no-effect steps"
    numbers = [int(value.replace(",", "")) for value in found.groups()]
    return {"CNN": (numbers[0], numbers[1]), "GPT": (numbers[2], numbers[3])}


@pytest.mark.parametrize("name", STACKS)
def test_a_no_effect_step_is_called_faster_or_slower_at_most_at_the_stated_rate(name):
    """Against the step before, a step with no effect is answered "same within 2 %" or "can't tell yet": a false
    "faster" or "slower" in at most 0.5 % of comparisons (the count bounded as a binomial at that rate), and the
    methodology page states the count these seeded runs give."""
    stack = STACKS[name]
    verdicts = step_before_verdicts(stack.comparisons, stack.labels, HEAVY, 4000, budget=48)
    steps = [i for i in NO_EFFECT if i < verdicts.shape[1]]
    false = int(np.isin(verdicts[:, steps], [timing.FASTER, timing.SLOWER]).sum())
    assert false <= upper_count(verdicts[:, steps].size)
    assert stated_counts()[name] == (false, verdicts[:, steps].size)


@pytest.mark.parametrize("stack", STACKS.values(), ids=STACKS.keys())
def test_a_real_five_percent_step_is_found_when_the_budget_allows_48_rounds(stack):
    """A step 5 % faster than the step before, at 5 % noise, is called faster in at least 95 % of runs: its own
    comparison is waited for, not read at the look of another on rounds cut short."""
    verdicts = step_before_verdicts(stack.comparisons, stack.labels, POWER, 1500, budget=48, seed=1)
    steps = [i for i in FIVE_PERCENT if i < verdicts.shape[1]]
    assert (verdicts[:, steps] == timing.FASTER).mean(axis=0).min() >= 0.95


@pytest.mark.parametrize("stack", [ALL_TOGETHER, all_together(skip=(WORKERS_STEP, COMPILE_STEP)), GPT_ALL_TOGETHER,
                                   gpt_all_together("gpt_tiny", skip=("+ bf16 autocast", "+ torch.compile"))],
                         ids=["CNN", "CNN on a CPU", "GPT", "GPT on a CPU"])
def test_every_step_of_a_stack_is_compared_with_the_step_before(stack):
    assert stack.comparisons == dict(zip(stack.labels[1:], stack.labels))


def test_chained_names_each_step_s_reference():
    assert chained(["a", "b", "c"]) == {"b": "a", "c": "b"} and [label for label, _ in gpt_stack()][:2] == \
        GPT_ALL_TOGETHER.labels[:2]


def test_each_step_s_verdict_row_comes_from_the_closed_comparison_against_the_step_before():
    """The real ``interleave`` and rule on a stack of four (the second step does nothing): each verdict against the step
    before is the one the rule closed for that step, on the same rounds, and the baseline column has none."""
    labels = {"A": {}, "B": {"time_s": 0.005}, "C": {"time_s": 0.005}, "D": {"time_s": 0.004}}
    comparisons = chained(list(labels))
    rounds, _, rule = run(labels, comparisons)
    table = step_by_step(pd.DataFrame(rounds.rows), list(labels), comparisons)
    for row in table.to_dict("records"):
        closed = rule.closed[("m", row["phase"], row["step"])]
        assert (row["verdict"], row["n"], row["waited for"]) == (closed.verdict, closed.repeats,
                                                                  comparisons[row["step"]])
        assert row["baseline_verdict"] == (closed.verdict if row["step"] == "B" else NOT_WAITED)
    assert set(table.loc[table["step"] == "C", "verdict"]) == {timing.SAME}


def test_a_record_whose_rule_waited_for_the_baseline_reads_its_steps_against_it():
    """A record made before stacks were chained (its rule waited for every step against the baseline): the verdicts
    shown are those against the baseline, and each step-before speed-up is an estimate, not waited for."""
    labels = {"A": {}, "B": {"time_s": 0.005}, "C": {"time_s": 0.005}}
    old = {"B": "A", "C": "A"}
    rounds, summary, rule = run(labels, old)
    table = step_by_step(pd.DataFrame(rounds.rows), list(labels), old).set_index(["phase", "step"])
    for (_, phase, step), closed in rule.closed.items():
        assert table.loc[(phase, step), "baseline_verdict"] == closed.verdict
        assert table.loc[(phase, step), "verdict"] == (closed.verdict if step == "B" else NOT_WAITED)
    assert table["vs previous"].notna().all()
