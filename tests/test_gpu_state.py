"""The GPU's state in every record: NVML read through a fake module, nvidia-smi's line, and the CPU's plain note."""
import sys
from types import SimpleNamespace

import pytest
import torch

from optlab.core import gpu_state
from optlab.core.device import resolve_device
from optlab.core.environment import capture, report


class FakeNVMLError(Exception):
    pass


def fake_nvml(mask=0x4 | 0x40, mig=(1, 0), supports_mig=True):
    """NVML as pynvml exposes it, for one H200 at a 700 W cap drawing 650 W."""
    calls = []

    def unsupported(*args):
        raise FakeNVMLError("Not Supported")

    return SimpleNamespace(
        calls=calls, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: b"570.86.15",
        nvmlDeviceGetHandleByUUID=lambda uuid: ("handle", uuid),
        nvmlDeviceGetHandleByIndex=lambda index: ("handle", index),
        nvmlDeviceGetClockInfo=lambda handle, clock: {1: 1980, 2: 3201}[clock],
        nvmlDeviceGetPowerManagementLimit=lambda handle: 700_000,
        nvmlDeviceGetPowerUsage=lambda handle: 650_123,
        nvmlDeviceGetTemperature=lambda handle, sensor: 61,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda handle: mask,
        nvmlDeviceGetPersistenceMode=lambda handle: 1,
        nvmlDeviceGetMigMode=(lambda handle: mig) if supports_mig else unsupported,
    )


def test_nvml_clocks_power_and_throttle_reasons_decoded_to_names():
    state = gpu_state.read_nvml(fake_nvml(), "GPU-1234")
    assert state == {"driver": "570.86.15", "sm_clock_mhz": 1980, "mem_clock_mhz": 3201, "power_limit_w": 700.0,
                     "power_draw_w": 650.123, "temperature_c": 61,
                     "throttle_reasons": "sw_power_cap+hw_thermal_slowdown", "persistence_mode": "enabled",
                     "mig_mode": "enabled"}
    assert gpu_state.throttled(state["throttle_reasons"])


def test_throttle_bitmask_names_and_what_counts_as_throttled():
    assert gpu_state.throttle_names(0) == "none"
    assert gpu_state.throttle_names(0x1) == "gpu_idle" and not gpu_state.throttled("gpu_idle")
    assert gpu_state.throttle_names(0x8 | 0x1000) == "hw_slowdown+other 0x1000"
    assert gpu_state.throttled("gpu_idle+sw_power_cap") and not gpu_state.throttled("none")
    assert not gpu_state.throttled(None)


def test_a_query_the_gpu_does_not_support_is_left_empty():
    state = gpu_state.read_nvml(fake_nvml(mask=0, supports_mig=False), "0")
    assert state["mig_mode"] is None and state["throttle_reasons"] == "none" and state["sm_clock_mhz"] == 1980


def test_a_missing_nvml_library_falls_back_to_nvidia_smi(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert gpu_state.load_nvml() is None
    broken = fake_nvml()
    broken.nvmlInit = lambda: (_ for _ in ()).throw(FakeNVMLError("NVML Shared Library Not Found"))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert gpu_state.load_nvml() is None
    line = "570.86.15, 1980, 3201, 700.00, 651.20, 61, 0x0000000000000004, Enabled, [N/A]"
    monkeypatch.setattr(gpu_state, "gpu_id", lambda index: "GPU-1234")
    monkeypatch.setattr(gpu_state, "read_smi", lambda gpu: gpu_state.parse_smi(line))
    state = gpu_state.read_state(torch.device("cuda", 0))
    assert state["gpu_state_source"] == "nvidia-smi" and state["throttle_reasons"] == "sw_power_cap"
    assert state["power_limit_w"] == 700 and state["power_draw_w"] == 651.2 and state["mig_mode"] is None
    assert state["persistence_mode"] == "enabled" and state["driver"] == "570.86.15"
    monkeypatch.setattr(gpu_state, "read_smi", lambda gpu: None)
    assert gpu_state.read_state(torch.device("cuda", 0)) == {"gpu_state": gpu_state.UNREADABLE}


def test_nvml_wins_when_present_and_is_shut_down(monkeypatch):
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_state, "gpu_id", lambda index: "GPU-1234")
    monkeypatch.setattr(gpu_state, "read_smi", lambda gpu: pytest.fail("nvidia-smi read although NVML works"))
    state = gpu_state.read_state(torch.device("cuda", 0))
    assert state["gpu_state_source"] == "NVML" and state["sm_clock_mhz"] == 1980
    assert nvml.calls == ["init", "shutdown"]


def test_on_the_cpu_the_environment_says_plainly_there_is_no_gpu_state():
    env = capture(resolve_device("cpu"), "stand-in", "smoke")
    assert env["gpu_state"] == "no GPU state: this run is on the CPU"
    assert "sm_clock_mhz" not in env and "driver" not in env
    assert "no GPU state: this run is on the CPU" in report(env)
