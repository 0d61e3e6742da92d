"""Tensor and sequence parallelism against one process and against the formulas, and the planner built on them.

One real 2-process gloo job (the ``study`` fixture, about 40 s with its imports on 2 cores) holds every CPU
measurement of chapter 19 against the formulas the planner uses, and one 4-process job (``four_ranks``) those of
chapters 20 and 21; the rest run in this process.
"""
import json

import pytest
import torch

from optlab.core.errors import OptlabError
from optlab.core.gpt.transformer import GPT, GPTConfig, parameter_count
from optlab.studies.distributed import launch, torchrun_command
from optlab.studies.parallel import ComposeStudy, PipelineStudy, formulas, planner
from optlab.studies.parallel.ranks import FINDINGS
from optlab.studies.parallel.tensor import group_heads, ungroup_heads
from optlab.studies.parallel.tensor_study import BATCH, CONFIG, PARITY_TOLERANCE, tensor_study

LAUNCH_TIMEOUT_S = 300

# Chapter 20's and chapter 21's rank commands one after the other in the same 4 processes: one launcher, and one start
# of Python and torch a rank, for both studies.
FOUR_RANK_STUDIES = """
import sys
from pathlib import Path
from optlab.studies.parallel.commands import main
from optlab.studies.parallel.ranks import joined
out = Path(sys.argv[1])
with joined():  # one process group for both studies
    failed = main(["pipeline-rank", "--out", str(out / "pipeline"), "--microbatches", "4,8"])
    failed = failed or main(["compose-rank", "--out", str(out / "compose"), "--steps", "2"])
sys.exit(failed)
"""


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
    plan = planner.parallel_plan("7b", gpus=8, gpu_memory=80)
    assert not plan.loc["DP 8", "fits"] and plan.loc["FSDP 8", "fits"] and plan.loc["TP+SP 8", "fits"]
    config = planner.MODELS["7b"]
    ends = formulas.model_parameters(config) - config.n_layer * formulas.block_parameters(config)
    gathered = 2 * (2 * formulas.block_parameters(config) + ends) / 1e9  # two blocks and the root, bf16
    assert plan.loc["FSDP 8", "state GB"] - gathered == pytest.approx(16 * formulas.model_parameters(config) / 8e9,
                                                                      abs=1e-3)
    assert plan.loc["TP+SP 8", "activations GB"] < plan.loc["TP 8", "activations GB"]
    small = planner.parallel_plan("gpt2_small", gpus=8, gpu_memory=141)
    assert "12 heads do not split over 8" in small.loc["TP 8", "note"] and not small.loc["TP 8", "fits"]


def test_plain_data_parallelism_of_7b_does_not_fit_an_h200_by_either_count():
    parameters = formulas.model_parameters(planner.MODELS["7b"])
    for per_parameter, gradient in ((16, 2), (18, 4)):
        plan = planner.parallel_plan("7b", gpus=8, gpu_memory=141, bytes_per_parameter=per_parameter)
        # the state, DDP's gradient buckets (a second copy of the gradients), and one micro-batch's activations
        expected = (per_parameter + gradient) * parameters / 1e9 + plan.loc["DP 8", "activations GB"]
        assert plan.loc["DP 8", "total GB"] == pytest.approx(expected, abs=2e-3)
        assert 0.9 * 141 < plan.loc["DP 8", "total GB"] and not plan.loc["DP 8", "fits"]


def test_the_zero_stages_hold_what_the_zero_paper_prints():
    # Rajbhandari et al., ZeRO (arXiv:1910.02054), Figure 1: a 7.5B model on 64 GPUs, K = 12:
    # baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device
    printed = {"DP": 120, "ZeRO-1": 31.4, "ZeRO-2": 16.6, "ZeRO-3": 1.9}
    for stage, gb in printed.items():
        assert round(formulas.zero_state_bytes(stage, 7.5e9, 64) / 1e9, 1) == gb


