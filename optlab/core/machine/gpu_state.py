"""What the GPU was doing: driver, clocks, power, temperature, throttle reasons, persistence and MIG mode.

Clocks, the power cap and throttling change GPU timings, so a record states them. They are read from NVML (the
``pynvml`` module of the ``nvidia-ml-py`` package, imported only when a GPU is measured) or, where that is not
installed, from ``nvidia-smi --query-gpu``; on the CPU there is nothing to read, and the state says so.
"""
from __future__ import annotations

import importlib
import subprocess
from types import ModuleType
from typing import Any

NO_GPU = "no GPU state: this run is on the CPU"
UNREADABLE = "no GPU state: neither NVML (pip install nvidia-ml-py) nor nvidia-smi could be read"

# NVML's clock throttle (since driver 535: "clock event") reason bits, named as nvidia-smi names them
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",  # the board's operating limit policy
    0x400: "reliability",  # the reliability policy
}
# the reasons that slow a busy GPU below the clocks it was set to: a part that met one is flagged as throttled
SLOWING = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
           "board_limit", "reliability")

SMI_FIELDS = {  # the key a record keeps: its nvidia-smi --query-gpu names, the current one first, then older ones
    "driver": ("driver_version",), "sm_clock_mhz": ("clocks.current.sm", "clocks.sm"),
    "mem_clock_mhz": ("clocks.current.memory", "clocks.mem"), "power_limit_w": ("power.limit",),
    "power_draw_w": ("power.draw",), "temperature_c": ("temperature.gpu",),
    "throttle_reasons": ("clocks_event_reasons.active", "clocks_throttle_reasons.active"),
    "persistence_mode": ("persistence_mode",), "mig_mode": ("mig.mode.current",),
}


def throttle_names(mask: int) -> str:
    """The reasons set in NVML's bitmask, as names joined by ``+`` (``none`` for 0)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    if unknown:
        names.append(f"other 0x{unknown:x}")
    return "+".join(names) or "none"


def throttled(reasons: object) -> bool:
    """Whether a state's throttle reasons include one that slows a busy GPU (a power cap, a thermal or hardware
    slowdown); idle and clock settings do not count."""
    return isinstance(reasons, str) and any(name in reasons.split("+") for name in SLOWING)


def load_nvml() -> ModuleType | None:
    """NVML's Python bindings (``pynvml`` of nvidia-ml-py), or None where they or the library are missing."""
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001  (ImportError, or NVMLError: no driver library; nvidia-smi is tried next)
        return None
    return nvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(read, *args) -> Any:
    """One NVML query, or None where this GPU or driver does not support it (MIG on a consumer GPU)."""
    try:
        return read(*args)
    except Exception:  # noqa: BLE001  (NVMLError_NotSupported and kin)
        return None


def nvml_handle(nvml: ModuleType, gpu: str) -> Any:
    """NVML's handle of the physical GPU ``gpu`` names (a ``GPU-`` or ``MIG-`` UUID, or an index as text): a MIG
    slice's clocks, power and temperature are its parent's, so a slice resolves to its parent device. A UUID given
    with the wrong prefix (``GPU-`` for a slice) is tried with the other."""
    if not gpu.startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByIndex(int(gpu))
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(gpu)
    except Exception:  # noqa: BLE001  (NVMLError_NotFound: try the slice's prefix)
        handle = nvml.nvmlDeviceGetHandleByUUID(("MIG-" if gpu.startswith("GPU-") else "GPU-") + gpu[4:])
    is_slice = getattr(nvml, "nvmlDeviceIsMigDeviceHandle", None)
    if is_slice is not None and _optional(is_slice, handle):
        handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
    return handle


def throttle_mask(nvml: ModuleType, handle: Any) -> int | None:
    """The clock event (throttle) reasons bitmask now, or None where unsupported."""
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return _optional(reasons, handle)


