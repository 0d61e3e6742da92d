"""Chapter 30's plumbing: the bandwidth bound's arithmetic and peaks, and the decoding
study's table and checks on a small GPT."""
import math

import pytest
import torch

from optlab.core.errors import OptlabError
from optlab.core.gpt.transformer import GPT, GPT_SIZES, GPTConfig, parameter_count
from optlab.studies.serving import bandwidth, decoding


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():  # wider than GPT-2's init, so that attention moves the greedy tokens
        for parameter in gpt.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3)
    return gpt


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 40, (1, 24), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name, tbs", [
    ("NVIDIA H200", 4.8), ("NVIDIA H200 NVL", 4.8), ("NVIDIA H100 80GB HBM3", 3.35), ("NVIDIA H100 PCIe", 2.0),
    ("NVIDIA H100 NVL", 3.9), ("NVIDIA A100-SXM4-80GB", 2.039), ("NVIDIA A100 80GB PCIe", 1.935), ("NVIDIA A100-SXM4-40GB", 1.555),
    ("Tesla V100-SXM2-16GB", 0.9),
])
def test_datasheet_peaks(name, tbs):
    peak = bandwidth.datasheet_peak(name)
    assert peak.bytes_per_s == pytest.approx(tbs * 1e12) and peak.source == "datasheet"


def test_an_unknown_device_gets_a_measured_copy():
    assert bandwidth.datasheet_peak("NVIDIA GeForce GTX 1080") is None
    peak = bandwidth.measured_copy_bandwidth(torch.device("cpu"), mib=4)
    assert peak.source == "measured" and 1e8 < peak.bytes_per_s < 1e13
    with pytest.raises(OptlabError, match="from 1 to 4096"):
        bandwidth.measured_copy_bandwidth(torch.device("cpu"), mib=5000)


def test_bytes_a_decode_step_reads():
    with torch.device("meta"):
        gpt2 = GPT(GPT_SIZES["gpt2_small"]).to(torch.bfloat16)
    weights = bandwidth.weight_bytes(gpt2)
    assert weights == 2 * (parameter_count(gpt2) - 1024 * 768)  # the tied head once, no position table
    assert 245e6 < weights < 250e6  # about 248 MB a token in bf16
    assert bandwidth.kv_bytes(gpt2.config, 2, 100, 2) == 2 * 12 * 768 * 100 * 2 * 2
    assert bandwidth.step_bytes(gpt2, 1, 10) == weights + bandwidth.kv_bytes(gpt2.config, 1, 10, 2)
    h200 = bandwidth.datasheet_peak("NVIDIA H200")
    assert bandwidth.bound_tokens_per_s(weights, 1, h200) == pytest.approx(4.8e12 / weights)
    assert bandwidth.mbu(weights, weights / 4.8e12 * 2, h200) == pytest.approx(0.5)


def test_the_decode_study_counts_every_row_s_cache(model, prompt):
    """At batch 3 a step reads three rows of keys and values, and the cache holds three: a formula that forgets the
    batch agrees with this one only at batch 1."""
    study = decoding.decode_study(model, prompt.expand(3, -1), 4, rounds=2, variants=("no cache", "static cache"))
    row_bytes = 2 * 2 * 32 * 4  # keys and values x layers x width x fp32, per position
    assert study.step_bytes("static cache") == bandwidth.weight_bytes(model) + 3 * (24 + 4 - 1) * row_bytes
    assert study.table().loc["static cache", "KV cache MiB"] * 2**20 == 3 * (24 + 4 - 1) * row_bytes
    assert bandwidth.step_bytes(model, 3, 10) == bandwidth.weight_bytes(model) + 3 * 10 * row_bytes


def test_mbu_is_given_only_where_a_step_reads_memory(tmp_path):
    h200, measured = bandwidth.datasheet_peak("NVIDIA H200"), bandwidth.Peak(1e11, "a copy", "measured")
    assert "fit in the 32 MiB" in bandwidth.mbu_reason(8e5, 32 * 2**20, measured, cuda=False)
    assert bandwidth.mbu_reason(40e6, 32 * 2**20, measured, cuda=False) is None
    assert bandwidth.mbu_reason(248e6, 60 * 2**20, h200, cuda=True) is None
    assert "datasheet" in bandwidth.mbu_reason(248e6, 60 * 2**20, measured, cuda=True)
    assert "unknown" in bandwidth.mbu_reason(248e6, None, h200, cuda=True)
    for index, (level, size) in enumerate([(1, "32K"), (2, "1024K"), (3, "32768K"), (2, "2M")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "size").write_text(f"{size}\n")
    assert bandwidth.last_level_cache_bytes("cpu", tmp_path) == 32 * 2**20  # the highest level, not the largest
    assert bandwidth.last_level_cache_bytes("cpu", tmp_path / "absent") is None


def test_decode_study_table(model, prompt):
    variants = ("no cache", "dynamic cache", "static cache")
    study = decoding.decode_study(model, prompt, 6, rounds=2, variants=variants)
    table = study.table()
    assert list(table.index) == list(variants) and table["same as reference"].all() and (table["near-ties"] == 0).all()
    assert table.loc["no cache", "verdict"] == "reference" and table["rounds"].eq(2).all()
    assert table.loc["no cache", "KV cache MiB"] == 0
    assert table.loc["static cache", "KV cache MiB"] * 2**20 == 2 * 2 * 32 * (24 + 5) * 4
    assert (table["peak memory MiB"] > 0).all()
    # the small GPT's step fits in any CPU's last-level cache: no MBU figure, and the reason instead
    assert table["MBU %"].isna().all() and all("fit in" in study.mbu_reason(v) for v in variants)
    assert study.step_bytes("static cache") > study.step_bytes("dynamic cache") > study.step_bytes("no cache")
    assert math.isnan(study.compile_s)
    assert set(study.speedups()["variant"]) == {"dynamic cache", "static cache"}


@pytest.mark.parametrize("call, message", [
    (lambda m, p: decoding.decode_study(m, p, 4, rounds=1), "rounds"),
    (lambda m, p: decoding.decode_study(m, p, 4, variants=("static cache",)), "no cache"),
    (lambda m, p: decoding.decode_study(m, p, 4, variants=("no cache", "paged")), "variants"),
])
def test_bad_study_input_is_named(model, prompt, call, message):
    with pytest.raises(OptlabError, match=message):
        call(model, prompt)


def test_the_checks_pass_on_a_working_cache(model, prompt):
    assert all(decoding.tokens_match(model, prompt, 8, ("no cache", "dynamic cache", "static cache")).values())
    reference = decoding.greedy_reference(model, prompt, 8)
    errors = decoding.logit_errors(model, reference, 24, ("no cache", "dynamic cache", "static cache"))
    assert set(errors) == {"dynamic cache", "static cache"} and max(errors.values()) < 1e-4
    checks = decoding.static_cache_checks(model, prompt)
    assert checks["storage fixed"] and checks["masking error"] < 1e-4 * checks["logit scale"]


def test_the_chapter_sizes():
    assert decoding.decode_size("cpu").size == "gpt_tiny"
    gpu = decoding.decode_size("cuda")
    assert (gpu.size, gpu.dtype) == ("gpt2_small", torch.bfloat16)
    assert gpu.prompt_len + gpu.new_tokens <= GPT_SIZES["gpt2_small"].block_size

