"""FSDP2 against DDP and one process: sharded memory, collectives, parity, the checkpoint round trip, launch lines.

One real 2-process gloo job (the ``study`` fixture, about 40 s with its imports on 2 cores) serves every test that
needs measurements; the rest run in this process.
"""
import argparse
import dataclasses
import json
import shlex
import shutil

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.run import get_args_parser

from optlab.core.errors import OptlabError
from optlab.studies.distributed import job_of_one, shard_commands
from optlab.studies.distributed.clusters import SCRIPT, cluster_commands
from optlab.studies.distributed.shard_checkpoint import ROUND_TRIP_TOLERANCE, load_checkpoint
from optlab.studies.distributed.shard_study import SHARD_TOLERANCE, ShardStudy, shard_rank, shard_study
from optlab.studies.distributed.sharding import (
    DEPTH, TRANSFORMER, Workload, build_transformer, next_token_loss, shard,
)

LAUNCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    return shard_study(nproc=2, steps=3, rounds=3, batch_size=4, folder=tmp_path_factory.mktemp("shard"),
                       timeout=LAUNCH_TIMEOUT_S)


def doubled_when_sharded(model: nn.Module, batch):
    """The GPT's loss, doubled on a sharded model only: FSDP2 then trains to other weights than one process does."""
    loss = next_token_loss(model, batch)
    return 2 * loss if isinstance(model, FSDPModule) else loss


@pytest.fixture(scope="module")
def unequal_study(tmp_path_factory):
    """The whole study in this process as a world of one (seconds, no launcher), on a workload whose sharded model
    trains on twice the loss: a parity that looks at the one-process reference must see the difference."""
    out = tmp_path_factory.mktemp("unequal")
    with job_of_one(threads=1):
        shard_rank(out, steps=2, rounds=2, batch_size=2,
                   workload=Workload(TRANSFORMER.build, TRANSFORMER.batch, doubled_when_sharded))
    return ShardStudy(**json.loads((out / "study.json").read_text()))


def test_two_sharded_ranks_train_to_the_weights_of_one_process_on_the_concatenated_batch(study):
    assert study.max_update > 1e3 * SHARD_TOLERANCE, "training barely moved the weights: agreement would prove nothing"
    assert study.parameter_difference < SHARD_TOLERANCE
    assert study.loss_difference < 1e-5 and len(study.losses) == 3


def test_the_parity_compares_the_sharded_weights_with_the_one_process_reference(unequal_study):
    """Compared with themselves, the sharded weights would differ by 0 whatever the reference did."""
    assert unequal_study.max_update > 0
    assert unequal_study.parameter_difference > 0.1 * unequal_study.max_update
    # the first step starts from the same weights: FSDP2's loss is twice the reference's, which is the one measured
    assert unequal_study.losses[0] == pytest.approx(2 * unequal_study.reference_losses[0], rel=1e-5)


