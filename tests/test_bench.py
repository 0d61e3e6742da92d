"""`make bench`'s options: the A/A part runs any number of copies of one configuration a page can hold."""
import argparse
import math
import re

import pytest

from benchmarks import bench, noise


@pytest.mark.parametrize("copies", [2, 7])
def test_an_a_a_run_holds_the_copies_asked_for_each_the_baseline_again(copies):
    experiment = bench.a_a_experiment(copies)
    assert len(experiment.variants) == copies
    assert all(knobs == {} for _, knobs in experiment.variants)
    assert bench.arguments(["--only", "a-a", "--copies", str(copies)]).copies == copies


@pytest.mark.parametrize("workload, models", [("cifar", ("resnet18", "mobilenet_v2")), ("gpt", ("gpt_tiny",))])
def test_an_a_a_run_times_copies_of_either_workload(workload, models):
    experiment = bench.a_a_experiment(3, workload)
    assert experiment.workload == workload and experiment.phases == ("train", "test")
    assert experiment.default_models(bench.get_profile("smoke")) == models
    assert bench.arguments(["--only", "a-a", "--workload", workload]).workload == workload


def test_an_unknown_a_a_workload_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        bench.arguments(["--workload", "bert"])
    error = capsys.readouterr().err
    assert "argument --workload: invalid choice: 'bert'" in error
    assert all(f"'{name}'" in error for name in ("cifar", "gpt"))


@pytest.mark.parametrize("copies", ["1", "9", "0"])
def test_a_copy_count_a_page_cannot_hold_is_refused_with_the_limits(copies, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.arguments(["--copies", copies])
    assert exit_.value.code == 2
    assert f"--copies must be from 2 to {bench.MAX_COPIES}" in capsys.readouterr().err


@pytest.mark.parametrize("text, shape", [("1+1", (1, 1)), ("0+2", (0, 2)), ("3+24", (3, 24))])
def test_a_round_shape_reads_warm_up_plus_timed_steps(text, shape):
    assert noise.round_shape(text) == shape


@pytest.mark.parametrize("text, message", [("2", "a round shape is W+S (warm-up + timed steps, e.g. 1+1), got '2'"),
                                           ("a+b", "a round shape is W+S"),
                                           ("1+0", "needs 0-100000 warm-up and 1-100000 timed steps"),
                                           ("-1+2", "needs 0-100000 warm-up and 1-100000 timed steps")])
def test_a_bad_round_shape_says_what_is_allowed(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        noise.round_shape(text)


@pytest.mark.parametrize("workload, model", [("cifar", "resnet18"), ("gpt", "gpt_tiny")])
def test_the_noise_benchmark_times_two_copies_of_either_workload(workload, model):
    experiment, chosen = noise.a_a_experiment(workload)
    assert (experiment.workload, chosen) == (workload, model)
    rows = noise.measure(runs=1, rounds=3, settings=["as set"], workload=workload)
    assert set(rows["phase"]) == {"train", "test"} and set(rows["shape"]) == {"1+3"}  # the smoke profile's lockstep round
    assert (rows["noise"] >= 0).all() and (rows["round s"] > 0).all()


@pytest.mark.parametrize("false, total", [(0, 12), (2, 12), (3, 36), (12, 12), (5, 200)])
def test_the_rate_bounds_hold_the_rate_seen_and_are_exact_binomial_tails(false, total):
    low, high = bench.lower_bound(false, total), bench.upper_bound(false, total)
    assert 0.0 <= low <= false / total <= high <= 1.0
    tail = lambda p, ks: sum(math.comb(total, k) * p ** k * (1 - p) ** (total - k) for k in ks)
    if false:
        assert tail(low, range(false, total + 1)) == pytest.approx(0.05, abs=1e-6)
    if false < total:
        assert tail(high, range(false + 1)) == pytest.approx(0.05, abs=1e-6)


def test_a_rate_over_its_target_is_called_over_only_where_chance_cannot_explain_it():
    assert bench.rate_status(1, 12, 0.12) == "within target"
    assert bench.rate_status(2, 12, 0.12).startswith("above target by no more than chance")
    assert bench.rate_status(8, 12, 0.12) == "OVER TARGET"
