"""Tensor and sequence parallelism against one process and against the formulas, and the planner built on them.

One real 2-process gloo job (the ``study`` fixture, about 40 s with its imports on 2 cores) holds every CPU
measurement of chapter 19 against the formulas the planner uses; the rest run in this process.
"""
import pytest
import torch

from optlab.core.errors import OptlabError
from optlab.core.gpt.transformer import GPT, GPTConfig, parameter_count
from optlab.studies.parallel import formulas, planner
from optlab.studies.parallel.tensor import group_heads, ungroup_heads
from optlab.studies.parallel.tensor_study import CONFIG, PARITY_TOLERANCE, tensor_study

LAUNCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def study():
    return tensor_study(nproc=2, steps=2, rounds=1, timeout=LAUNCH_TIMEOUT_S)


@pytest.mark.beside_the_book_build  # slow, in processes of its own: it fills the wait for the book
def test_two_ranks_train_as_one_process_does(study):
    parity = study.parity_table()
    assert list(parity.index) == ["TP", "TP + SP"]
    assert (parity[["loss", "gradient", "parameter"]] < PARITY_TOLERANCE).all().all()
    assert (parity["moved by training"] > 1e3 * PARITY_TOLERANCE).all()


@pytest.mark.beside_the_book_build
def test_every_collective_and_byte_counted_equals_the_formula(study):
    table = study.collectives_table()
    assert set(table.index.get_level_values("setup")) == {"TP", "TP + SP"}
    assert (table["calls"] == table["formula calls"]).all() and (table["bytes"] == table["formula bytes"]).all()
    assert (table["calls"] > 0).all()


@pytest.mark.beside_the_book_build
def test_what_each_rank_holds_equals_the_formula(study):
    held = study.memory_table()
    assert (held["parameter bytes"] == held["parameters, formula"]).all()
    assert (held["activation bytes"] == held["activations, formula"]).all()
    assert held.loc["TP", "parameter bytes"] < held.loc["one process", "parameter bytes"]


@pytest.mark.parametrize("name", ["gpt2_small", "7b"])
def test_the_parameter_formula_counts_the_real_model(name):
    config = planner.MODELS[name]
    with torch.device("meta"):
        model = GPT(config)
    assert formulas.model_parameters(config) == parameter_count(model)


def test_head_grouping_gives_each_rank_its_own_q_k_and_v():
    c, tp = 6, 3  # rows 0..17 are [q | k | v], 6 each; rank r must get rows 2r, 2r+1 of q, of k and of v
    weight = torch.arange(3 * c, dtype=torch.float32).reshape(3 * c, 1)
    grouped = group_heads(weight, tp)
    assert grouped[:6, 0].tolist() == [0, 1, 6, 7, 12, 13]
    assert torch.equal(ungroup_heads(grouped, tp), weight)


def test_the_bubble_formula():
    assert formulas.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert formulas.bubble_fraction(4, 8, virtual=2) == pytest.approx(1.5 / 9.5)
    assert formulas.bubble_fraction(1, 8) == 0


def test_ring_bytes():
    assert formulas.ring_bytes_sent("all-reduce", 1000, 4) == 1500
    assert formulas.ring_bytes_sent("all-gather", 1000, 4) == 750
    assert formulas.ring_bytes_sent("all-reduce", 1000, 1) == 0


def test_the_plan_says_what_fits_on_eight_gpus():
    plan = planner.parallel_plan("7b", gpus=8, gpu_memory=80, interconnect="nvlink4")
    assert not plan.loc["DP 8", "fits"] and plan.loc["FSDP 8", "fits"] and plan.loc["TP+SP 8", "fits"]
    gathered = 2 * planner.VALUE_BYTES * formulas.block_parameters(planner.MODELS["7b"]) / 1e9  # two blocks
    assert plan.loc["FSDP 8", "state GB"] - gathered == pytest.approx(plan.loc["DP 8", "state GB"] / 8, abs=1e-3)
    assert plan.loc["TP+SP 8", "activations GB"] < plan.loc["TP 8", "activations GB"]
    small = planner.parallel_plan("gpt2_small", gpus=8, gpu_memory=141)
    assert "12 heads do not split over 8" in small.loc["TP 8", "note"] and not small.loc["TP 8", "fits"]


def test_the_plans_bytes_use_the_measured_formula():
    config = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=48)
    layout = planner.Layout(tp=2)
    expected = sum(formulas.ring_bytes_sent("all-reduce", v["bytes"], 2) for v in
                   formulas.tensor_parallel_collectives(config, 3, 16, s=planner.VALUE_BYTES).values())
    assert planner.bytes_per_step(config, layout, micro_batch=3, micro_batches=1) == expected


@pytest.mark.parametrize("call, words", [
    (lambda: planner.parallel_plan("gpt5", 8, 80), "unknown model 'gpt5'; choose one of: gpt2_small"),
    (lambda: planner.parallel_plan("7b", 0, 80), "gpus must be at least 1"),
    (lambda: planner.parallel_plan("7b", 10_000, 80), "at most 4096"),
    (lambda: planner.parallel_plan("7b", 8, -1), "gpu_memory must be a number of GB above 0"),
    (lambda: planner.parallel_plan("7b", 8, 80, "carrier-pigeon"), "unknown interconnect"),
    (lambda: planner.parallel_plan("7b", 8, 80, micro_batches=5000), "at most 1024"),
    (lambda: tensor_study(nproc=9), "at most 4"),
    (lambda: tensor_study(nproc=3), "nproc must divide the GPT's 4 heads, got 3"),
])
def test_bad_input_is_refused_with_the_limit(call, words):
    with pytest.raises(OptlabError, match=words.replace("(", r"\(")):
        call()


