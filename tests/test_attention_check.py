"""The attention check: every kernel against the hand-written one, within a tolerance per dtype; a kernel that does
not run on the device gets its reason instead of numbers."""
import pytest

from optlab.core.gpt import transformer
from optlab.core.errors import OptlabError
from optlab.studies.transformer import attention_check

SMALL = {"batch": 1, "heads": 2, "seq_len": 16, "head_dim": 8}


@pytest.fixture(scope="module")
def cpu_table():
    return attention_check.attention_agreement("cpu", "float32", **SMALL).set_index("kernel")


def test_on_a_cpu_every_kernel_that_runs_agrees_and_the_others_say_why(cpu_table):
    assert list(cpu_table.index) == list(transformer.ATTENTIONS)
    assert cpu_table.loc["manual", "output max abs diff"] == 0 and cpu_table.loc["manual", "agrees"]
    for kernel in ("sdpa", "sdpa_math", "sdpa_flash"):
        row = cpu_table.loc[kernel]
        assert row["runs"] == "forward and backward" and row["agrees"], row
        assert 0 <= row["gradient max abs diff"] <= attention_check.TOLERANCES["float32"]
    flex = cpu_table.loc["flex"]
    assert flex["runs"] == "forward only" and flex["agrees"] and "backward" in flex["why"]
    for kernel in ("sdpa_efficient", "sdpa_cudnn"):
        assert cpu_table.loc[kernel, "runs"] == "no" and cpu_table.loc[kernel, "why"]
        assert cpu_table.loc[kernel, "agrees"] is None


def test_a_kernel_that_computes_something_else_does_not_agree(monkeypatch):
    """A kernel that forgets the causal mask: its output differs from the hand-written one far beyond tolerance."""
    real = transformer.F.scaled_dot_product_attention
    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention",
                        lambda q, k, v, **options: real(q, k, v, **{**options, "is_causal": False}))
    table = attention_check.attention_agreement("cpu", "float32", **SMALL).set_index("kernel")
    assert not table.loc["sdpa", "agrees"] and table.loc["sdpa", "output max abs diff"] > 1e-2
    assert table.loc["manual", "agrees"] and table.loc["flex", "agrees"]



def test_a_kernel_with_the_right_output_but_wrong_gradients_does_not_agree(monkeypatch):
    """Same values forward, twice the gradient backward: only the gradient comparison can catch it."""
    real = transformer.F.scaled_dot_product_attention

    def doubled_backward(q, k, v, **options):
        out = real(q, k, v, **options)
        return out.detach() + 2 * (out - out.detach())

    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", doubled_backward)
    table = attention_check.attention_agreement("cpu", "float32", **SMALL).set_index("kernel")
    assert table.loc["sdpa", "output max abs diff"] <= attention_check.TOLERANCES["float32"]
    assert not table.loc["sdpa", "agrees"] and table.loc["sdpa", "gradient max abs diff"] > 1e-2


def test_the_tolerance_follows_the_dtype():
    table = attention_check.attention_agreement("cpu", "bfloat16", **SMALL)
    assert set(table["tolerance"]) == {attention_check.TOLERANCES["bfloat16"]}
    assert table[table["runs"] != "no"]["agrees"].all()


@pytest.mark.parametrize("options, message", [
    ({"dtype": "float64"}, "unknown dtype 'float64'; choose one of: float32, float16, bfloat16"),
    ({"seq_len": 5000}, "seq_len must be a whole number from 1 to 4096, got 5000"),
    ({"batch": 0}, "batch must be a whole number from 1 to 64, got 0"),
])
def test_bad_sizes_and_dtypes_are_refused_with_what_is_allowed(options, message):
    with pytest.raises(OptlabError, match=message):
        attention_check.attention_agreement("cpu", **options)


@pytest.mark.cuda
def test_on_a_gpu_the_fused_kernels_and_compiled_flex_agree_in_bf16():
    table = attention_check.attention_agreement("cuda", "bfloat16", **SMALL).set_index("kernel")
    for kernel in ("sdpa", "sdpa_flash", "sdpa_efficient", "flex"):
        assert table.loc[kernel, "runs"] == "forward and backward" and table.loc[kernel, "agrees"], table.loc[kernel]