def test_shard_check_fails_when_fsdp2_and_one_process_disagree(unequal_study, monkeypatch, capsys):
    monkeypatch.setattr(shard_commands, "shard_study", lambda *args, **kwargs: unequal_study)
    assert shard_commands.main(["shard-check"]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == f"optlab: error: FSDP2 and one process disagree beyond {SHARD_TOLERANCE:g}"
    assert "max parameter difference" in captured.out and "max logit difference" in captured.out


def test_shard_check_passes_when_they_agree(study, monkeypatch, capsys):
    monkeypatch.setattr(shard_commands, "shard_study", lambda *args, **kwargs: study)
    assert shard_commands.main(["shard-check"]) == 0
    assert capsys.readouterr().err == ""


def test_each_rank_holds_about_half_of_what_one_process_holds(study):
    table = study.memory_table()
    assert table.loc["DDP", "total MiB"] == table.loc["one process", "total MiB"], "DDP replicates everything"
    for setup in ("FSDP2", "FSDP2, no reshard after forward"):
        assert 0.5 <= table.loc[setup, "of one process"] < 0.51, f"{setup} does not halve the per-rank state"
    assert all(row.get("ranks differ by bytes", 0) <= 1024 for row in study.memory)


def test_the_shards_shrink_as_one_over_the_number_of_ranks(study):
    table = study.scaling_table()
    assert list(table.index) == [1, 2, 4, 8]
    assert table["x N"].between(1.0, 1.05).all(), table  # padding of uneven first dimensions is all that may remain


def test_the_profiler_counts_the_collectives_fsdp2_adds(study):
    blocks = DEPTH
    assert study.collectives["DDP"] == {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 1}
    # forward gathers the root and each block; backward gathers each block again unless it kept them
    assert study.collectives["FSDP2"] == {"all-gather": 1 + 2 * blocks, "reduce-scatter": 1 + blocks, "all-reduce": 0}
    assert study.collectives["FSDP2, no reshard after forward"]["all-gather"] == 1 + blocks


def test_step_times_come_with_an_interval_against_ddp(study):
    table = study.timing_table()
    assert table.loc["DDP", "speed-up over DDP"] == 1.0
    assert (table["rounds"] == 3).all() and (table["low"] <= table["speed-up over DDP"]).all()
    assert (table["speed-up over DDP"] <= table["high"]).all()


def test_bf16_mixed_precision_computes_in_bf16_and_reduces_in_fp32(study):
    mixed = study.mixed_precision
    assert mixed["compute dtype"] == "torch.bfloat16" and mixed["gradient dtype"] == "torch.float32"
    assert mixed["stored parameter dtype"] == "torch.float32" and mixed["loss difference from fp32"] < 0.05


def test_a_checkpoint_saved_by_two_ranks_loads_into_one_process_with_the_same_outputs(study):
    assert study.round_trip_difference() <= ROUND_TRIP_TOLERANCE


def test_a_shard_loaded_into_the_wrong_rank_fails_the_round_trip(study, tmp_path):
    swapped = tmp_path / "checkpoint"
    shutil.copytree(study.checkpoint, swapped)
    first, second = swapped / "__0_0.distcp", swapped / "__1_0.distcp"
    first.rename(tmp_path / "rank0"), second.rename(first), (tmp_path / "rank0").rename(second)
    moved = dataclasses.replace(study, checkpoint=str(swapped))
    assert moved.round_trip_difference() > 1e3 * ROUND_TRIP_TOLERANCE


def test_loading_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(OptlabError, match="no .metadata file"):
        load_checkpoint(tmp_path, build_transformer())


def test_sharding_needs_a_model_with_blocks():
    with pytest.raises(OptlabError, match=r"\.blocks nn.ModuleList"):
        shard(nn.Linear(2, 2))


def test_the_printed_launch_lines_parse_as_torchrun_and_srun_commands():
    commands = cluster_commands(nnodes=4, gpus_per_node=8, endpoint="node0:29400")
    torchrun = get_args_parser()
    script = shlex.split(SCRIPT)[1:]
    one = torchrun.parse_args(shlex.split(commands["one machine"])[1:])
    assert one.standalone and one.nproc_per_node == "8" and one.module
    assert [one.training_script, *one.training_script_args] == script
    each = torchrun.parse_args(shlex.split(commands["each node"])[1:])
    assert (each.nnodes, each.nproc_per_node, each.rdzv_backend, each.rdzv_endpoint) == ("4", "8", "c10d", "node0:29400")
    assert [each.training_script, *each.training_script_args] == script
    srun = argparse.ArgumentParser()
    for flag in ("--nodes", "--ntasks-per-node", "--gpus-per-node"):
        srun.add_argument(flag, type=int)
    words = shlex.split(commands["SLURM"])
    options, rest = srun.parse_known_args(words[1:])
    assert words[0] == "srun" and (options.nodes, options.ntasks_per_node, options.gpus_per_node) == (4, 1, 8)
    assert rest[:2] == ["bash", "-c"]
    inner = shlex.split(rest[2].replace("$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)", "node0"))
    slurm = torchrun.parse_args(inner[1:])
    assert inner[0] == "torchrun" and slurm.rdzv_endpoint == "node0:29400" and slurm.rdzv_id == "$SLURM_JOB_ID"
    assert slurm.nnodes == "$SLURM_NNODES" and [slurm.training_script, *slurm.training_script_args] == script


@pytest.mark.parametrize("argv, message", [
    (["cluster-commands", "--nnodes", "1"], "nnodes must be at least 2, got 1"),
    (["cluster-commands", "--gpus-per-node", "65"], "gpus_per_node 65 is more than this run can use: at most 64"),
    (["cluster-commands", "--endpoint", "node0"], "endpoint must be HOST:PORT"),
    (["shard-check", "--nproc", "1"], "sharding study: nproc must be at least 2, got 1"),
    (["shard-check", "--rounds", "1"], "sharding study: rounds must be at least 2, got 1"),
])
def test_bad_sizes_are_refused_in_one_line(argv, message, capsys):
    assert shard_commands.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"optlab: error: {message}") and "\n" not in error
