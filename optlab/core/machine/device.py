"""Resolve the device once: CPU or CUDA, the AMP dtypes it can run, and what each knob means there."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..knobs.config import RunConfig
from ..errors import OptlabError, choice_error
from ..gpt.fp8 import backend_note, fp8_support

DEVICE_CHOICES = ("auto", "cpu", "cuda")
TORCH_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DeviceInfo:
    """The device a run uses, decided in one place."""

    device: torch.device
    name: str
    amp_dtypes: tuple[str, ...]

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        return f"{self.device.type} ({self.name}); AMP dtypes: {', '.join(self.amp_dtypes)}"


def resolve_device(requested: str = "auto") -> DeviceInfo:
    """Turn ``auto``/``cpu``/``cuda``/``cuda:N`` into a DeviceInfo, with an error if it is not here."""
    base = requested.split(":")[0]
    if base not in DEVICE_CHOICES or (requested.count(":") and base != "cuda"):
        raise choice_error("device", requested, DEVICE_CHOICES + ("cuda:N",))
    if base == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise OptlabError(
                f"device {requested!r} was asked for, but CUDA is not available on this machine "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use --device cpu or auto"
            )
        device = torch.device(requested)
        index = device.index if device.index is not None else default_cuda_index()
        if index >= torch.cuda.device_count():
            raise OptlabError(f"device {requested!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(index)  # streams, events, synchronize and the memory counters follow the current device
        device = torch.device("cuda", index)
        dtypes = ("none", "fp16") + (("bf16",) if torch.cuda.is_bf16_supported() else ())
        return DeviceInfo(device, torch.cuda.get_device_name(index), dtypes)
    return DeviceInfo(torch.device("cpu"), cpu_name(), ("none", "fp16", "bf16"))


def default_cuda_index() -> int:
    """The GPU a plain ``cuda`` means: ``LOCAL_RANK``'s under torchrun (read before any CUDA call, so that no rank
    creates a context on GPU 0 first), else the current device."""
    local_rank = os.environ.get("LOCAL_RANK")
    return int(local_rank) if local_rank is not None and local_rank.isdigit() else torch.cuda.current_device()


def native_bf16(info: DeviceInfo) -> bool:
    """Whether the device does bf16 arithmetic natively: a CUDA GPU that supports it, or a CPU with AVX-512 BF16 or
    AMX (elsewhere CPU autocast converts around every kernel, and bf16 convolutions fall back to a slow kernel)."""
    if info.is_cuda:
        return torch.cuda.is_bf16_supported()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def native_fp16(info: DeviceInfo) -> bool:
    """Whether the device does fp16 arithmetic natively: any CUDA GPU, or a CPU with AVX-512 FP16 or AMX-FP16."""
    return info.is_cuda or bool({"avx512_fp16", "amx_fp16"} & cpu_flags())


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


# switches that only mean something with a CUDA device: on the CPU they are turned off, with the reason
CUDA_ONLY_KNOBS = {
    "pin_memory": "pinned pages only speed up copies to an accelerator",
    "non_blocking": "a copy from cpu to cpu is a no-op",
    "prefetch_to_device": "no copy to overlap: the batches are already in host memory",
    "cudnn_benchmark": "cuDNN autotuning exists only on CUDA",
}


def effective_config(config: RunConfig, info: DeviceInfo) -> tuple[RunConfig, list[str]]:
    """The config as it will run on this device, and one note per knob that is skipped or changes meaning.

    Raises OptlabError for an AMP dtype the device cannot run.
    """
    if config.amp_dtype not in info.amp_dtypes:
        raise OptlabError(
            f"AMP dtype {config.amp_dtype!r} is not supported on {info.name}; this device allows: "
            f"{', '.join(info.amp_dtypes)}"
        )
    notes: list[str] = []
    cpus = os.cpu_count() or 1
    if config.num_workers > cpus:
        notes.append(f"num_workers={config.num_workers}: more loader workers than this machine's {cpus} CPUs")
    changes: dict[str, bool] = {}
    if config.fp8 and (why := fp8_support(info.device)):
        changes["fp8"] = False
        notes.append(f"fp8: skipped on {info.device.type} ({why})")
    elif config.fp8:
        notes.append(backend_note())  # the record names the FP8 layers that ran
    if info.is_cuda:
        return replace(config, **changes), notes
    for knob, reason in CUDA_ONLY_KNOBS.items():
        if getattr(config, knob):
            changes[knob] = False
            notes.append(f"{knob}: skipped on cpu ({reason})")
    if config.matmul_tf32 or not config.cudnn_tf32:
        changes["matmul_tf32"], changes["cudnn_tf32"] = False, True
        notes.append("matmul_tf32/cudnn_tf32: skipped on cpu (TF32 is a tensor-core format of NVIDIA GPUs)")
    if config.channels_last:
        notes.append("channels_last: applied with its cpu meaning (NHWC tensors for oneDNN kernels)")
    if config.compile_mode != "none":
        notes.append(f"compile_mode={config.compile_mode}: applied with its cpu meaning (Inductor C++ kernels)")
    if config.data_on_device:
        notes.append("data_on_device: applied with its cpu meaning (data held as one tensor, augmented in batches)")
    if config.amp_dtype != "none":
        notes.append(f"amp_dtype={config.amp_dtype}: applied with its cpu meaning (CPU autocast)")
    return replace(config, **changes), notes
