"""A MIG slice's peak is its share of the GPU's multiprocessors, or its MFU is left out with the reason: against the
whole GPU's peak a 1g slice of an H100 (16 of 132 multiprocessors) would read eight times too low."""
import json

import pytest
import torch

from optlab.book import limits
from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import resolve_device
from optlab.core.results import store
from optlab.studies.limits import peaks
from optlab.studies.serving import bandwidth

SLICE = "NVIDIA H100 80GB HBM3 MIG 1g.10gb"


def test_a_mig_slice_gets_its_share_of_the_peak():
    peak = peaks.datasheet_peak(SLICE, "bf16", multiprocessors=16)
    assert peak.tflops == pytest.approx(989.5 * 16 / 132) and "16/132 multiprocessors" in peak.source
    assert "MIG slice" in peak.source


def test_a_mig_slice_without_its_count_has_no_peak_and_a_whole_gpu_keeps_the_datasheet():
    assert peaks.datasheet_peak(SLICE, "bf16") is None
    assert peaks.datasheet_peak("NVIDIA H100 80GB HBM3", "bf16", multiprocessors=132).tflops == 989.5
    assert peaks.datasheet_peak("NVIDIA H100 80GB HBM3", "bf16").tflops == 989.5


@pytest.mark.parametrize("name, gpu, eighths, whole_tbs", [
    (SLICE, "NVIDIA H100 SXM", 1, 3.35), ("NVIDIA H200 MIG 1g.18gb", "NVIDIA H200", 1, 4.8),
    ("NVIDIA H200 MIG 1g.35gb", "NVIDIA H200", 2, 4.8), ("NVIDIA H200 MIG 3g.71gb", "NVIDIA H200", 4, 4.8),
    ("NVIDIA A100-SXM4-40GB MIG 2g.10gb", "NVIDIA A100 40GB", 2, 1.555),
    ("NVIDIA A100 80GB PCIe MIG 7g.80gb", "NVIDIA A100 80GB PCIe", 8, 1.935),
])
def test_a_mig_slice_gets_the_bandwidth_of_its_memory_slices(name, gpu, eighths, whole_tbs):
    """A slice's memory comes in eighths of the GPU's, each with an eighth of its bandwidth: against the whole GPU's,
    a 1g slice's MBU would read eight times too low. The label names the GPU, the slice's profile and its share."""
    peak = bandwidth.datasheet_peak(name)
    assert peak.bytes_per_s == pytest.approx(whole_tbs * 1e12 * eighths / 8, rel=1e-15)
    assert (peak.name, peak.source) == (f"{gpu}, MIG {name.split()[-1]}: {eighths}/8 of its memory", "datasheet")


def test_a_mig_slice_without_its_profile_has_no_datasheet_bandwidth_and_no_datasheet_roofs():
    assert bandwidth.datasheet_peak("NVIDIA H100 80GB HBM3 MIG") is None
    assert limits.datasheet_roofs(SLICE) is None  # the table's rates are the whole GPU's
    assert limits.datasheet_roofs("NVIDIA H100 80GB HBM3")[1] == pytest.approx(3.35)


def test_a_stored_run_on_a_mig_slice_leaves_its_mfu_out_and_says_why(tmp_path, monkeypatch):
    config = RunConfig(amp_dtype="bf16")
    record = {"technique": "all_together", "environment": {"gpu_name": SLICE},
              "effective_configs": {"resnet18": {"baseline": config.__dict__}},
              "summary": [{"model": "resnet18", "variant": "baseline", "phase": "train", "tflops": 50.0}]}
    (tmp_path / "h100-mig").mkdir()
    (tmp_path / "h100-mig" / "all_together.json").write_text(json.dumps(record))
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path)
    monkeypatch.setattr(store, "reference_machines", lambda: ["h100-mig"])
    monkeypatch.setattr(store, "load_record", lambda path: json.loads(path.read_text()))
    table = peaks.reference_mfu()
    assert table["MFU %"].isna().all() and "MIG slice" in table["peak source"].iloc[0], table


@pytest.mark.cuda
@pytest.mark.parametrize("precision, config", [("bf16", RunConfig(amp_dtype="bf16", model="gpt_tiny", workload="gpt")),
                                               ("fp8", RunConfig(amp_dtype="bf16", fp8=True, model="gpt_tiny",
                                                                 workload="gpt"))])
def test_the_peak_and_mfu_on_this_gpu_follow_its_multiprocessors(precision, config):
    """On CUDA (FP8 where the GPU has it: compute capability 8.9+): the peak is the datasheet's share for this
    device's multiprocessors, or a measured FP8/bf16 matmul where the table lacks it; an MFU against it is a share."""
    info = resolve_device("cuda")
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9 or newer")
    peak = peaks.peak_for(config, info)
    assert peak.precision == precision and peak.tflops > 0
    listed = peaks.datasheet_entry(info.name)
    if listed and precision in listed[1]:
        share = torch.cuda.get_device_properties(0).multi_processor_count / peaks.FULL_MULTIPROCESSORS[listed[0]]
        assert peak.tflops == pytest.approx(listed[1][precision] * min(share, 1.0))
    achieved = peaks.measured_peak(info, precision).tflops
    assert 0 < achieved / peak.tflops < 1.5, (achieved, peak)
