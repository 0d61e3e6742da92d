"""The GPU's state in every record: NVML read through a fake module, nvidia-smi's line, and the CPU's plain note."""
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from optlab.core.machine import gpu_sampler, gpu_state
from optlab.core.machine.device import resolve_device
from optlab.core.machine.environment import capture, report


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


def test_the_board_limit_and_reliability_bits_are_decoded_and_count_as_throttling():
    assert gpu_state.throttle_names(0x200 | 0x400) == "board_limit+reliability"
    assert gpu_state.throttled("board_limit") and gpu_state.throttled("reliability")
    assert gpu_state.throttle_names(0x800) == "other 0x800"  # a bit NVML does not define (yet) is kept, as a number


def test_a_mig_slice_is_read_through_its_parent_gpu():
    nvml = fake_nvml()
    slices = {"MIG-abcd": ("slice", "MIG-abcd")}
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: slices.get(uuid) or (_ for _ in ()).throw(FakeNVMLError("Not Found"))
    nvml.nvmlDeviceIsMigDeviceHandle = lambda handle: handle[0] == "slice"
    nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = lambda handle: ("handle", "GPU-parent")
    nvml.nvmlDeviceGetClockInfo = lambda handle, clock: {("handle", "GPU-parent"): 1980}[handle]  # the slice has none
    assert gpu_state.nvml_handle(nvml, "MIG-abcd") == ("handle", "GPU-parent")
    assert gpu_state.nvml_handle(nvml, "GPU-abcd") == ("handle", "GPU-parent")  # a slice's UUID given as a GPU's
    assert gpu_state.read_nvml(nvml, "MIG-abcd")["sm_clock_mhz"] == 1980
    listing = ("GPU 0: NVIDIA H200 (UUID: GPU-parent)\n  MIG 1g.18gb     Device  0: (UUID: MIG-abcd)\n"
               "GPU 1: NVIDIA H200 (UUID: GPU-other)\n")
    assert gpu_state.smi_parent(listing, "MIG-abcd") == "GPU-parent"


SMI_VALUES = {"driver_version": "570.86.15", "clocks.current.sm": "1980", "clocks.sm": "1980",
              "clocks.current.memory": "3201", "clocks.mem": "3201", "power.limit": "700.00", "power.draw": "651.20",
              "temperature.gpu": "61", "clocks_throttle_reasons.active": "0x0000000000000004",
              "persistence_mode": "Enabled", "mig.mode.current": "Disabled"}


def fake_smi(known):
    """nvidia-smi that knows the fields ``known`` and refuses any query naming another, as it does."""
    asked = []

    def smi(*arguments):
        asked.append(arguments)
        if arguments == ("-L",):
            return "GPU 0: NVIDIA H200 (UUID: GPU-1234)"
        names = next(a for a in arguments if a.startswith("--query-gpu=")).split("=", 1)[1].split(",")
        return None if any(name not in known for name in names) else ", ".join(known[name] for name in names)
    return smi, asked


def test_one_field_nvidia_smi_does_not_know_loses_that_field_only(monkeypatch):
    known = {name: value for name, value in SMI_VALUES.items() if name != "mig.mode.current"}
    smi, asked = fake_smi(known)  # an older driver: the old throttle name only, and no MIG field
    monkeypatch.setattr(gpu_state, "_smi", smi)
    state = gpu_state.read_smi("GPU-1234")
    assert state["mig_mode"] is None and state["throttle_reasons"] == "sw_power_cap"  # the deprecated name, second
    assert state["sm_clock_mhz"] == 1980 and state["power_draw_w"] == 651.2 and state["driver"] == "570.86.15"
    current = gpu_state.SMI_FIELDS["throttle_reasons"][0]
    assert current == "clocks_event_reasons.active"
    tried = [a for a in asked if any("reasons" in part for part in a)]
    assert current in tried[1][2] and "clocks_throttle_reasons" in tried[2][2]  # the current name before the old one
    smi, asked = fake_smi({**SMI_VALUES, current: "0x0000000000000001"})
    monkeypatch.setattr(gpu_state, "_smi", smi)
    assert gpu_state.read_smi("GPU-1234")["throttle_reasons"] == "gpu_idle" and len(asked) == 1  # one query when known


def counting_nvml(gpu):
    """NVML whose counters and readings come from the dict ``gpu``, which a test changes while a part runs."""
    nvml = fake_nvml()
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda handle: gpu["energy_mj"]
    nvml.nvmlDeviceGetViolationStatus = lambda handle, policy: SimpleNamespace(
        referenceTime=0, violationTime=gpu["power_ns" if policy == 0 else "thermal_ns"])
    nvml.nvmlDeviceGetClockInfo = lambda handle, clock: gpu["sm"]
    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: gpu["temp"]
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda handle: gpu["mask"]
    return nvml


