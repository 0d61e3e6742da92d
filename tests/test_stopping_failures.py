"""A chapter-shaped run through the real ``interleave``, rule and summary, with fake runners: a variant that fails
midway, and one whose time is not a number."""
import math

import numpy as np
import pandas as pd
import pytest
from tqdm import tqdm

from optlab.core.measuring import timing
from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import resolve_device
from optlab.core.run.experiments import interleave, stopping_rule
from optlab.core.measuring.loops import PhaseResult
from optlab.core.knobs.profiles import Profile
from optlab.core.stats.summary import summarize_runs

PROFILE = Profile("fake", ("m",), batch_size=16, width=0.125, warmup_steps=0, steps=2, test_steps=2, repeats=4,
                  max_repeats=12, num_workers=0)
PHASES = ("train", "test")


def runner(label: str, rng: np.random.Generator, fail_at: int | None = None, time_s: float = 0.01,
           noise: float = 0.006):
    """A variant's phases: ``noise`` around ``time_s``; out of memory in the training phase of round ``fail_at``."""
    calls = {"train": 0}

    def run(phase, profile, phase_seed):
        if phase == "train":
            calls["train"] += 1
            if calls["train"] == fail_at:
                raise RuntimeError("CUDA out of memory (simulated)")
        step = float(time_s * np.exp(rng.normal(0, noise)))
        return PhaseResult(startup_s=0.0, step_times_s=[step, step], wall_s=2 * step, peak_mem_mb=1.0)
    return run


def run(labels: dict, seed: int = 0):
    rng = np.random.default_rng(seed)
    runners = {label: runner(label, rng, **options) for label, options in labels.items()}
    configs = {label: RunConfig(batch_size=16, width=0.125, num_workers=0) for label in labels}
    comparisons = {label: "A" for label in labels if label != "A"}
    rule = stopping_rule(PROFILE, comparisons, PHASES)
    rounds = interleave(runners, configs, PHASES, PROFILE, resolve_device("cpu"), "t", "m",
                        {"train": 160, "test": 160}, 0, tqdm(disable=True), rule, flops=1)
    return rounds, summarize_runs(pd.DataFrame(rounds.rows), "A", references=comparisons), rule


def test_a_variant_that_fails_at_round_six_leaves_the_rule_and_shows_once_per_phase():
    rounds, summary, rule = run({"A": {}, "big": {"fail_at": 6, "noise": 0.3}, "A again": {}})  # unclear when it fails
    alone, alone_summary, _ = run({"A": {}, "A again": {}})
    looks = [look.repeats for look in rule.looks]
    # the other comparison settles as if the failed variant had never run: at its own look, not the cap
    assert rounds.repeats == alone.repeats < PROFILE.max_repeats and rounds.repeats == looks[-1] > 6
    assert rounds.stopped.startswith("every answer clear") and "big out of memory in round 6" in rounds.stopped
    other = summary[summary["variant"] == "A again"]
    assert set(other["verdict"]) == {timing.SAME} and set(other["n"]) == {rounds.repeats}  # read at a look point
    failed = summary[summary["variant"] == "big"]
    assert sorted(failed["phase"]) == ["test", "train"]  # once per phase
    assert set(failed["verdict"]) == {"out of memory"} and set(failed["n"]) == {5} and failed["speedup"].isna().all()
    after = pd.DataFrame(rounds.rows).query("repeat >= 6")  # the rounds after the one it failed in
    assert len(after) and set(after["slot"]) == {0, 1}  # slots count the variants still running
    assert rounds.looks["read_at"] == rule.confidence < 1
    record = rounds.record()  # what the stored record keeps beside the model's rounds
    assert record["interval"] == timing.INTERVAL and record["early_stopping"] == timing.EARLY_STOP_BIAS
    assert [look[0] for look in record["looks"]] == looks


def test_a_time_that_is_not_a_number_fails_its_comparison_with_a_reason():
    rounds, summary, _ = run({"A": {}, "A again": {}, "broken": {"time_s": math.nan}})
    broken = summary[summary["variant"] == "broken"]
    assert len(broken) == 2 and all(v.startswith(timing.BAD_TIME) for v in broken["verdict"])
    assert rounds.repeats < PROFILE.max_repeats  # the others settled without it


def test_a_zero_width_interval_is_refused_with_a_reason():
    result = timing.speed_up([1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5])
    assert result.verdict == timing.UNCLEAR and result.reason == timing.ZERO_WIDTH and math.isnan(result.low)


@pytest.mark.parametrize("times", [[1.0, 0.0], [1.0, -1.0], [1.0, math.inf]])
def test_non_positive_or_infinite_times_fail_the_comparison(times):
    result = timing.speed_up([1.0, 1.0], times)
    assert result.verdict == timing.BAD_TIME and "pair 2" in result.reason
