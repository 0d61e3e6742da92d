"""The GPU paths a CPU cannot take, each checked on CUDA (marked ``cuda``: make gpu-check runs them; a CPU skips
them): the int8 and int4 kernels' error in bf16, and a reference run of two parts, archived, with what the GPU did
during each part."""
import csv
import tarfile

import pytest
import torch

from optlab.commands import reference
from optlab.commands.cli import main
from optlab.commands.reference import running
from optlab.core.gpt.transformer import GPT, GPT_SIZES
from optlab.studies.serving import quantization as q


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", q.SCHEMES)
def test_the_int8_and_int4_kernels_multiply_by_their_weights_within_the_bound_on_cuda_in_bf16(scheme):
    """The CUDA kernels (int4: ``_weight_int4pack_mm``, int8: the dequantizing ``F.linear``) are not the CPU's: their
    weights, read through the identity, lie within the rounding bound of the originals in bf16."""
    torch.manual_seed(0)
    model = GPT(GPT_SIZES["gpt_tiny"]).eval().to("cuda", torch.bfloat16)
    assert scheme != "int4" or q.int4_support("cuda", torch.bfloat16) is None
    error = q.largest_error_in_steps(model, q.quantize(model, scheme))
    kernel = q.int8_kernel("cuda", torch.bfloat16)
    assert q.ROUNDING_STEPS - 0.01 < error <= q.error_bound(torch.bfloat16), (scheme, kernel, error)


@pytest.mark.cuda
def test_a_two_part_reference_run_on_cuda_is_archived_with_the_gpus_state(monkeypatch, tmp_path):
    """Two seed parts on ResNet18 in the smoke profile, on the GPU, packed after each: both records, the parts list
    with each part's GPU columns, and the log, in the archive."""
    seed_plan = reference.plan
    monkeypatch.setattr(running, "plan", lambda set_name, profile, measured=None: [
        part for part in seed_plan(set_name, profile, measured) if part.model == "resnet18"][:2])
    out, packed = tmp_path / "gpu", tmp_path / "gpu.tar.gz"
    assert main(["reference", "--set", "seed", "--profile", "smoke", "--device", "cuda", "--quiet", "--repeats", "2",
                 "--max-repeats", "2", "--out", str(out), "--archive", str(packed)]) == 0
    rows = list(csv.DictReader((out / "reference-parts.csv").open()))
    assert len(rows) == 2 and all(row["status"] == "ok" and row["device_name"] == torch.cuda.get_device_name()
                                  for row in rows), rows
    assert all(row.get("gpu_state_source") in ("NVML", "nvidia-smi every 10 s (nvidia-ml-py is not installed)")
               and int(row["gpu_samples"]) >= 1 for row in rows), rows
    with tarfile.open(packed) as archive:
        names = set(archive.getnames())
    assert {"gpu/reference-parts.csv", "gpu/reference.log"} < names and len(names) == 4, names
