import pandas as pd
import pytest

from optlab.core.knobs.config import RunConfig
from optlab.core.errors import OptlabError
from optlab.studies.transformer import token_costs

TINY = RunConfig(workload="gpt", model="gpt_tiny", batch_size=8, vocab_size=128)  # 2 layers, 64 wide, 64 tokens


def test_tokens_per_step_are_sequences_times_their_length():
    assert token_costs.tokens_per_step(TINY) == 8 * 64
    assert token_costs.tokens_per_step(RunConfig(workload="gpt", model="gpt_tiny", batch_size=16, seq_len=32)) == 512


def test_attention_flops_per_token_grow_with_the_length_and_the_head_with_the_vocabulary():
    full, half = token_costs.flops_per_token(TINY), token_costs.flops_per_token(
        RunConfig(workload="gpt", model="gpt_tiny", batch_size=16, seq_len=32, vocab_size=128))
    # scores and weighted sum: 2 matmuls x 2 FLOPs x T x d per token and layer, T = 64, d = 64, 2 layers
    assert full["attention FLOPs/token"] == 2 * 2 * 2 * 64 * 64 * 2 / 2 == 2 * half["attention FLOPs/token"]
    assert full["forward FLOPs/token"] - half["forward FLOPs/token"] == half["attention FLOPs/token"]
    raw = token_costs.flops_per_token(RunConfig(workload="gpt", model="gpt_tiny", batch_size=8, vocab_size=65))
    assert full["forward FLOPs/token"] - raw["forward FLOPs/token"] == 2 * 64 * (128 - 65)  # the head's extra rows
    assert full["training FLOPs/token"] == 3 * full["forward FLOPs/token"]


def test_the_shape_table_puts_the_runs_tokens_per_second_beside_each_shape():
    samples = pd.DataFrame({"variant": ["a", "a", "b"], "phase": "train", "status": "ok",
                            "items_per_s": [100.0, 300.0, 50.0]})
    table = token_costs.shape_table({"a": TINY, "b": RunConfig(workload="gpt", model="gpt_tiny", batch_size=32,
                                                               seq_len=16)}, samples).set_index("variant")
    assert table.loc["a", "tokens/s (median)"] == 200.0 and table.loc["b", "tokens per step"] == 512
    assert table.loc["b", "tokens per sequence"] == 16
    assert token_costs.shape_table({"a": TINY})["tokens/s (median)"].isna().all()
    with pytest.raises(OptlabError, match="at least one config"):
        token_costs.shape_table({})


def test_stack_throughput_lists_the_steps_in_order_with_rate_mfu_and_memory():
    summary = pd.DataFrame({"model": "m", "phase": "train", "variant": ["second", "first"], "unit": "tokens",
                            "items_per_s": [20.0, 10.0], "peak_mem_mb": [2.0, 3.0]})
    mfu = pd.DataFrame({"model": "m", "variant": ["first", "second"], "MFU %": [1.0, 2.0], "precision": "fp32",
                        "peak TFLOP/s": 0.5, "peak source": "measured"})
    table = token_costs.stack_throughput(summary, mfu, ["first", "second", "not run"])
    assert table["step"].tolist() == ["first", "second"]
    assert table["tokens/s (median)"].tolist() == [10.0, 20.0] and table["MFU %"].tolist() == [1.0, 2.0]
    assert table["peak MiB"].tolist() == [3.0, 2.0]


def test_the_summary_carries_each_variants_median_throughput_in_its_unit():
    from optlab.core.stats.summary import summarize_runs

    samples = pd.DataFrame([{"model": "gpt_tiny", "phase": "train", "variant": variant, "repeat": repeat, "status": "ok",
                             "epoch_equiv_s": 1.0 + repeat / 10, "step_median_s": 0.1, "startup_s": 0.0,
                             "images_per_s": 8.0, "items_per_s": rate + repeat, "unit": "tokens",
                             "peak_mem_mb": 1.0, "tflops": 0.01}
                            for variant, rate in (("a", 100.0), ("b", 200.0)) for repeat in range(3)])
    rows = summarize_runs(samples, "a").set_index("variant")
    assert rows.loc["a", "items_per_s"] == 101.0 and rows.loc["b", "items_per_s"] == 201.0
    assert set(rows["unit"]) == {"tokens"}
    assert summarize_runs(samples.drop(columns=["items_per_s", "unit"]), "a")["items_per_s"].isna().all()