def test_the_state_per_parameter_is_what_megatrons_table_prints():
    # https://docs.nvidia.com/megatron/dist-optimizer.md, "Distributed Optimizer", its table of bytes per parameter
    # (d data-parallel ranks): fp16 params and grads 20 | 4 + 16/d; bf16 params, fp32 grads 18 | 6 + 12/d;
    # fp32 params and grads 16 | 8 + 8/d. Its distributed optimizer shards the optimizer state (ZeRO-1).
    rows = {(2, 2, 16): (20, 4, 16), (2, 4, 12): (18, 6, 12), (4, 4, 8): (16, 8, 8)}  # weight, gradient, optimizer
    for (weight, gradient, optimizer), (whole, kept, sharded) in rows.items():
        for d in (2, 8, 64):
            assert formulas.zero_state_bytes("DP", 1, d, weight, gradient, optimizer) == whole
            assert formulas.zero_state_bytes("ZeRO-1", 1, d, weight, gradient, optimizer) == kept + sharded / d


def test_a_fit_is_decided_in_gb_with_the_limit_included():
    assert planner.fits(60e9, 80, 0.25)  # exactly (1 - margin) of 80 GB
    assert not planner.fits(60e9 + 1, 80, 0.25)
    assert not planner.fits(61e9, 80, 0.25)  # below 60 GiB (64.4e9 bytes): a GiB limit would pass it


def test_a_row_fits_at_its_limit_and_not_a_byte_above():
    plan = planner.parallel_plan("gpt2_small", gpus=2, gpu_memory=80)
    total = plan.loc["FSDP 2", "total GB"]  # rounded to the MB; the exact bytes are below
    exact = planner.memory_per_gpu(planner.MODELS["gpt2_small"], planner.Layout(data=2, sharding="FSDP"))["total"]
    assert abs(exact / 1e9 - total) < 1e-3
    assert planner.parallel_plan("gpt2_small", 2, exact / 1e9, margin=0).loc["FSDP 2", "fits"]
    assert not planner.parallel_plan("gpt2_small", 2, (exact - 1) / 1e9, margin=0).loc["FSDP 2", "fits"]


def test_the_plan_prints_only_layouts_torchs_schedules_accept_m_equal_to_p_included():
    plan = planner.parallel_plan("7b", gpus=64, gpu_memory=80, micro_batches=8)
    assert plan["pp"].max() == 8 and "TP 8 x PP 8" in plan.index
    assert {"ZeRO-1 64", "ZeRO-2 64", "HSDP 8x8", "DP 8 x PP 8 (interleaved 2)"} <= set(plan.index)
    stages = [int(refused.split("PP ")[1].split()[0].rstrip(":")) for refused in plan.attrs["refused"]]
    assert stages and min(stages) == 16
    assert "DP 2 x PP 32" in planner.parallel_plan("7b", gpus=64, gpu_memory=80, micro_batches=32).index


