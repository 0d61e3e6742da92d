"""optimizer.step() alone: every registry variant timed, its launches counted, its state measured, parity checked."""
import pandas as pd
import pytest
import torch
from torch import nn

from optlab.studies import optimizer_bench
from optlab import resolve_device
from optlab.core.results import store
from optlab.core.knobs.config import RunConfig
from optlab.core.errors import OptlabError
from tests.helpers import TINY

needs_cuda = pytest.mark.cuda
LABELS = ["SGD for-loop", "SGD foreach", "SGD fused", "Adam for-loop", "Adam foreach", "Adam fused"]


@pytest.fixture(scope="module")
def cpu_table() -> pd.DataFrame:
    return optimizer_bench.step_benchmark(profile=TINY, device="cpu", min_run_time=0.01)


def test_every_registry_variant_is_timed(cpu_table):
    assert cpu_table["variant"].tolist() == LABELS and set(cpu_table["model"]) == {"resnet18"}
    assert (cpu_table["median_ms"] > 0).all() and (cpu_table["iqr_ms"] >= 0).all() and (cpu_table["runs"] >= 1).all()
    assert cpu_table["kernels_per_step"].isna().all()  # no GPU kernels on the CPU
    assert cpu_table["step_extra_mib"].isna().all()


def test_launches_per_step_fall_from_for_loop_to_foreach_to_fused(cpu_table):
    for _, rows in cpu_table.groupby("optimizer"):
        ops = rows.set_index("impl")["aten_ops_per_step"]
        tensors = rows["param_tensors"].iloc[0]
        assert ops["for_loop"] >= 2 * tensors  # a few operators per parameter tensor
        assert ops["fused"] <= 2 < ops["foreach"] < ops["for_loop"]


def test_adam_keeps_two_moments_and_sgd_one_momentum_buffer(cpu_table):
    for _, row in cpu_table.iterrows():
        moments = 1 if row["optimizer"] == "sgd" else 2
        assert row["state_mib"] == pytest.approx(moments * row["params_mib"], rel=0.01)


def test_implementations_agree_within_float_tolerance_after_real_updates():
    table = optimizer_bench.parity(profile=TINY, device="cpu", steps=2)
    assert table["variant"].tolist() == LABELS
    assert (table["max_update"] > 1e-3).all(), "the steps did not move the weights"
    others = table[table["impl"] != "for_loop"]
    assert (others["max_rel_diff"] < 1e-5).all() and (others["max_abs_diff"] < 1e-3 * others["max_update"]).all(), table


def test_parity_sees_an_implementation_that_updates_differently(monkeypatch):
    real = optimizer_bench.build_optimizer

    def fused_with_another_learning_rate(model, config, info):
        optimizer = real(model, config, info)
        if config.optimizer_impl == "fused":
            for group in optimizer.param_groups:
                group["lr"] *= 1.01
        return optimizer

    monkeypatch.setattr(optimizer_bench, "build_optimizer", fused_with_another_learning_rate)
    table = optimizer_bench.parity(profile=TINY, device="cpu", steps=2).set_index("variant")
    assert table.loc["SGD fused", "max_rel_diff"] > 1e-5 and table.loc["Adam fused", "max_rel_diff"] > 1e-5
    assert table.loc["SGD foreach", "max_rel_diff"] < 1e-5


def test_gradients_are_the_same_for_the_same_seed():
    first, second = nn.Linear(3, 2), nn.Linear(3, 2)
    optimizer_bench.fill_gradients(first, 7)
    optimizer_bench.fill_gradients(second, 7)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(first.parameters(), second.parameters()))
    optimizer_bench.fill_gradients(second, 8)
    assert not torch.equal(first.weight.grad, second.weight.grad)


def test_a_missing_implementation_is_reported_with_its_device(monkeypatch):
    def refuse(model, config):
        raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
    monkeypatch.setattr(optimizer_bench, "make_optimizer", refuse)
    with pytest.raises(OptlabError, match=r"adam fused is not available on .* \(cpu\) in torch .*supported devices"):
        optimizer_bench.build_optimizer(nn.Linear(2, 2), RunConfig(optimizer="adam", optimizer_impl="fused"),
                                        resolve_device("cpu"))


def test_bad_steps_are_refused():
    with pytest.raises(OptlabError, match="steps must be an integer >= 1"):
        optimizer_bench.parity(profile=TINY, device="cpu", steps=0)


def test_run_reference_saves_the_table_where_the_book_reads_it(tmp_path, monkeypatch):
    table = pd.DataFrame({"model": ["resnet18"], "variant": ["SGD fused"], "median_ms": [0.1]})
    monkeypatch.setattr(optimizer_bench, "step_benchmark", lambda **kwargs: table)
    assert optimizer_bench.run_reference(tmp_path / "gpu", device="cpu") == [tmp_path / "gpu" / "optimizer_step.csv"]
    pd.testing.assert_frame_equal(store.reference_tables("optimizer_step", tmp_path), table.assign(machine="gpu"))


@needs_cuda
def test_cuda_counts_kernels_and_fused_launches_fewest():
    table = optimizer_bench.step_benchmark(profile=TINY, device="cuda", min_run_time=0.01)
    for _, rows in table.groupby("optimizer"):
        kernels = rows.set_index("impl")["kernels_per_step"]
        assert kernels["fused"] < kernels["foreach"] < kernels["for_loop"]
    assert (table["step_extra_mib"] >= 0).all()


@needs_cuda
def test_cuda_implementations_agree():
    table = optimizer_bench.parity(profile=TINY, device="cuda", steps=2)
    assert (table["max_rel_diff"] < 1e-5).all(), table
