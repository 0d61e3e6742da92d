"""DistributedDataParallel under torchrun: parity with one process, failures that end, records that load back.

Two real 2-process gloo jobs run on the CPU (a few seconds of imports each): a distributed run with its parity check,
which two tests read (``distributed_run``), and the stuck rank's.
"""
import importlib
import os
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

import optlab
from optlab.studies import distributed
from optlab.core.results import store
from optlab.commands.cli import main
from optlab.core.errors import OptlabError
from optlab.core.techniques.registry import get_experiment
from optlab.core.measuring.loops import PhaseResult
from optlab.core.knobs.profiles import get_profile

TINY_DDP = get_profile("smoke").with_sizes(repeats=2)  # 2 rounds: enough to load a record back
LAUNCH_TIMEOUT_S = 300  # the subprocess limit: a hang fails the test instead of stalling the suite

HANG_SCRIPT = """
import os, sys, time
from optlab.commands import cli
from optlab.core.measuring import loops
if os.environ["RANK"] == "0":
    time.sleep(float(os.environ["LATE_START_S"]))  # rank 0 starts late: rank 1 waits longer than the timeout for it
if os.environ["RANK"] == "1":
    loops.train_step = lambda *args, **kwargs: time.sleep(3600)  # a stuck rank: it never reaches the all-reduce
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory):
    """A 2-process ``optlab run --distributed --check-parity``, whose first step is the parity check ``make ddp-check``
    runs (3 optimizer steps of 2 micro-steps): the folder it wrote to and what it printed."""
    out = tmp_path_factory.mktemp("distributed-run")
    command = distributed.torchrun_command(["-m", "optlab", "run", "set_to_none", "--distributed", "--models",
                                            "resnet18", "--profile", "smoke", "--batch-size", "4", "--repeats", "2",
                                            "--max-repeats", "2", "--out", str(out), "--quiet",
                                            "--check-parity"], nproc=2)
    return out, distributed.launch(command, LAUNCH_TIMEOUT_S, threads=1)


def test_two_processes_train_to_the_weights_of_one_process_on_the_concatenated_batches(distributed_run):
    # Each rank's loss is the mean over its 4 images and DDP averages the gradients over the 2 ranks, which is the
    # gradient of the mean over all 8: the same SGD steps in exact arithmetic, so only fp32 rounding may differ.
    # BatchNorm runs in eval mode (fixed statistics) inside the check: per-rank batch statistics would differ.
    out, _ = distributed_run
    (path,) = out.glob("set_to_none-*.json")
    check = distributed.Parity(**optlab.load_record(path)["distributed"]["parity"])
    assert (check.world_size, check.steps, check.accumulation_steps) == (2, 3, 2)
    assert check.max_update > 1e-2, "training barely moved the weights: agreement would prove nothing"
    for mode, difference in check.difference.items():
        assert difference < distributed.PARITY_TOLERANCE, f"{mode}: DDP differs from one process by {difference}"
    assert check.rank_difference == 0.0, "DDP replicas must hold identical weights"
    # no_sync skips the all-reduce on the first of every 2 micro-steps: half the calls and half the bytes
    calls, sent = check.allreduce_calls, check.allreduce_bytes
    assert calls["all-reduce every micro-step"] == 2 * calls["no_sync"] > 0
    assert sent["all-reduce every micro-step"] == 2 * sent["no_sync"] > 0


@pytest.mark.beside_the_book_build  # slow, in processes of its own: it fills the wait for the book
def test_a_stuck_rank_ends_the_job_with_a_timeout_error_not_a_hang(tmp_path):
    """Rank 0 starts 4 s late (longer than the 3 s timeout): the start waits for it, and the timeout still ends the
    job once rank 1 gets stuck in training."""
    script = tmp_path / "stuck_rank.py"
    script.write_text(HANG_SCRIPT)
    command = distributed.torchrun_command([str(script), "run", "set_to_none", "--distributed", "--models", "resnet18",
                                            "--profile", "smoke", "--batch-size", "4", "--out", str(tmp_path),
                                            "--quiet"], nproc=2)
    with pytest.raises(OptlabError) as failure:
        distributed.launch(command, LAUNCH_TIMEOUT_S, threads=1, env={distributed.TIMEOUT_ENV: "3", "LATE_START_S": "4"})
    message = str(failure.value)
    assert "did not finish within" not in message, "the job hung until the subprocess limit"
    # rank 0's collective gave up after the process group's timeout, and said so in one line
    assert "optlab: error: rank 0 waited 3 s (OPTLAB_DDP_TIMEOUT_S) for the other ranks" in message
    assert not list(tmp_path.glob("*.json")), "a failed run must not write a record"


@pytest.mark.beside_the_book_build  # slow, in processes of its own: it fills the wait for the book
def test_a_distributed_run_writes_a_record_that_loads_back_like_any_other(distributed_run, tmp_path):
    out, done = distributed_run
    assert "backend gloo" in done.stdout and "w gradient none" in done.stdout
    assert "parity check: max parameter difference" in done.stdout
    (path,) = out.glob("set_to_none-*.json")  # only rank 0 writes
    record = optlab.load_record(path)
    assert record["distributed"]["world_size"] == 2 and record["distributed"]["backend"] == "gloo"
    check = distributed.Parity(**record["distributed"]["parity"])  # the same ranks checked themselves first
    assert check.world_size == 2 and check.max_difference < distributed.PARITY_TOLERANCE < check.max_update
    samples = optlab.load_samples(path)
    assert set(samples["world_size"]) == {2} and set(samples["images_per_step"]) == {8}  # 2 ranks x 4 images
    for _, row in samples.iterrows():
        per_rank = np.hstack([row["rank_warmup_times_s"], row["rank_step_times_s"]])
        assert per_rank.shape == (2, 1 + row["steps"])  # the smoke profile: 1 warm-up step, then the timed ones
        job = sum(row["warmup_times_s"]) + sum(row["step_times_s"])
        assert np.isclose(job, per_rank.sum(axis=1).max())  # the job ends with its slowest rank
    summaries = optlab.load_summaries(path)
    assert set(summaries["variant"]) == set(get_experiment("set_to_none").labels)
    single = {key: value for key, value in record.items() if key != "distributed"}
    store.save_record(single, tmp_path / "single", "single.json")
    shutil.copy(path, tmp_path)
    assert len(distributed.stored_samples(tmp_path)) == len(samples)  # the chapter shows distributed records only


def _phase(warmup_times, step_times, losses, correct=0, samples=0):
    return PhaseResult(startup_s=0.1, step_times_s=step_times, wall_s=sum(step_times), peak_mem_mb=10.0,
                       warmup_times_s=warmup_times, losses=losses, correct=correct, predictions=samples,
                       samples=samples)


def test_the_job_step_ends_when_the_slowest_rank_ends_it():
    slow_start = _phase([2.0], [1.0, 3.0], [2.0, 1.0], correct=3, samples=4)  # steps end at 2, 3, 6
    fast_start = _phase([1.0], [2.0, 1.0], [4.0, 3.0], correct=1, samples=4)  # steps end at 1, 3, 4
    job = distributed.merge_ranks([slow_start, fast_start])
    assert job.warmup_times_s == [2.0] and job.step_times_s == [1.0, 3.0]  # the job's steps end at 2, 3, 6
    assert job.losses == [3.0, 2.0] and (job.correct, job.predictions, job.samples) == (4, 8, 8)


@pytest.fixture
def one_process_group():
    """The environment torchrun gives a job of one process, on a free port."""
    with distributed.job_of_one():
        yield


def test_a_job_of_one_runs_in_this_process_and_leaves_no_trace(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    threads = torch.get_num_threads()
    with distributed.job_of_one(threads=1):
        assert all(name in os.environ for name in distributed.TORCHRUN_ENV) and torch.get_num_threads() == 1
        result = distributed.run_distributed("set_to_none", models=["resnet18"], profile=TINY_DDP, device="cpu",
                                             out=tmp_path, progress=False)
    assert "RANK" not in os.environ and torch.get_num_threads() == threads
    assert not torch.distributed.is_initialized()
    assert result.record["distributed"]["world_size"] == 1 and result.record["distributed"]["backend"] == "gloo"
    assert result.path.exists() and set(result.samples["world_size"]) == {1}
    assert result.record["distributed"]["parity"] is None  # not asked for


def test_a_parity_check_needs_two_ranks_and_a_distributed_run(one_process_group, tmp_path, capsys):
    with pytest.raises(OptlabError, match="parity check: nproc must be at least 2, got 1"):
        distributed.run_distributed("set_to_none", models=["resnet18"], profile=TINY_DDP, device="cpu",
                                    out=tmp_path, progress=False, parity=distributed.check_for_run)
    assert not torch.distributed.is_initialized() and not list(tmp_path.glob("*.json"))
    assert main(["run", "set_to_none", "--check-parity", "--out", str(tmp_path)]) == 2
    assert "--check-parity checks the ranks of a distributed run; add --distributed" in capsys.readouterr().err


def test_data_held_on_the_device_is_refused_because_it_cannot_be_sharded(one_process_group, tmp_path):
    with pytest.raises(OptlabError, match=r"variant\(s\) \['data on device'\] keep the whole data set on the device"):
        distributed.run_distributed("data_pipeline", models=["resnet18"], profile="smoke", device="cpu", out=tmp_path)
    assert not torch.distributed.is_initialized(), "the process group must be left on the way out"


def test_accumulating_variants_are_also_run_without_no_sync():
    labels = distributed.ddp_variants(get_experiment("gradient_accumulation")).labels
    assert labels == ["w/o gradient accumulation", "w gradient accumulation",
                      "w gradient accumulation" + distributed.SYNC_SUFFIX]
    assert distributed.ddp_variants(get_experiment("set_to_none")).labels == get_experiment("set_to_none").labels


def test_efficiency_is_throughput_over_n_times_one_process():
    rows = [{"machine": "m", "model": "resnet18", "variant": "base", "phase": "train", "status": "ok",
             "world_size": n, "images_per_s": ips} for n, ips in [(1, 100.0), (1, 120.0), (2, 165.0), (4, 330.0)]]
    table = distributed.scaling(pd.DataFrame(rows)).set_index("world_size")
    assert table.loc[1, "images/s"] == 110.0 and table.loc[1, "efficiency"] == 1.0
    assert table.loc[2, "speed-up"] == 1.5 and table.loc[2, "efficiency"] == 0.75
    assert table.loc[4, "efficiency"] == 0.75


def test_a_distributed_run_without_torchrun_says_how_to_launch_it(capsys, monkeypatch, tmp_path):
    for name in distributed.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert main(["run", "set_to_none", "--distributed", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optlab: error: a distributed run must be started by torchrun") and "\n" not in err
    assert "torchrun --nproc-per-node N -m optlab run TECHNIQUE --distributed" in err


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_timeout_names_the_variable_and_what_is_allowed(monkeypatch, value):
    monkeypatch.setenv(distributed.TIMEOUT_ENV, value)
    with pytest.raises(OptlabError, match=f"OPTLAB_DDP_TIMEOUT_S must be a number of seconds above 0, got '{value}'"):
        distributed.timeout_s()


PARITY_MODULE = importlib.import_module("optlab.studies.distributed.parity")


def test_the_parity_command_prints_the_difference(monkeypatch, capsys):
    fake = distributed.Parity(2, 3, 2, {"no_sync": 1e-7, "all-reduce every micro-step": 2e-7}, 0.0, 0.5,
                              {"no_sync": 3, "all-reduce every micro-step": 6}, {"no_sync": 8, "all-reduce every micro-step": 16})
    monkeypatch.setattr(PARITY_MODULE, "parity", lambda *args: fake)
    assert distributed.main(["parity"]) == 0
    assert capsys.readouterr().out.startswith("max parameter difference: 2.000e-07\n")
    far = distributed.Parity(**{**fake.__dict__, "difference": {"no_sync": 1e-3}})
    monkeypatch.setattr(PARITY_MODULE, "parity", lambda *args: far)
    assert distributed.main(["parity"]) == 1


def test_the_parity_check_starts_its_rank_command_with_the_sizes_asked_for_and_returns_what_rank_0_wrote(monkeypatch):
    """``make ddp-check``'s launch, its torchrun line run here as a job of one (two real ranks check their parity in
    ``distributed_run``)."""
    launched = []

    def in_this_process(command, timeout, threads):
        launched.append(command)
        with distributed.job_of_one(threads=threads):
            assert distributed.main(command[command.index("optlab.studies.distributed") + 1:]) == 0

    monkeypatch.setattr(PARITY_MODULE, "launch", in_this_process)
    check = distributed.parity(nproc=2, steps=2, accumulation_steps=1)
    assert len(launched) == 1 and "--nproc-per-node=2" in launched[0]
    assert (check.world_size, check.steps, check.accumulation_steps) == (1, 2, 1)
    assert check.max_difference < distributed.PARITY_TOLERANCE < check.max_update


def test_a_parity_check_of_one_process_is_refused(capsys):
    assert distributed.main(["parity", "--nproc", "1"]) == 2
    assert capsys.readouterr().err.strip() == "optlab: error: parity check: nproc must be at least 2, got 1"


@pytest.fixture
def two_fake_gpus(monkeypatch):
    """torch.cuda with two GPUs; the devices made current are recorded, and asking for the current device (which
    would open a context on GPU 0) fails the test."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("current_device() asked before LOCAL_RANK"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"GPU {index}")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


