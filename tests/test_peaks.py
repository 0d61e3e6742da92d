"""MFU by the precision in effect: every timed configuration of every technique is divided by the peak of what its
matmuls and convolutions ran in, and training MFU counts the backward pass."""
import types

import pandas as pd
import pytest
import torch
from torch import nn

from optlab.core.machine.device import DeviceInfo, effective_config, resolve_device
from optlab.core.knobs.profiles import get_profile
from optlab.core.techniques.registry import REGISTRY, get_experiment
from optlab.core.measuring.loops import PhaseResult
from optlab.core.measuring.samples import sample_row
from optlab.core.gpt.transformer import GPT, GPT_SIZES
from optlab.core.results import store
from optlab.studies.limits import ceilings, peaks

# NVIDIA's H200 SXM datasheet, dense (TFLOP/s)
H200 = {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0}
H200_INFO = DeviceInfo(torch.device("cuda", 0), "NVIDIA H200", ("none", "fp16", "bf16"))
CONVOLUTION_WORKLOADS = {"cifar"}  # the CNNs; every other registered workload is matmuls (a GPT, an MLP)


@pytest.fixture
def hopper(monkeypatch):
    """Compute capability 9.0, so that TF32 and FP8 are in effect where the knobs ask for them, on a whole H200's 132
    multiprocessors (a MIG slice would get its share of the peak)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=132))


def expected_precision(config) -> str:
    """What the knobs say the bulk of the arithmetic ran in, written out apart from the code under test."""
    if config.workload in CONVOLUTION_WORKLOADS:  # convolutions: autocast, else cudnn_tf32 (matmul_tf32 and fp8 miss)
        return config.amp_dtype if config.amp_dtype != "none" else "tf32" if config.cudnn_tf32 else "fp32"
    if config.fp8:
        return "fp8"
    return config.amp_dtype if config.amp_dtype != "none" else "tf32" if config.matmul_tf32 else "fp32"


def every_timed_config():
    """(technique, model, variant, config as an H200 runs it) for every registered technique and GPU profile."""
    for experiment in REGISTRY.values():
        for name in ("quick", "full"):
            profile = get_profile(name, cuda=True)
            for model in experiment.default_models(profile):
                for label, config in experiment.configs(model, profile).items():
                    yield experiment.name, model, label, effective_config(config, H200_INFO)[0]


def test_every_timed_configuration_is_divided_by_the_peak_of_its_precision(hopper):
    seen = set()
    for technique, model, label, config in every_timed_config():
        precision = peaks.precision_of(config, peaks.has_tf32(H200_INFO))
        assert precision == expected_precision(config), (technique, model, label)
        peak = peaks.peak_for(config, H200_INFO)
        assert (peak.precision, peak.tflops) == (precision, H200[precision]), (technique, model, label, peak)
        seen.add((config.workload, precision))
    assert {("gpt", p) for p in ("fp32", "tf32", "bf16", "fp8")} | {("cifar", p) for p in ("tf32", "fp16")} <= seen


def test_the_gpt_runs_cudnn_tf32_alone_in_fp32_and_a_cnn_in_tf32(hopper):
    gpt = get_experiment("gpt_precision").configs("gpt2_small", get_profile("quick", cuda=True))
    assert gpt["fp32 strict"].cudnn_tf32 and not gpt["fp32 strict"].matmul_tf32
    assert peaks.precision_of(gpt["fp32 strict"], tf32=True) == "fp32"
    assert peaks.precision_of(gpt["TF32"], tf32=True) == "tf32"
    assert peaks.precision_of(gpt["bf16 autocast + FP8 linears"], tf32=True) == "fp8"
    cnn = get_experiment("precision").configs("resnet18", get_profile("quick", cuda=True))
    assert {peaks.precision_of(config, tf32=True) for config in cnn.values()} >= {"tf32", "fp32"}


def test_the_mfu_table_names_each_rows_precision_and_the_peak_it_divided_by(hopper):
    configs = get_experiment("gpt_precision").configs("gpt2_small", get_profile("quick", cuda=True))
    summary = pd.DataFrame({"model": "gpt2_small", "phase": "train", "variant": list(configs), "tflops": 10.0})
    table = peaks.mfu_table(summary, {"gpt2_small": {k: c.to_dict() for k, c in configs.items()}}, H200_INFO)
    assert list(table["precision"]) == ["fp32", "tf32", "bf16", "fp8", "fp8"]  # FP8 eager and compiled
    assert list(table["peak TFLOP/s"]) == [H200[p] for p in table["precision"]]
    assert table["MFU %"].tolist() == pytest.approx([1000 / H200[p] for p in table["precision"]])


def test_training_mfu_counts_forward_and_backward_flops(monkeypatch):
    """6 FLOPs per weight per token plus attention's 12 x layers x width x tokens (PaLM's appendix B), against what
    a timed step records: from forward FLOPs alone the rate would be a third of it."""
    config = get_experiment("gpt_precision").configs("gpt_tiny", get_profile("smoke"))["fp32 strict"]
    sizes = GPT_SIZES["gpt_tiny"]
    weights = sum(m.weight.numel() for m in GPT(sizes).modules() if isinstance(m, nn.Linear))
    per_token = 6 * weights + 12 * sizes.n_layer * sizes.n_embd * sizes.block_size
    step_s = 0.05
    row = sample_row("gpt_precision", "gpt_tiny", "fp32 strict", 0, "train", config,
                     PhaseResult(startup_s=0.0, step_times_s=[step_s] * 4, wall_s=0.2, peak_mem_mb=0.0), 1000)
    summary = pd.DataFrame([{"model": "gpt_tiny", "variant": "fp32 strict", "phase": "train", "tflops": row["tflops"]}])
    monkeypatch.setattr(peaks, "peak_for", lambda config, info: peaks.Peak("fp32", 1.0, "a made-up peak"))
    table = peaks.mfu_table(summary, {"gpt_tiny": {"fp32 strict": config.to_dict()}}, resolve_device("cpu"))
    tokens = config.samples_per_step * sizes.block_size
    assert table["achieved TFLOP/s"].iloc[0] * 1e12 * step_s / tokens == pytest.approx(per_token, rel=0.05)
    assert table["MFU %"].iloc[0] == pytest.approx(100 * per_token * tokens / step_s / 1e12, rel=0.05)


def test_a_precision_the_kept_ceilings_lack_is_measured_and_kept_beside_them(tmp_path, monkeypatch):
    """A device without a datasheet FP8 peak gets its measured FP8 MAMF: the sweep's e4m3 matmuls (here on a small
    shape), added to the kept ceilings so that the next reader finds the same figure."""
    info = resolve_device("cpu")
    monkeypatch.setattr(store, "LIVE_DIR", tmp_path)
    monkeypatch.setitem(ceilings.MATMUL_SHAPES, "cpu", ((32, 64, 48),))
    kept = pd.DataFrame([{"ceiling": "matmul", "dtype": "fp32", "detail": "8x8x8", "value": 1.0, "device": info.name}])
    ceilings.save(kept)
    tflops, source = ceilings.mamf(info, "fp8")
    again = ceilings.load()
    assert tflops > 0 and "fp8" in source and "32x64x48" in source
    assert list(again["dtype"]) == ["fp32", "fp8"] and again["value"].iloc[1] == tflops
    assert peaks.measured_peak(info, "fp8").tflops == tflops  # read back, not measured again