IDLE = {"energy_mj": 5_000_000, "power_ns": 7_000_000_000, "thermal_ns": 0, "sm": 1980, "temp": 35, "mask": 0x1}


def _watched_part(monkeypatch, busy, end=None, seconds=0.3):
    """A part on a fake GPU: idle at its start and end, ``busy`` while it runs, ``end`` counters when it ends."""
    gpu = dict(IDLE)
    monkeypatch.setattr(gpu_sampler, "gpu_id", lambda index: "GPU-1234")
    watch = gpu_sampler.PartWatch(torch.device("cuda", 0), nvml=counting_nvml(gpu), interval_s=0.02)
    watch.start()
    time.sleep(0.05)
    gpu.update(busy)
    time.sleep(seconds)
    gpu.update({**IDLE, **(end or {})})
    time.sleep(0.05)
    return watch.stop()


def test_energy_and_the_violation_counters_are_differences_over_the_part(monkeypatch):
    row = _watched_part(monkeypatch, {"sm": 1980, "mask": 0x0, "temp": 60},
                        end={"energy_mj": 5_000_000 + 42_000, "power_ns": 7_000_000_000 + 250_000_000})
    assert row["energy_j"] == 42.0 and row["power_violation_s"] == 0.25 and row["thermal_violation_s"] == 0.0
    assert 42.0 / 1.0 < row["mean_power_w"] < 42.0 / 0.3  # over the part's 0.4 s or so
    assert row["throttled"] == "yes"  # held back by its power limit for a quarter of a second
    assert row["gpu_state_source"] == "NVML" and row["power_limit_w"] == 700.0


def test_a_part_is_flagged_throttled_from_samples_taken_while_it_ran(monkeypatch):
    row = _watched_part(monkeypatch, {"sm": 1410, "temp": 83, "mask": 0x20 | 0x200})
    assert row["power_violation_s"] == 0.0 and row["thermal_violation_s"] == 0.0  # the counters saw nothing
    assert row["sm_clock_mhz_min"] == 1410 and row["sm_clock_mhz_max"] == 1980 and row["temperature_c_max"] == 83
    assert row["throttle_reasons"] == "board_limit+gpu_idle+sw_thermal_slowdown" and row["throttled"] == "yes"
    assert row["gpu_samples"] >= 5
    calm = _watched_part(monkeypatch, {"sm": 1980, "temp": 60, "mask": 0x0})
    assert calm["throttled"] == "no" and calm["throttle_reasons"] == "gpu_idle"  # idle at its ends is not throttling


def test_on_the_cpu_a_watch_reads_nothing():
    watch = gpu_sampler.PartWatch(torch.device("cpu"))
    watch.start()
    assert watch.stop() == {"gpu_state": gpu_state.NO_GPU} and watch.samples == []


def test_without_nvml_nvidia_smi_is_sampled_seldom_and_named(monkeypatch):
    """Each nvidia-smi sample is a process started beside the timed work: a 2.5 s part reads it once (at its
    start), and the parts list says the GPU's state came from nvidia-smi and how often."""
    reads = []
    monkeypatch.setattr(gpu_sampler, "gpu_id", lambda index: "GPU-1234")
    monkeypatch.setattr(gpu_sampler, "load_nvml", lambda: None)
    monkeypatch.setattr(gpu_sampler, "read_smi", lambda gpu: reads.append(gpu) or {
        "sm_clock_mhz": 1980, "temperature_c": 40, "throttle_reasons": "none"})
    watch = gpu_sampler.PartWatch(torch.device("cuda", 0))
    watch.start()
    time.sleep(2.5)
    row = watch.stop()
    assert reads == ["GPU-1234"] and row["gpu_samples"] == 1
    assert row["gpu_state_source"] == "nvidia-smi every 10 s (nvidia-ml-py is not installed)"


@pytest.mark.cuda
def test_nvml_samples_this_gpu_while_a_part_runs():
    """On a GPU with nvidia-ml-py: samples every quarter second while matmuls run, the SM clock read, and the energy
    counter differenced over the part where the GPU keeps one."""
    pytest.importorskip("pynvml")
    watch = gpu_sampler.PartWatch(torch.device("cuda", 0))
    watch.start()
    a = torch.randn(4096, 4096, device="cuda")
    ended = time.monotonic() + 1.5
    while time.monotonic() < ended:
        a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    row = watch.stop()
    assert row["gpu_state_source"] == "NVML" and row["gpu_samples"] >= 4, row
    assert row["sm_clock_mhz_max"] > 0 and row["throttled"] in ("yes", "no")
    assert row["energy_j"] is None or row["energy_j"] > 0
