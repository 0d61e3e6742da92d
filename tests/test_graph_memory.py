"""Graph use and steady-state memory: Inductor's CUDA-graph skips in every row and marked in the table, the peak of
the repeats after the first with the first kept apart, and a captured graph's private pool counted."""
import pandas as pd
import pytest
import torch

from optlab.book import report
from optlab.core.machine import compiler
from optlab.core.measuring import loops, memory
from optlab.core.knobs.config import RunConfig
from optlab.core.measuring.samples import sample_row
from optlab.core.stats.summary import summarize_runs
from optlab.core.measuring.timing import FASTER

CPU = torch.device("cpu")


def test_every_row_carries_the_cudagraph_skips_of_its_pass(monkeypatch):
    """Inductor counts a skip when it compiles a graph for replay and finds it cannot (a mutated input, a CPU
    tensor): the pass in which that happened must say so beside its cache hits and misses."""
    counts = iter([{"cache hits": 0, "cache misses": 0, "cudagraph skips": 1},
                   {"cache hits": 0, "cache misses": 2, "cudagraph skips": 3}])
    monkeypatch.setattr(compiler, "cache_counts", lambda: next(counts))
    model = torch.nn.Linear(4, 2)
    config = RunConfig(batch_size=2, num_workers=0, pin_memory=False)
    batches = [(torch.randn(2, 4), torch.tensor([0, 1]))] * 3
    result = loops.train_phase(model, batches, loops.make_optimizer(model, config), loops.make_scaler(config, CPU),
                               config, CPU, steps=2, warmup=1)
    assert result.cudagraph_skips == 2
    row = sample_row("t", "m", "reduce-overhead", 0, "train", config, result, 100, flops=1)
    assert row["cudagraph_skips"] == 2 and row["graph_pool_mb"] == 0.0


def _samples(skips=0, peaks=(900.0, 100.0, 120.0)):
    rows = []
    for variant in ("compile default", "reduce-overhead"):
        for repeat, peak in enumerate(peaks):
            rows.append({"model": "resnet18", "phase": "train", "variant": variant, "repeat": repeat, "status": "ok",
                         "epoch_equiv_s": 10.0 - repeat * 0.01 - (variant == "reduce-overhead"),
                         "step_median_s": 0.01, "startup_s": 0.1, "images_per_s": 1.0, "tflops": 1.0,
                         "peak_mem_mb": peak, "cudagraph_skips": skips if variant == "reduce-overhead" else 0})
    return pd.DataFrame(rows)


def test_a_variant_whose_graphs_were_skipped_is_marked_in_the_table():
    samples = _samples(skips=1)
    summary = summarize_runs(samples, "compile default")
    table = report.comparison_table(summary, samples=samples).set_index("variant")
    assert table.loc["reduce-overhead", "verdict"] == f"{FASTER} ({report.GRAPHS_SKIPPED})"
    assert report.GRAPHS_SKIPPED not in table.loc["compile default", "verdict"]
    clean = report.comparison_table(summary, samples=_samples(skips=0)).set_index("variant")
    assert clean.loc["reduce-overhead", "verdict"] == FASTER


def test_the_peak_is_the_repeats_after_the_first_and_the_first_is_kept_apart():
    """Repeat 0 of cudnn.benchmark holds cuDNN's trial workspaces: a one-off, not the steady state."""
    summary = summarize_runs(_samples(), "compile default").set_index("variant")
    assert summary.loc["reduce-overhead", "peak_mem_mb"] == 120.0
    assert summary.loc["reduce-overhead", "first_peak_mem_mb"] == 900.0
    single = summarize_runs(_samples(peaks=(50.0,)), "compile default").set_index("variant")
    assert single.loc["compile default", "peak_mem_mb"] == single.loc["compile default", "first_peak_mem_mb"] == 50.0
    table = report.comparison_table(summarize_runs(_samples(), "compile default"))
    assert table["peak MiB"].tolist() == [120.0, 120.0] and table["first repeat's peak MiB"].tolist() == [900.0, 900.0]