def _torch_schedule(stages: int, microbatches: int, virtual: int):
    """Torch's own schedule for rank 0 of ``stages`` ranks, built on stand-in stages (no process group)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B
    fakes = [SimpleNamespace(num_stages=stages * virtual, group_size=stages, group_rank=0, stage_index=i * stages,
                             is_first=i == 0, is_last=False) for i in range(virtual)]
    return Schedule1F1B(fakes[0], microbatches) if virtual == 1 else ScheduleInterleaved1F1B(fakes, microbatches)


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_the_schedule_rules_and_the_interleaved_count_in_flight_are_torchs(stages):
    for virtual in (1, 2):
        for m in range(1, 3 * stages + 2):
            problem = formulas.schedule_problem(stages, m, virtual)
            try:
                schedule = _torch_schedule(stages, m, virtual)
            except ValueError:
                assert problem, f"torch refuses p={stages} m={m} v={virtual}, the planner keeps it"
                continue
            assert problem is None or (virtual > 1 and m < stages), f"p={stages} m={m} v={virtual}"
            if virtual > 1 and problem is None:
                for rank, order in schedule.pipeline_order.items():
                    held = most = 0
                    for action in order:
                        kind = action.computation_type.name if action else ""
                        held += (kind == "FORWARD") - (kind == "FULL_BACKWARD")
                        most = max(most, held)
                    assert formulas.in_flight(stages, m, virtual, rank) == most, f"p={stages} m={m} rank {rank}"


def test_the_loss_end_is_counted_once_on_the_last_stage_only():
    config, layout = planner.MODELS["7b"], planner.Layout(pp=4)
    first, last = (planner.memory_per_gpu(config, layout, stage=stage) for stage in ("first", "last"))
    block = formulas.block_activation_bytes(config, 1, config.block_size, s=2)
    loss_end = formulas.last_end_activation_bytes(config, 1, config.block_size, s=2)
    assert first["activations"] == 4 * 8 * block + 4 * formulas.first_end_activation_bytes(config, 1, 4096)
    assert last["activations"] == 1 * 8 * block + loss_end  # 1F1B's last stage holds one micro-batch
    assert first["parameters"] - last["parameters"] == config.block_size * config.n_embd - 2 * config.n_embd


def test_each_collective_is_priced_at_the_link_its_group_spans():
    in_node = planner.parallel_plan("7b", gpus=16, gpu_memory=80, gpus_per_node=16).loc["FSDP 16"]
    two_nodes = planner.parallel_plan("7b", gpus=16, gpu_memory=80, gpus_per_node=8).loc["FSDP 16"]
    assert in_node["inter-node GB"] == 0 and two_nodes["inter-node GB"] == two_nodes["sent GB per step"] > 0
    ratio = planner.INTERCONNECTS["nvlink4"] / planner.INTERCONNECTS["infiniband-ndr"]
    assert two_nodes["link s per step"] == pytest.approx(ratio * in_node["link s per step"], rel=1e-3)
    hsdp = planner.parallel_plan("7b", gpus=16, gpu_memory=80).loc["HSDP 2x8"]
    assert 0 < hsdp["inter-node GB"] < hsdp["sent GB per step"]  # only the gradient all-reduce crosses


def test_fsdp_gathers_every_micro_batch_and_once_under_a_pipeline():
    config = planner.MODELS["gpt2_small"]
    one, eight = (planner.bytes_per_step(config, planner.Layout(data=4, sharding="FSDP"),
                                         planner.Assumptions(micro_batches=m)) for m in (1, 8))
    assert eight == 8 * one
    piped = planner.Layout(data=2, pp=2, sharding="FSDP")
    parameters = formulas.stage_parameters(config, layers=6, first=True, last=False)
    sent = planner.traffic(config, piped, planner.Assumptions(micro_batches=8))
    assert sum(e["bytes"] for e in sent if e["group"] == "data") == 2 * 2 * parameters * 1 / 2  # one gather, one RS
    held = planner.memory_per_gpu(config, piped, planner.Assumptions(micro_batches=8))
    assert held["gathered"] == 4 * parameters  # bf16 weights and gradients, unsharded all step


def test_sequence_parallelism_cuts_the_whole_part_by_a_quarter_on_the_books_gpt_and_never_by_half():
    b, t = BATCH, CONFIG.block_size
    assert formulas.whole_under_tp_values(CONFIG, b, t, 2) == 9408
    assert formulas.whole_under_tp_values(CONFIG, b, t, 2, sequence=True) == 7008
    c = CONFIG.n_embd
    for tp in (2, 4, 1024):  # the norm outputs (2btc of 4btc + 4bt) stay whole: the cut stays below (2c+4)/(4c+4)
        whole = formulas.whole_under_tp_values(CONFIG, b, t, tp)
        cut = 1 - formulas.whole_under_tp_values(CONFIG, b, t, tp, True) / whole
        assert 0 < cut < (2 * c + 4) / (4 * c + 4) and (cut < 0.5 or tp > CONFIG.n_head)


def test_recomputation_keeps_each_blocks_input_and_recomputes_one_block_and_its_collectives():
    config, b, t, c = planner.MODELS["7b"], 1, 4096, 4096
    a, kept = planner.Assumptions(recompute=True), planner.Assumptions()
    layout = planner.Layout(tp=4, sequence=True)
    held = planner.memory_per_gpu(config, layout, a)["activations"]
    block = formulas.block_activation_bytes(config, b, t, 4, True, 2)
    ends = formulas.ends_activation_bytes(config, b, t, 4, True, 2)
    assert held == 32 * 2 * b * t * c // 4 + block + ends  # each block's input: a sequence shard of 2 bytes a value
    forward = sum(formulas.ring_bytes_sent(key.split()[0], value["bytes"], 4) for key, value in
                  formulas.tensor_parallel_collectives(config, b, t, True, 2).items() if key.endswith("forward"))
    assert planner.bytes_per_step(config, layout, a) - planner.bytes_per_step(config, layout, kept) == 8 * forward


def test_a_vocabulary_parallel_embedding_head_and_loss_split_by_the_vocabulary():
    config, b, t, c, v = planner.MODELS["7b"], 1, 4096, 4096, 32000
    split, whole = planner.Assumptions(vocab_parallel=True), planner.Assumptions()
    layout = planner.Layout(tp=4)
    held = {name: planner.memory_per_gpu(config, layout, a) for name, a in (("split", split), ("whole", whole))}
    assert held["whole"]["parameters"] - held["split"]["parameters"] == v * c * 3 // 4  # one tied matrix
    assert held["whole"]["activations"] - held["split"]["activations"] == 2 * b * t * v * 3 // 4  # log-softmax
    added = planner.bytes_per_step(config, layout, split) - planner.bytes_per_step(config, layout, whole)
    ring = 2 * 3 / 4  # an all-reduce sends 2(N-1)/N of its tensor
    assert added == pytest.approx(8 * ring * (2 * b * t * c * 2 + 3 * b * t * 4))


def test_the_plans_bytes_use_the_measured_formula():
    config = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=48)
    layout = planner.Layout(tp=2)
    expected = sum(formulas.ring_bytes_sent("all-reduce", v["bytes"], 2) for v in
                   formulas.tensor_parallel_collectives(config, 3, 16, s=planner.VALUE_BYTES).values())
    assert planner.bytes_per_step(config, layout, planner.Assumptions(micro_batch=3, micro_batches=1)) == expected


@pytest.mark.parametrize("call, words", [
    (lambda: planner.parallel_plan("gpt5", 8, 80), "unknown model 'gpt5'; choose one of: gpt2_small"),
    (lambda: planner.parallel_plan("7b", 0, 80), "gpus must be at least 1"),
    (lambda: planner.parallel_plan("7b", 10_000, 80), "at most 4096"),
    (lambda: planner.parallel_plan("7b", 8, -1), "gpu_memory must be a number of GB above 0"),
    (lambda: planner.parallel_plan("7b", 8, 80, "carrier-pigeon"), "unknown intra_node"),
    (lambda: planner.parallel_plan("7b", 8, 80, inter_node="smoke"), "unknown inter_node"),
    (lambda: planner.parallel_plan("7b", 8, 80, micro_batches=5000), "at most 1024"),
    (lambda: planner.parallel_plan("7b", 8, 80, bytes_per_parameter=20), "must be 16 .* or 18"),
    (lambda: planner.parallel_plan("7b", 8, 80, margin=1.0), "margin must be a fraction"),
    (lambda: planner.parallel_plan("7b", 8, 80, gpus_per_node=0), "gpus_per_node must be at least 1"),
    (lambda: tensor_study(nproc=9), "at most 4"),
    (lambda: tensor_study(nproc=3), "nproc must divide the GPT's 4 heads, got 3"),
])
def test_bad_input_is_refused_with_the_limit(call, words):
    with pytest.raises(OptlabError, match=words.replace("(", r"\(")):
        call()


def test_the_command_line_prints_the_plan_or_one_error_line(capsys):
    from optlab.commands.cli import main

    assert main(["parallel-plan", "--model", "gpt2_small", "--gpus", "4", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "FSDP 4" in out and "fits: at most 72 GB a GPU (90% of 80 GB, GB = 1e9 bytes)" in out
    assert main(["parallel-plan", "--gpus", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("left out, 34 layouts torch's schedules refuse") and len(out) == 2 + 2 + 3
    assert main(["parallel-plan", "--gpus", "5000"]) == 2
    assert capsys.readouterr().err == ("optlab: error: gpus 5000 is more than this run can use: at most 4096 "
                                       "(GPUs in one plan)\n")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """The folder of the 4-process job that ran the pipeline study (4 and 8 micro-batches) and the FSDP2 x TP study
    (2 steps): each study's findings in a folder of its own."""
    out = tmp_path_factory.mktemp("four-ranks")
    script = out / "four_rank_studies.py"
    script.write_text(FOUR_RANK_STUDIES)
    for name in ("pipeline", "compose"):
        (out / name).mkdir()
    launch(torchrun_command([str(script), str(out)], nproc=4), LAUNCH_TIMEOUT_S, threads=1)
    return out


