"""The studies of chapters 24-28 on the tiny GPT: FP8 numerics, AdamW's state bytes and agreement, the compile
check of one part of the GPT (on a fast backend: Inductor's C++ compile takes tens of seconds on a CPU), and the
learning check against the text's entropy levels."""
import math
from dataclasses import replace

import pandas as pd
import pytest
import torch

from optlab.book import report
from optlab.core.measuring import loops
from optlab.core.gpt import transformer
from optlab.core.machine.device import resolve_device
from optlab.core.errors import OptlabError
from optlab.core.gpt.fp8 import scaled_mm_runs
from optlab.core.knobs.profiles import get_profile
from optlab.core.techniques.registry import get_experiment
from optlab.core.workload import get_workload
from optlab.studies.kernels import compile_block, compile_cost, numerics
from optlab.studies.transformer import fp8_training
from optlab.studies import learning, optimizer_memory


@pytest.mark.skipif(scaled_mm_runs("cpu") is not None, reason="torch._scaled_mm does not run here")
def test_fp8_linears_train_like_fp32_and_say_which_backend_ran(monkeypatch):
    """On the batch size asked for (two sequences: e4m3 x e4m3 products run a reference kernel on some CPUs)."""
    batch_sizes, build_state = [], fp8_training.build_state
    monkeypatch.setattr(fp8_training, "build_state",
                        lambda config, *args: batch_sizes.append(config.batch_size) or build_state(config, *args))
    run = fp8_training.fp8_losses("gpt_tiny", steps=3, backend="torch", device="cpu", profile="smoke", batch_size=2)
    assert batch_sizes == [2] * len(fp8_training.VARIANTS)
    assert run.backend == "torch" and run.fp8_layers == run.linear_layers - 1 > 0  # all but the tied head
    summary = run.summary().set_index("variant")
    assert list(summary.index) == list(fp8_training.VARIANTS)
    assert (summary["rel_diff_vs_fp32"] <= fp8_training.LOSS_RTOL).all(), summary
    assert summary.loc["FP8 linears", "rel_diff_vs_fp32"] > 0, "FP8 gave fp32's losses exactly: it did not run"
    assert len(run.losses) == 3 * len(fp8_training.VARIANTS)


@pytest.mark.parametrize("steps", [0, fp8_training.MAX_STEPS + 1, 2.5])
def test_fp8_steps_are_bounded(steps):
    with pytest.raises(OptlabError, match="steps"):
        fp8_training.fp8_losses(steps=steps, device="cpu")


@pytest.mark.parametrize("batch_size", [0, get_workload("gpt").test_size + 1, 2.5])
def test_fp8_batch_sizes_are_bounded_by_the_test_set(batch_size):
    with pytest.raises(OptlabError, match="batch_size"):
        fp8_training.fp8_losses(steps=1, device="cpu", batch_size=batch_size)


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


