"""The device's peak FLOP/s for a precision, named with its source, and model FLOPs utilisation (MFU).

A run's precision is the arithmetic most of its FLOPs ran in: a CNN's convolutions follow ``cudnn_tf32`` (on by
default), a GPT's matmuls follow ``matmul_tf32`` (off by default) and ``fp8``; autocast sets both. GPU peaks are NVIDIA's datasheet figures for dense tensor-core (or plain fp32) arithmetic, without the 2x of
structured sparsity. A device missing from the table (every CPU) gets the measured ceiling instead: the machine's
MAMF in that precision (the best over the ceilings sweep's shapes, the one the summary page reads too), labelled as
measured, not as a datasheet peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import pandas as pd
import torch

from ...core.results import store
from ...core.knobs.config import RunConfig
from ...core.machine.device import DeviceInfo
from ...core.measuring.flops import forward_flop_counts
from . import ceilings

# (name fragments that must all appear in torch.cuda.get_device_name, table name, TFLOP/s by precision), the first
# match wins. Hopper rows: NVIDIA's H100 and H200 pages, "Specifications" (https://www.nvidia.com/en-us/data-center/h100/,
# columns H100 SXM and H100 NVL; https://www.nvidia.com/en-us/data-center/h200/, H200 SXM and H200 NVL), whose
# tensor-core figures are printed with sparsity and halved here; H100 PCIe: the earlier H100 datasheet's PCIe column.
DATASHEET_TFLOPS: tuple[tuple[tuple[str, ...], str, dict[str, float]], ...] = (
    (("H200", "NVL"), "NVIDIA H200 NVL",
     {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    (("H200",), "NVIDIA H200 SXM", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0}),
    (("H100", "NVL"), "NVIDIA H100 NVL",
     {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    (("H100", "PCIe"), "NVIDIA H100 PCIe",
     {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0}),
    (("H100",), "NVIDIA H100 SXM", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0}),
    (("A100",), "NVIDIA A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (("L4",), "NVIDIA L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5}),
    (("V100", "PCIE"), "NVIDIA V100 PCIe", {"fp32": 14.0, "fp16": 112.0}),
    (("V100",), "NVIDIA V100 SXM2", {"fp32": 15.7, "fp16": 125.0}),
)


# The whole GPU's streaming multiprocessors, per table name: a device with fewer (a MIG slice, a cut-down part) has
# that share of the peak (tensor-core rate is per multiprocessor, at the same clocks)
FULL_MULTIPROCESSORS = {"NVIDIA H200 NVL": 132, "NVIDIA H200 SXM": 132, "NVIDIA H100 NVL": 132,
                        "NVIDIA H100 PCIe": 114, "NVIDIA H100 SXM": 132, "NVIDIA A100": 108, "NVIDIA L4": 58,
                        "NVIDIA V100 PCIe": 80, "NVIDIA V100 SXM2": 80}


def is_mig(device_name: str) -> bool:
    """Whether ``device_name`` names a MIG slice (``NVIDIA H100 80GB HBM3 MIG 1g.10gb``), not a whole GPU."""
    return "MIG" in device_name.upper().split()


@dataclass(frozen=True)
class Peak:
    """A peak rate in TFLOP/s for one precision, and where the number comes from."""

    precision: str
    tflops: float
    source: str

    def describe(self) -> str:
        return f"{self.tflops:.3g} TFLOP/s {self.precision}: {self.source}"


def has_tf32(info: DeviceInfo) -> bool:
    """TF32 tensor cores: NVIDIA GPUs from Ampere (compute capability 8.0) on."""
    return info.is_cuda and torch.cuda.get_device_capability(info.device) >= (8, 0)


@lru_cache(maxsize=None)
def convolution_share(workload: str, model: str) -> float:
    """The share of a forward pass's FLOPs that ``model`` of ``workload`` spends in convolutions (the rest: matmuls),
    counted at its default sizes: a narrower width or a longer sequence moves it by far less than the half that
    decides which arithmetic dominates."""
    counts = forward_flop_counts(RunConfig(workload=workload, model=model))
    total = sum(counts.values())
    return sum(n for op, n in counts.items() if "convolution" in op) / total if total else 0.0


def convolution_precision(config: RunConfig, tf32: bool) -> str:
    """What convolutions run in: the autocast dtype, else TF32 where the GPU has it and ``cudnn_tf32`` allows it."""
    if config.amp_dtype != "none":
        return config.amp_dtype
    return "tf32" if tf32 and config.cudnn_tf32 else "fp32"


def matmul_precision(config: RunConfig, tf32: bool) -> str:
    """What the linear layers' matmuls run in: FP8 where ``fp8`` swapped them, else the autocast dtype, else TF32
    where the GPU has it and ``matmul_tf32`` allows it, else fp32. (Under ``fp8`` attention's matmuls and a tied head
    keep the autocast dtype, so MFU against the FP8 peak is a lower bound.)"""
    if config.fp8:
        return "fp8"
    if config.amp_dtype != "none":
        return config.amp_dtype
    return "tf32" if tf32 and config.matmul_tf32 else "fp32"


def precision_of(config: RunConfig, tf32: bool) -> str:
    """The arithmetic most of ``config``'s FLOPs run in (``tf32``: whether the device has TF32 tensor cores): its
    convolutions' where they hold most of the FLOPs (a CNN), else its matmuls' (a GPT, an MLP)."""
    if convolution_share(config.workload, config.model) > 0.5:
        return convolution_precision(config, tf32)
    return matmul_precision(config, tf32)


def datasheet_peak(device_name: str, precision: str, multiprocessors: int | None = None) -> Peak | None:
    """The datasheet peak of a GPU named ``device_name`` for ``precision``, or None if the table lacks it. A device
    with ``multiprocessors`` fewer than the whole GPU's (a MIG slice) gets that share of it; a MIG slice whose count
    is not given gets None (its MFU is left out: against the whole GPU it would read several times too low)."""
    entry = datasheet_entry(device_name)
    if entry is None or precision not in entry[1] or (multiprocessors is None and is_mig(device_name)):
        return None
    name, rates = entry
    full = FULL_MULTIPROCESSORS[name]
    if multiprocessors is None or multiprocessors >= full:
        return Peak(precision, rates[precision], f"{name} datasheet, dense")
    return Peak(precision, rates[precision] * multiprocessors / full,
                f"{name} datasheet, dense, x {multiprocessors}/{full} multiprocessors (this "
                f"{'MIG slice' if is_mig(device_name) else 'device'}'s share)")


def datasheet_entry(device_name: str) -> tuple[str, dict[str, float]] | None:
    """The table's name and TFLOP/s by precision of the GPU ``device_name`` is (or is a slice of), if listed."""
    upper = device_name.upper()
    for fragments, name, rates in DATASHEET_TFLOPS:
        if all(f.upper() in upper for f in fragments):
            return name, rates
    return None