@pytest.fixture(scope="module")
def pipelines(four_ranks):
    return PipelineStudy(**json.loads((four_ranks / "pipeline" / FINDINGS).read_text()))


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
def composed(four_ranks):
    return ComposeStudy(**json.loads((four_ranks / "compose" / FINDINGS).read_text()))


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
def test_the_planners_pipeline_holds_what_the_schedules_held(pipelines):
    in_flight = pipelines.held_table("in flight")
    for rank in range(4):
        assert in_flight.loc[rank, "1F1B"] == formulas.in_flight(4, 8, 1, rank)
        assert in_flight.loc[rank, "interleaved 1F1B"] == formulas.in_flight(4, 8, 2, rank)
    from optlab.studies.parallel.pipeline_study import CONFIG as PIPELINE_GPT
    # 4 micro-batches of 2 sequences (of 1, the targets' slice needs no copy for the loss: 256 bytes fewer), fp32,
    # each stage's received input included
    saved = pipelines.stage_bytes("1F1B", microbatches=4)
    assumptions = planner.Assumptions(micro_batch=2, micro_batches=1, value_bytes=4)
    layout = planner.Layout(pp=4)
    blocks = 2 * formulas.block_activation_bytes(PIPELINE_GPT, 2, PIPELINE_GPT.block_size)
    assert saved[1] == saved[2] == blocks
    assert saved[0] == planner.memory_per_gpu(PIPELINE_GPT, layout, assumptions, "first")["activations"]
    assert saved[3] == planner.memory_per_gpu(PIPELINE_GPT, layout, assumptions, "last")["activations"]


@pytest.mark.beside_the_book_build
def test_fsdp2_gathers_and_reduce_scatters_every_micro_batch_as_the_planner_counts(composed):
    table = composed.accumulation_table()
    assert (table["calls"] == table["formula calls"]).all() and (table["bytes"] == table["formula bytes"]).all()
    m, blocks = composed.accumulated["micro_batches"], CONFIG.n_layer
    assert table.loc["all-gather forward", "calls"] == m * (blocks + 1)
    assert table.loc["all-gather backward", "calls"] == m * blocks
    assert table.loc["reduce-scatter backward", "calls"] == m * (blocks + 1)
    sent = composed.accumulation_sent()
    assert sent["sent per rank"] == sent["sent, planner"] > 0


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
