"""The environment every record is stamped with."""
from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

import torch

from .device import DeviceInfo, cpu_name
from .gpu_state import read_state


def _run(command: list[str]) -> str | None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def git_commit() -> str:
    """The checkout's commit (``OPTLAB_GIT_COMMIT`` wins, for copies without .git); "unknown" if none."""
    here = Path(__file__).resolve().parent
    return os.environ.get("OPTLAB_GIT_COMMIT") or _run(["git", "-C", str(here), "rev-parse", "HEAD"]) or "unknown"


def capture(info: DeviceInfo, data_source: str, profile: str) -> dict[str, object]:
    """Python, torch, CUDA, cuDNN, GPU, CPU, threads, data source, profile, commit and date, then the GPU's state
    (``gpu_state.read_state``: driver, clocks, power, temperature, throttling, persistence and MIG mode; on the
    CPU one line saying there is none)."""
    cuda = info.is_cuda
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(info.device),
        "device_name": info.name,
        "gpu_name": info.name if cuda else None,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "data_source": data_source,
        "profile": profile,
        "git_commit": git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        **read_state(info.device),
    }


def report(environment: dict[str, object]) -> str:
    """The environment as aligned ``key: value`` lines, for the end of a chapter."""
    width = max(map(len, environment))
    return "\n".join(f"{key:<{width}}  {value}" for key, value in environment.items())