@pytest.mark.parametrize("requested", ["auto", "cuda", "cuda:0"])
def test_each_rank_selects_its_local_rank_before_any_other_cuda_call(two_fake_gpus, monkeypatch, requested):
    from optlab.studies.distributed.group import rank_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    info = rank_device(requested, 1)
    assert two_fake_gpus == [1] and info.device == torch.device("cuda", 1) and info.name == "GPU 1"


def test_plain_cuda_under_torchrun_means_the_local_ranks_gpu(two_fake_gpus, monkeypatch):
    from optlab.core.machine.device import resolve_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda").device == torch.device("cuda", 1) and two_fake_gpus == [1]


def test_the_ddp_loop_rotates_the_variants_as_every_other_run_does():
    from optlab.core.stats.sequential import visit_order

    order = list(distributed.training.visits(["A", "B", "C"], 4))
    assert order == [(0, "A"), (0, "B"), (0, "C"), (1, "C"), (1, "B"), (1, "A"), (2, "B"), (2, "C"), (2, "A"),
                     (3, "A"), (3, "C"), (3, "B")]  # mirrored pairs of rounds
    assert [label for repeat, label in order if repeat == 1] == visit_order(["A", "B", "C"], 1)


def test_the_merged_phase_keeps_every_ranks_memory_and_graph_counts():
    def rank(peak, resident, graphs, skips, cache):
        return PhaseResult(0.1, [0.01, 0.01], 0.03, peak, warmup_times_s=[0.5], graphs_compiled=graphs,
                                 inductor_cache=cache, resident_mem_mb=resident, cudagraph_skips=skips,
                                 graph_pool_mb=peak / 10)

    ranks = [rank(100.0, 40.0, 3, 0, "cold"), rank(120.0, 44.0, 3, 1, "warm")]
    merged = distributed.training.merge_ranks(ranks)
    assert (merged.peak_mem_mb, merged.resident_mem_mb, merged.graphs_compiled, merged.cudagraph_skips) == \
        (120.0, 44.0, 3, 1)
    assert merged.inductor_cache == "mixed" and merged.graph_pool_mb == 12.0
    columns = distributed.training.rank_columns(ranks)
    assert columns["rank_peak_mem_mb"] == [100.0, 120.0] and columns["rank_resident_mem_mb"] == [40.0, 44.0]
    assert columns["rank_graphs_compiled"] == [3, 3] and columns["rank_cudagraph_skips"] == [0, 1]
