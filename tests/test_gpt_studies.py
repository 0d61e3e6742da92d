"""The studies of chapters 22-24 on the tiny GPT: FP8 numerics, AdamW's state bytes and agreement, and the compile
check of one part of the GPT (on a fast backend: Inductor's C++ compile takes tens of seconds on a CPU)."""
import math

import pytest
import torch

from optlab.core import loops
from optlab.core.errors import OptlabError
from optlab.core.fp8 import scaled_mm_runs
from optlab.studies import compile_block, compile_cost, fp8_training, optimizer_memory


@pytest.mark.skipif(scaled_mm_runs("cpu") is not None, reason="torch._scaled_mm does not run here")
def test_fp8_linears_train_like_fp32_and_say_which_backend_ran():
    run = fp8_training.fp8_losses("gpt_tiny", steps=3, backend="torch", device="cpu", profile="smoke")
    assert run.backend == "torch" and run.fp8_layers == run.linear_layers - 1 > 0  # all but the tied head
    summary = run.summary().set_index("variant")
    assert list(summary.index) == list(fp8_training.VARIANTS)
    assert (summary["rel_diff_vs_fp32"] <= fp8_training.LOSS_RTOL).all(), summary
    assert summary.loc["FP8 linears", "rel_diff_vs_fp32"] > 0, "FP8 gave fp32's losses exactly: it did not run"
    assert len(run.losses) == 3 * len(fp8_training.VARIANTS)


def test_fp8_scales_keep_small_values_that_a_plain_cast_loses():
    errors = fp8_training.scaled_mm_error()
    assert errors["scaled_rel_err"] < 0.1 < errors["unscaled_rel_err"], errors


@pytest.mark.parametrize("steps", [0, fp8_training.MAX_STEPS + 1, 2.5])
def test_fp8_steps_are_bounded(steps):
    with pytest.raises(OptlabError, match="steps"):
        fp8_training.fp8_losses(steps=steps, device="cpu")


def test_adamw_state_is_twice_the_parameters_plus_a_counter_per_tensor_and_every_implementation_agrees():
    table = optimizer_memory.optimizer_memory("gpt_tiny", steps=2, profile="smoke", device="cpu")
    assert set(table["impl"]) == {"for_loop", "foreach", "fused"} and (table["ran"] == table["impl"]).all(), table
    assert (table["state_bytes"] == 2 * table["param_bytes"] + 4 * table["param_tensors"]).all(), table
    assert (table["state_per_param_byte"] == 2).all(), table
    assert (table["max_rel_diff"] <= table["tolerance"]).all(), table
    assert (table["max_update"] > 100 * table["max_abs_diff"]).all(), table


def test_an_implementation_asked_for_but_not_run_shows_in_the_table(monkeypatch):
    monkeypatch.setitem(loops._IMPLEMENTATIONS, "fused", {"foreach": False})  # "fused" quietly runs the for-loop
    table = optimizer_memory.optimizer_memory("gpt_tiny", steps=1, profile="smoke", device="cpu").set_index("impl")
    assert table.loc["fused", "ran"] == "for_loop", table


@pytest.mark.parametrize("flags, ran", [({}, "default"), ({"foreach": False}, "for_loop"),
                                        ({"foreach": True}, "foreach"), ({"fused": True}, "fused")])
def test_the_implementation_is_read_from_the_optimizer_flags(flags, ran):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], **flags)
    assert optimizer_memory.implementation_ran(optimizer) == ran


def test_a_storage_shared_by_views_counts_once():
    base = torch.zeros(10)
    assert optimizer_memory.storage_bytes([base, base[:5], base.view(2, 5)]) == 40
    assert optimizer_memory.storage_bytes([base, torch.zeros(3, dtype=torch.float64)]) == 64


def test_low_bit_support_is_none_or_one_line():
    reason = optimizer_memory.low_bit_support()
    assert reason is None or ("torchao" in reason and "\n" not in reason)


def test_the_compile_check_is_a_record_compile_cost_reads():
    record = compile_block.block_compile_record("gpt_tiny", part="mlp", steps=3, device="cpu", backend="aot_eager")
    costs = compile_cost.compile_costs(record).set_index("variant")
    assert list(costs.index) == ["eager", "compile default"]
    assert costs.loc["compile default", "graphs_compiled"] >= 1 and costs.loc["eager", "graphs_compiled"] == 0
    row = costs.loc["compile default"]
    expected = math.inf if row["saving_ms"] <= 0 else row["compile_s"] / (row["saving_ms"] / 1e3)
    assert row["payoff_steps"] == pytest.approx(expected)
    agreement = compile_cost.loss_agreement(record)
    assert (agreement["rel_diff"] <= agreement["tolerance"]).all(), agreement
    assert all(len(sample["step_times_s"]) == 3 for sample in record["samples"])


@pytest.mark.parametrize("options, named", [({"mode": "max-autotune"}, "compile mode"), ({"part": "head"}, "part"),
                                            ({"steps": 0}, "steps"), ({"batch_size": 10_000}, "batch_size")])
def test_the_compile_check_refuses_what_it_cannot_run(options, named):
    with pytest.raises(OptlabError, match=named):
        compile_block.block_compile_record(device="cpu", **options)