def test_the_private_pools_are_read_on_the_device_asked_for(monkeypatch):
    mib = 2**20
    segments = [{"device": 0, "total_size": 64 * mib, "segment_pool_id": (0, 0)},  # the ordinary pool
                {"device": 0, "total_size": 20 * mib, "segment_pool_id": (1, 0)},  # a graph's private pool
                {"device": 0, "total_size": 12 * mib, "segment_pool_id": (1, 0)},
                {"device": 1, "total_size": 99 * mib, "segment_pool_id": (2, 0)}]  # another GPU's
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert memory.graph_pool_mb(torch.device("cuda", 0)) == pytest.approx(32.0) and memory.graph_pool_mb(CPU) == 0.0


def test_a_variants_graph_pool_is_what_its_own_runs_added_in_graph_rows_only(monkeypatch):
    """Earlier tests' and other variants' graphs already hold private pools when a variant runs, and another
    variant records between its passes: the variant's count is the growth during its own passes."""
    mib = 2**20
    segments = [{"device": 0, "total_size": 64 * mib, "segment_pool_id": (0, 0)},
                {"device": 0, "total_size": 40 * mib, "segment_pool_id": (1, 0)}]  # recorded before this variant

    def graphs(megabytes: int) -> None:
        segments.append({"device": 0, "total_size": megabytes * mib, "segment_pool_id": (1, 0)})

    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: list(segments))
    cuda = torch.device("cuda", 0)
    model = torch.nn.Linear(2, 2)

    def phase():
        return loops.PhaseResult(0.0, [0.01], 0.01, peak_mem_mb=100.0)

    pool = loops.graph_pool_tally(model, RunConfig(compile_mode="reduce-overhead"), cuda)
    with pool.run():
        graphs(24)  # its first pass records its graphs
    graphed = loops.count_graph_pool(phase(), pool)
    assert graphed.peak_mem_mb == pytest.approx(124.0) and graphed.graph_pool_mb == pytest.approx(24.0)
    graphs(30)  # another variant's graphs, between two passes of this one
    again = loops.graph_pool_tally(model, RunConfig(compile_mode="reduce-overhead"), cuda)
    with again.run():
        pass  # a replay allocates nothing
    assert again is pool and loops.count_graph_pool(phase(), again).graph_pool_mb == pytest.approx(24.0)
    for config, device in [(RunConfig(compile_mode="default"), cuda), (RunConfig(compile_mode="reduce-overhead"), CPU)]:
        plain = loops.graph_pool_tally(torch.nn.Linear(2, 2), config, device)
        with plain.run():
            graphs(8)
        assert loops.count_graph_pool(phase(), plain).peak_mem_mb == 100.0
    autotuned = loops.graph_pool_tally(torch.nn.Linear(2, 2), RunConfig(compile_mode="max-autotune"), cuda)
    with autotuned.run():
        graphs(16)
    assert loops.count_graph_pool(phase(), autotuned).graph_pool_mb == pytest.approx(16.0)


def test_a_training_and_an_evaluation_pass_count_what_their_own_steps_added(monkeypatch):
    """The passes wrap their steps in the variant's tally: here each forward call adds 1 MiB to a fake pool that
    already holds 40 MiB of others' graphs."""
    pools = {"mb": 40.0}
    model = torch.nn.Linear(4, 2)
    model.register_forward_hook(lambda *args: pools.update(mb=pools["mb"] + 1.0))
    tally = memory.GraphPoolTally(torch.device("cuda"))
    monkeypatch.setattr(memory, "graph_pool_mb", lambda device: pools["mb"])
    monkeypatch.setattr(loops, "graph_pool_tally", lambda owner, config, device: tally)
    config = RunConfig(batch_size=2, num_workers=0, pin_memory=False)
    batches = [(torch.randn(2, 4), torch.tensor([0, 1]))] * 3
    trained = loops.train_phase(model, batches, loops.make_optimizer(model, config), loops.make_scaler(config, CPU),
                                config, CPU, steps=2, warmup=1, step_increase_mb=0.0)
    assert trained.graph_pool_mb == 3.0 and trained.peak_mem_mb == pytest.approx(trained.resident_mem_mb + 3.0)
    evaluated = loops.eval_phase(model, batches, config, CPU, steps=2, warmup=1, step_increase_mb=0.0)
    assert evaluated.graph_pool_mb == 6.0  # the variant's graphs: its training's and its evaluation's