@pytest.fixture
def stand_in_text(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTLAB_DATA", str(tmp_path))  # the stand-in: real text without tiny Shakespeare on disk


def tiny_gpt_config(**knobs):
    baseline = next(iter(get_experiment("gpt_precision").configs("gpt_tiny", get_profile("smoke")).values()))
    return replace(baseline, **knobs)


def test_the_curves_carry_the_test_loss_and_the_texts_levels(stand_in_text):
    curves = learning.learning_curves({"a": tiny_gpt_config()}, resolve_device("cpu"), steps=4, eval_every=2,
                                      eval_images=16, progress=False)
    assert list(curves["step"]) == [2, 4] and (curves["test_loss"] > 0).all()
    levels = curves[[f"level_{name}" for name in learning.LEVELS]].iloc[0]
    assert levels["level_uniform"] == pytest.approx(math.log(65))
    assert levels["level_bigram"] < levels["level_unigram"] < levels["level_uniform"]
    assert curves["test_loss"].iloc[0] > levels["level_unigram"]  # 4 steps from random weights learn little


def test_time_to_target_is_the_first_record_at_or_below_it():
    curves = pd.DataFrame({"variant": ["a"] * 3 + ["b"] * 3, "step": [1, 2, 3] * 2, "tokens": [10, 20, 30] * 2,
                           "train_s": [1.0, 2.0, 3.0] * 2, "compile_s": [0.5] * 6,
                           "test_loss": [3.0, 2.5, 2.4, 3.0, 2.9, 2.8], "level_uniform": 4.0,
                           "level_unigram": 3.0, "level_bigram": 2.0})
    target = learning.target_loss(curves, 0.5)
    assert target == 2.5
    table = learning.time_to_target(curves, target).set_index("variant")
    assert table.loc["a", ["tokens to target", "seconds to target", "last test loss"]].tolist() == [20, 2.0, 2.4]
    assert math.isnan(table.loc["b", "tokens to target"]) and math.isnan(table.loc["b", "seconds to target"])
    assert learning.learning_failures(curves, target) == ["b: test loss never reached the target 2.500 (last 2.800)"]
    with pytest.raises(OptlabError, match="between the unigram"):
        learning.target_loss(curves, 1.5)


def test_a_model_that_cannot_see_the_context_fails_the_check(stand_in_text, monkeypatch):
    """The learning check on the tiny GPT with a padded head: learning which rows never occur and which characters
    are frequent lowers its loss far below where it starts, but only the context takes it below the unigram level."""
    info, budget = resolve_device("cpu"), {"steps": 60, "eval_every": 20, "eval_images": 64, "progress": False}
    config = tiny_gpt_config(vocab_size=128)
    seeing = learning.learning_curves({"sees the context": config}, info, **budget)
    target = learning.target_loss(seeing, 0.0)
    assert learning.learning_failures(seeing, target) == [], seeing
    forward = transformer.GPT.forward
    monkeypatch.setattr(transformer.GPT, "forward", lambda self, idx: forward(self, torch.zeros_like(idx)))
    blind = learning.learning_curves({"blind": config}, info, **budget)
    assert blind["test_loss"].iloc[0] - blind["test_loss"].iloc[-1] > 0.1  # the old check's fall: it passed
    assert learning.learning_failures(blind, target) == [
        f"blind: test loss {blind['test_loss'].iloc[-1]:.3f} is not below the unigram level {target:.3f}"]


def test_the_learning_figure_draws_the_texts_levels_beside_the_losses():
    curves = pd.DataFrame({"variant": "a", "step": [1, 2], "train_loss": [3.5, 3.0], "test_loss": [3.4, 2.9],
                           "test_accuracy": [0.1, 0.2], "level_uniform": 4.17, "level_unigram": 3.13,
                           "level_bigram": 2.47})
    loss_ax = report.plot_learning(curves).axes[0]
    texts = [text.get_text() for text in loss_ax.texts]
    assert texts == ["uniform (ln of the alphabet) 4.17", "unigram entropy 3.13", "bigram entropy 2.47"]
    flat = {round(line.get_ydata()[0], 2) for line in loss_ax.lines if len(set(line.get_ydata())) == 1}
    assert {4.17, 3.13, 2.47} <= flat
    assert not report.plot_learning(curves.drop(columns=list(report.LEVEL_NAMES))).axes[0].texts


def test_adamw_decays_the_2d_weights_only_as_nanogpt_groups_them():
    model = transformer.GPT(transformer.GPT_SIZES["gpt_tiny"])
    optimizer = loops.make_optimizer(model, tiny_gpt_config(optimizer="adamw"))
    named = dict(model.named_parameters())
    before = {name: parameter.detach().clone() for name, parameter in named.items()}
    for parameter in named.values():
        parameter.grad = torch.zeros_like(parameter)  # no gradient: only the weight decay moves a weight
    optimizer.step()
    decayed = {name for name, parameter in named.items() if not torch.equal(parameter, before[name])}
    assert decayed == {name for name, parameter in named.items() if parameter.dim() >= 2}, sorted(decayed)
    assert any(name.endswith("bias") for name in named) and any("ln" in name or "norm" in name for name in named)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]


def test_fp8s_distance_is_measured_from_bf16_autocast_as_well_as_fp32():
    losses = pd.DataFrame({"variant": ["fp32"] * 2 + ["bf16 autocast"] * 2 + ["FP8 linears"] * 2, "step": [1, 2] * 3,
                           "loss": [4.0, 4.0, 4.04, 4.04, 4.04, 4.04]})
    table = numerics.loss_distances(losses).set_index("variant")
    assert table.loc["FP8 linears", "rel_diff_vs_fp32"] == pytest.approx(0.01)
    assert table.loc["FP8 linears", "rel_diff_vs_bf16"] == pytest.approx(0)  # all of it bf16's rounding
    assert table.loc["bf16 autocast", "rel_diff_vs_bf16"] == 0 and table.loc["fp32", "rel_diff_vs_fp32"] == 0
    with pytest.raises(OptlabError, match="a distance needs its reference"):
        numerics.loss_distances(losses[losses["variant"] != "bf16 autocast"])
