"""What the GPU did while a part ran: the energy it used, the time it spent held back by its power or thermal limits,
and its SM clock, temperature and clock-event reasons sampled by a light thread during the part.

Read before and after a part, a GPU is idle: its clocks are idle clocks and its reason is ``gpu_idle``. So the
counters NVML keeps (total energy, power and thermal violation time) are differenced over the part, and a thread
samples the rest every :data:`SAMPLE_S` while it runs. Without NVML (the ``nvidia-ml-py`` package), nvidia-smi is
sampled every :data:`SMI_SAMPLE_S`, seldom because each sample starts a process beside the timed work (a CPU core
for tens of milliseconds), the source column says so, and the counters are left empty.
"""
from __future__ import annotations

import statistics
import threading
import time
from types import ModuleType
from typing import Any, Callable

from .gpu_state import (
    NO_GPU, UNREADABLE, gpu_id, load_nvml, nvml_handle, read_smi, throttle_mask, throttle_names,
    throttled,
)

SAMPLE_S = 0.25  # NVML sampling period: cheap calls, well under a repeat
SMI_SAMPLE_S = 10.0  # nvidia-smi sampling period: a process each time, so seldom (a part's start, then every 10 s)
SMI_SOURCE = "nvidia-smi every {:g} s (nvidia-ml-py is not installed)"  # the source column, with the period
POWER, THERMAL = 0, 1  # NVML_PERF_POLICY_POWER and NVML_PERF_POLICY_THERMAL


def _optional(read: Callable, *args: Any) -> Any:
    try:
        return read(*args)
    except Exception:  # noqa: BLE001  (NVMLError_NotSupported and kin)
        return None


def nvml_counters(nvml: ModuleType, handle: Any) -> dict[str, float | None]:
    """NVML's running counters: total energy (J) and power and thermal violation time (s), None where unsupported."""
    energy = _optional(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)  # millijoules since the driver loaded
    counters: dict[str, float | None] = {"energy_j": energy / 1000 if energy is not None else None}
    for name, policy in (("power_violation_s", POWER), ("thermal_violation_s", THERMAL)):
        status = _optional(nvml.nvmlDeviceGetViolationStatus, handle, policy)
        counters[name] = status.violationTime / 1e9 if status is not None else None  # nanoseconds
    return counters


def nvml_sample(nvml: ModuleType, handle: Any) -> dict[str, Any]:
    """One sample: SM clock (MHz), temperature (C) and the clock-event reasons bitmask."""
    return {"sm_clock_mhz": _optional(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
            "temperature_c": _optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
            "mask": throttle_mask(nvml, handle)}


def _smi_sample(gpu: str) -> dict[str, Any]:
    state = read_smi(gpu) or {}
    names = state.get("throttle_reasons")
    return {"sm_clock_mhz": state.get("sm_clock_mhz"), "temperature_c": state.get("temperature_c"),
            "names": names.split("+") if isinstance(names, str) else []}


def _spread(values: list[float], key: str) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    return {f"{key}_min": min(values, default=None), f"{key}_median": statistics.median(values) if values else None,
            f"{key}_max": max(values, default=None)}


def summarize(samples: list[dict[str, Any]], first: dict[str, float | None], last: dict[str, float | None],
              seconds: float, power_limit_w: float | None) -> dict[str, Any]:
    """A part's GPU columns from its samples and its counters at the start (``first``) and end (``last``): energy
    and mean power, violation seconds, SM clock and temperature min/median/max, the reasons seen, ``throttled``."""
    row: dict[str, Any] = {}
    for key in ("energy_j", "power_violation_s", "thermal_violation_s"):
        row[key] = round(last[key] - first[key], 3) if last.get(key) is not None and first.get(key) is not None \
            else None
    row["mean_power_w"] = round(row["energy_j"] / seconds, 1) if row["energy_j"] is not None and seconds > 0 else None
    row["power_limit_w"] = power_limit_w
    row |= _spread([s["sm_clock_mhz"] for s in samples], "sm_clock_mhz")
    row |= _spread([s["temperature_c"] for s in samples], "temperature_c")
    mask = 0
    for sample in samples:
        mask |= sample.get("mask") or 0
    names = {name for sample in samples for name in sample.get("names", [])} | set(throttle_names(mask).split("+"))
    row["throttle_reasons"] = ("+".join(sorted(names - {"none"})) or "none") if samples else None
    row["gpu_samples"] = len(samples)
    violated = any((row[key] or 0) > 0 for key in ("power_violation_s", "thermal_violation_s"))
    row["throttled"] = "yes" if violated or throttled(row["throttle_reasons"]) else "no"
    return row


class PartWatch:
    """Watches the GPU of ``device`` (a torch.device) from :meth:`start` to :meth:`stop`; on the CPU it only says
    there is no GPU. ``nvml``: the bindings to use (default: :func:`~optlab.core.machine.gpu_state.load_nvml`)."""

    def __init__(self, device: Any, nvml: ModuleType | None = None, interval_s: float | None = None) -> None:
        self.device, self.nvml, self.interval_s = device, nvml, interval_s
        self.samples: list[dict[str, Any]] = []
        self.handle: Any = None
        self.first: dict[str, float | None] = {}
        self.power_limit_w: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started, self._interval = 0.0, 0.0
        self._read: Callable[[], dict[str, Any]] | None = None

    def start(self) -> None:
        """Read the counters and start sampling (nothing on the CPU, or where neither NVML nor nvidia-smi reads)."""
        if getattr(self.device, "type", "cpu") != "cuda":
            return
        gpu = gpu_id(self.device.index or 0)
        self.nvml = self.nvml or load_nvml()
        if self.nvml is not None:
            try:
                self.handle = nvml_handle(self.nvml, gpu)
            except Exception:  # noqa: BLE001  (a GPU NVML does not know: nvidia-smi is sampled instead)
                self.handle = None
        if self.handle is not None:
            nvml, handle = self.nvml, self.handle
            self._read, interval = (lambda: nvml_sample(nvml, handle)), self.interval_s or SAMPLE_S
            self.first = nvml_counters(nvml, handle)
            limit = _optional(nvml.nvmlDeviceGetPowerManagementLimit, handle)
            self.power_limit_w = limit / 1000 if limit is not None else None
        else:
            self._read, interval = (lambda: _smi_sample(gpu)), self.interval_s or SMI_SAMPLE_S
        self._started, self._interval = time.monotonic(), interval
        self._thread = threading.Thread(target=self._loop, args=(interval,), name="optlab-gpu-sampler", daemon=True)
        self._thread.start()

    def _loop(self, interval: float) -> None:
        while True:
            self.samples.append(self._read())
            if self._stop.wait(interval):
                return

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the part's GPU columns (:func:`summarize`), or the note that there is no GPU state."""
        if getattr(self.device, "type", "cpu") != "cuda":
            return {"gpu_state": NO_GPU}
        if self._thread is None:
            return {"gpu_state": UNREADABLE}
        self._stop.set()
        self._thread.join()
        self._thread = None
        seconds = time.monotonic() - self._started
        last = nvml_counters(self.nvml, self.handle) if self.handle is not None else {}
        if self.handle is not None:
            _optional(self.nvml.nvmlShutdown)
        row = summarize(self.samples, self.first, last, seconds, self.power_limit_w)
        if self.handle is None and not any(s["sm_clock_mhz"] is not None for s in self.samples):
            return {"gpu_state": UNREADABLE}
        return {"gpu_state_source": "NVML" if self.handle is not None else SMI_SOURCE.format(self._interval), **row}