def read_nvml(nvml: ModuleType, gpu: str) -> dict[str, Any]:
    """The state of GPU ``gpu`` (a ``GPU-`` or ``MIG-`` UUID, or an NVML index as text) through ``nvml``."""
    handle = nvml_handle(nvml, gpu)
    mask = throttle_mask(nvml, handle)
    limit, draw = _optional(nvml.nvmlDeviceGetPowerManagementLimit, handle), _optional(nvml.nvmlDeviceGetPowerUsage, handle)
    mig = _optional(nvml.nvmlDeviceGetMigMode, handle)
    persistence = _optional(nvml.nvmlDeviceGetPersistenceMode, handle)
    return {
        "driver": _text(nvml.nvmlSystemGetDriverVersion()),
        "sm_clock_mhz": _optional(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
        "mem_clock_mhz": _optional(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM),
        "power_limit_w": limit / 1000 if limit is not None else None,  # NVML gives milliwatts
        "power_draw_w": draw / 1000 if draw is not None else None,
        "temperature_c": _optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
        "throttle_reasons": throttle_names(mask) if mask is not None else None,
        "persistence_mode": None if persistence is None else "enabled" if persistence else "disabled",
        "mig_mode": None if mig is None else "enabled" if mig[0] else "disabled",  # (current, pending)
    }


def _number(text: str) -> float | int | None:
    try:
        value = float(text.split()[0])
    except (ValueError, IndexError):
        return None
    return int(value) if value.is_integer() else value


def parse_smi(line: str) -> dict[str, Any]:
    """One line of ``nvidia-smi --query-gpu=<SMI_FIELDS' first names> --format=csv,noheader,nounits`` as a state."""
    return smi_state(dict(zip(SMI_FIELDS, (part.strip() for part in line.split(",")))))


def smi_state(values: dict[str, str]) -> dict[str, Any]:
    """The state from nvidia-smi's text of each key (a key missing: a field no name of which was read)."""
    values = {key: text for key, text in values.items() if text is not None}
    state: dict[str, Any] = {key: values.get(key) for key in SMI_FIELDS}
    for key in ("sm_clock_mhz", "mem_clock_mhz", "power_limit_w", "power_draw_w", "temperature_c"):
        state[key] = _number(values.get(key, ""))
    mask = values.get("throttle_reasons", "")
    state["throttle_reasons"] = throttle_names(int(mask, 16)) if mask.startswith("0x") else None
    for key in ("persistence_mode", "mig_mode"):
        state[key] = {"Enabled": "enabled", "Disabled": "disabled"}.get(values.get(key, ""))
    return state


def _smi(*arguments: str) -> str | None:
    """nvidia-smi's output, or None where it is missing or refuses (an unknown field, an unknown GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", *arguments], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def smi_parent(listing: str, mig: str) -> str | None:
    """The ``GPU-`` UUID of the GPU that MIG slice ``mig`` is part of, from ``nvidia-smi -L``'s listing."""
    parent = None
    for line in listing.splitlines():
        if line.startswith("GPU ") and "UUID: GPU-" in line:
            parent = line.split("UUID: ", 1)[1].rstrip(")").strip()
        elif mig in line:
            return parent
    return None


def read_smi(gpu: str) -> dict[str, Any] | None:
    """The state of GPU ``gpu`` from nvidia-smi (a MIG slice: its parent's), or None where it is missing or fails.
    All fields are asked at once; where nvidia-smi refuses that, each field alone, its current name first, so that
    one field this driver does not know is the only one lost."""
    if gpu.startswith("MIG-"):
        gpu = smi_parent(_smi("-L") or "", gpu) or gpu
    query = lambda *names: _smi("-i", gpu, f"--query-gpu={','.join(names)}", "--format=csv,noheader,nounits")
    out = query(*(names[0] for names in SMI_FIELDS.values()))
    if out:
        return parse_smi(out.splitlines()[0])
    values = {key: next((text for name in names if (text := query(name))), None) for key, names in SMI_FIELDS.items()}
    return smi_state(values) if any(values.values()) else None


def gpu_id(index: int) -> str:
    """How NVML and nvidia-smi name CUDA device ``index``: its UUID (their own indices ignore CUDA_VISIBLE_DEVICES),
    or the index where torch does not give the UUID."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:
        return str(index)
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def read_state(device: Any) -> dict[str, Any]:
    """The state of ``device`` (a torch.device): from NVML, else nvidia-smi, with ``gpu_state_source`` naming which;
    on the CPU only ``gpu_state`` with :data:`NO_GPU`."""
    if getattr(device, "type", "cpu") != "cuda":
        return {"gpu_state": NO_GPU}
    gpu = gpu_id(device.index or 0)
    nvml = load_nvml()
    if nvml is not None:
        try:
            return {"gpu_state_source": "NVML", **read_nvml(nvml, gpu)}
        except Exception:  # noqa: BLE001  (a handle NVML does not know: nvidia-smi is tried)
            pass
        finally:
            _optional(nvml.nvmlShutdown)
    state = read_smi(gpu)
    return {"gpu_state_source": "nvidia-smi", **state} if state is not None else {"gpu_state": UNREADABLE}
