import pytest
import torch

from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import DeviceInfo, effective_config, resolve_device
from optlab.core.errors import OptlabError


def test_cpu_resolves_with_its_dtypes():
    info = resolve_device("cpu")
    assert info.device == torch.device("cpu") and not info.is_cuda
    assert info.amp_dtypes == ("none", "fp16", "bf16")
    assert "cpu" in info.describe()


def test_auto_picks_cuda_only_when_present():
    assert resolve_device("auto").is_cuda == torch.cuda.is_available()


def test_cuda_asked_for_but_absent(no_cuda):
    with pytest.raises(OptlabError, match="CUDA is not available on this machine"):
        resolve_device("cuda")


def test_unknown_device():
    with pytest.raises(OptlabError, match="unknown device 'tpu'; choose one of: auto, cpu, cuda"):
        resolve_device("tpu")


def test_cpu_reports_skipped_knobs_and_runs_them_off():
    config = RunConfig(pin_memory=True, non_blocking=True, cudnn_benchmark=True, channels_last=True)
    effective, notes = effective_config(config, resolve_device("cpu"))
    assert (effective.pin_memory, effective.non_blocking, effective.cudnn_benchmark) == (False, False, False)
    assert effective.channels_last  # applied with its CPU meaning
    assert any(n.startswith("pin_memory: skipped") for n in notes)
    assert any(n.startswith("non_blocking: skipped") for n in notes)
    assert any(n.startswith("cudnn_benchmark: skipped") for n in notes)
    assert any(n.startswith("channels_last: applied") for n in notes)


def test_more_workers_than_cpus_is_noted():
    _, notes = effective_config(RunConfig(num_workers=1000), resolve_device("cpu"))
    assert any("more loader workers than this machine" in n for n in notes)


def test_dtype_the_device_lacks():
    no_bf16 = DeviceInfo(torch.device("cpu"), "old gpu", ("none", "fp16"))
    with pytest.raises(OptlabError, match="AMP dtype 'bf16' is not supported on old gpu; this device allows: none, fp16"):
        effective_config(RunConfig(amp_dtype="bf16"), no_bf16)