def test_the_command_line_prints_the_plan_or_one_error_line(capsys):
    from optlab.commands.cli import main

    assert main(["parallel-plan", "--model", "gpt2_small", "--gpus", "4", "--gpu-memory", "80"]) == 0
    assert "FSDP 4" in capsys.readouterr().out
    assert main(["parallel-plan", "--gpus", "5000"]) == 2
    assert capsys.readouterr().err == ("optlab: error: gpus 5000 is more than this run can use: at most 4096 "
                                       "(GPUs in one plan)\n")


@pytest.fixture(scope="module")
def pipelines():
    from optlab.studies.parallel import pipeline_study
    return pipeline_study(microbatches=(4, 8), timeout=LAUNCH_TIMEOUT_S)


@pytest.mark.beside_the_book_build  # slow, 4 processes of its own: it fills the wait for the book
def test_every_schedule_trains_as_one_process_and_idles_as_the_formula_says(pipelines):
    from optlab.studies.parallel import BUBBLE_TOLERANCE
    parity = pipelines.parity_table()
    assert len(parity) == 6 and (parity["gradient"] < PARITY_TOLERANCE).all() and (parity["loss"] < 1e-5).all()
    idle = pipelines.idle_table()
    plain = idle.loc[["GPipe", "1F1B"]]
    assert ((plain["replayed idle"] - plain["formula"]).abs() < BUBBLE_TOLERANCE).all()
    by_rank = pipelines.idle_by_rank()
    for (schedule, microbatches, rank), row in idle.iterrows():
        assert by_rank.loc[(schedule, microbatches), f"replayed idle {rank}"] == row["replayed idle"]
        assert by_rank.loc[(schedule, microbatches), f"wall idle {rank}"] == row["wall idle"]
        assert by_rank.loc[(schedule, microbatches), "formula"] == row["formula"]
    assert by_rank.attrs["details"] == [f"wall idle {rank}" for rank in range(4)]
    in_flight = pipelines.held_table("in flight")
    assert (in_flight["GPipe"] == 8).all() and in_flight["1F1B"].tolist() == [4, 3, 2, 1]


def test_a_replay_of_gpipe_gives_the_bubble_and_a_broken_order_is_refused():
    from optlab.studies.parallel import replayed_idle
    p, m = 4, 3
    gpipe = [[("F", i, s) for i in range(m)] + [("B", i, s) for i in reversed(range(m))] for s in range(p)]
    idle = replayed_idle(gpipe, [{"F": 1.0, "B": 2.0}] * p)
    assert idle == pytest.approx([formulas.bubble_fraction(p, m)] * p)
    broken = [list(order) for order in gpipe]
    broken[1] = [("B", 0, 1), *[event for event in broken[1] if event != ("B", 0, 1)]]  # a backward before its forward
    with pytest.raises(OptlabError, match="stage boundary is broken"):
        replayed_idle(broken, [{"F": 1.0, "B": 2.0}] * p)


@pytest.mark.beside_the_book_build
def test_the_planner_predicts_what_two_tensor_parallel_ranks_saved_and_sent(study):
    table = study.planner_table()
    assert len(table) == 2
    assert (table["activation bytes"] == table["activations, planner"]).all()
    assert (table["sent per rank"] == table["sent, planner"]).all() and (table["sent per rank"] > 0).all()


@pytest.fixture(scope="module")
def composed():
    from optlab.studies.parallel import compose_study
    return compose_study(steps=2, timeout=LAUNCH_TIMEOUT_S)


@pytest.mark.beside_the_book_build  # slow, 4 processes of its own: it fills the wait for the book
def test_fsdp2_over_tp_trains_as_one_process_and_counts_as_the_formulas_say(composed):
    parity = composed.parity_table()
    assert (parity[["gradient", "parameter"]] < PARITY_TOLERANCE).all().all()
    assert (parity["moved by training"] > 1e3 * PARITY_TOLERANCE).all()
    collectives = composed.collectives_table()
    assert (collectives["calls"] == collectives["formula calls"]).all()
    assert (collectives["bytes"] == collectives["formula bytes"]).all()
    memory = composed.memory_table()
    assert (memory[["parameters", "gradients", "optimizer state"]].eq(memory["formula, each"], axis=0)).all().all()
    plan = composed.planner_table()
    assert (plan["state bytes"] == plan["state, planner"]).all()
    assert (plan["sent per rank"] == plan["sent, planner"]).all()


@pytest.mark.beside_the_book_build
def test_the_planners_pipeline_holds_what_1f1b_held_on_its_first_stage(pipelines):
    assert pipelines.held_table("in flight")["1F1B"].iloc[0] == planner.in_flight(planner.Layout(pp=4))


def test_the_several_gpus_pages_parallel_launch_lines_parse():
    import re
    import shlex
    from pathlib import Path

    from torch.distributed.run import get_args_parser

    from optlab.studies.parallel.commands import _parser

    page = (Path(__file__).parents[1] / "book" / "using" / "several_gpus.md").read_text()
    lines = re.sub(r"\\\n\s*", "", page).splitlines()
    launches = [line.split("bash -c ")[-1].strip("'") for line in lines
                if "-m optlab.studies.parallel" in line and "torchrun" in line]
    assert len(launches) == 5
    for line in launches:
        words = shlex.split(re.sub(r"\$\([^)]*\)", "node0", line).replace("$", ""))  # SLURM's shell words
        torchrun = get_args_parser().parse_args(words[1:])
        assert torchrun.module and torchrun.training_script == "optlab.studies.parallel"
        _parser().parse_args(torchrun.training_script_args)