def measured_peak(info: DeviceInfo, precision: str) -> Peak:
    """The measured MAMF of ``precision`` on this device (:func:`.ceilings.mamf`: the best over the ceilings sweep's
    shapes, kept with the machine's ceilings): a ceiling, not a datasheet peak, and the same one the summary reads."""
    tflops, source = ceilings.mamf(info, precision)
    return Peak(precision, tflops, f"{source} (no datasheet peak in optlab's table)")


def peak_for(config: RunConfig, info: DeviceInfo) -> Peak:
    """The peak that MFU is measured against for ``config`` on this device: the datasheet's, else a measured one."""
    precision = precision_of(config, has_tf32(info))
    if not info.is_cuda:
        return measured_peak(info, precision)
    multiprocessors = torch.cuda.get_device_properties(info.device).multi_processor_count
    return datasheet_peak(info.name, precision, multiprocessors) or measured_peak(info, precision)


def mfu_table(summary: pd.DataFrame, configs: dict[str, dict[str, dict]], info: DeviceInfo,
              phase: str = "train") -> pd.DataFrame:
    """Achieved TFLOP/s of every model and variant in ``phase`` against the peak of its precision (MFU in %).

    ``configs`` maps model -> variant -> effective config as a record stores it (``record["effective_configs"]``);
    peaks are looked up once per precision.
    """
    peaks: dict[str, Peak] = {}
    rows = []
    for row in summary[summary["phase"] == phase].itertuples():
        config = RunConfig(**configs[row.model][row.variant])
        precision = precision_of(config, has_tf32(info))
        if precision not in peaks:
            peaks[precision] = peak_for(config, info)
        peak = peaks[precision]
        rows.append({"model": row.model, "variant": row.variant, "precision": precision,
                     "achieved TFLOP/s": row.tflops, "peak TFLOP/s": peak.tflops,
                     "MFU %": 100 * row.tflops / peak.tflops, "peak source": peak.source})
    return pd.DataFrame(rows)


def reference_mfu(technique: str = "all_together", phase: str = "train") -> pd.DataFrame | None:
    """MFU of the stored GPU reference runs of ``technique``, against the datasheet peak of the GPU each ran on
    (NaN where optlab's table has no peak for that GPU) and against the MAMF measured on it in the same precision,
    where the run kept its ceilings (``MFU % of MAMF``: what the GPU reached, not what its datasheet promises); None
    when no reference is stored."""
    rows = []
    for machine in store.reference_machines():
        path = store.REFERENCE_DIR / machine / f"{technique}.json"
        if not path.exists():
            continue
        measured = ceilings.load(store.REFERENCE_DIR / machine)
        mamf = ceilings.Roofs.from_table(measured).flops_per_s if measured is not None else {}
        record = store.load_record(path)
        name = record["environment"].get("gpu_name") or ""
        tf32 = "tf32" in (datasheet_entry(name) or ("", {}))[1]
        missing = (f"{name!r} is a MIG slice: its share of the GPU's multiprocessors is not recorded, so no MFU"
                   if is_mig(name) else f"no datasheet peak for {name!r} in optlab's table")
        summary = pd.DataFrame(record["summary"])
        for row in summary[summary["phase"] == phase].itertuples():
            precision = precision_of(RunConfig(**record["effective_configs"][row.model][row.variant]), tf32)
            peak = datasheet_peak(name, precision)
            rows.append({"machine": machine, "model": row.model, "variant": row.variant, "precision": precision,
                         "achieved TFLOP/s": row.tflops, "peak TFLOP/s": peak.tflops if peak else float("nan"),
                         "MFU %": 100 * row.tflops / peak.tflops if peak else float("nan"),
                         "MFU % of MAMF": 100 * row.tflops * 1e12 / mamf[precision] if precision in mamf
                         else float("nan"), "peak source": peak.source if peak else missing})
    return pd.DataFrame(rows) if rows else None
