"""TF32's two switches timed apart: an fp32 matmul (``matmul_tf32``) and an fp32 convolution (``cudnn_tf32``).

TF32 is a math mode of NVIDIA tensor cores (Ampere and newer): fp32 inputs are rounded to a 10-bit mantissa, products
are accumulated in fp32. Each operation is timed with its own switch off and on (the other switch off), set through
:func:`optlab.loops.backend_flags` as the timed loops set it, and its result is compared with the same operation in
fp64. On a CPU the switches do nothing, so the benchmark refuses to run there.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch.utils import benchmark

from ...core.results import store
from ...core.knobs.config import RunConfig
from ...core.machine.device import DeviceInfo, resolve_device
from ...core.errors import OptlabError
from ...core.measuring.loops import backend_flags

MATMUL_SIZE = 4096
CONV_SHAPE = (128, 128, 16, 16)  # batch, channels, height, width: a 3x3 conv of ResNet18's stage 2 at CIFAR size
MIN_RUN_TIME_S = 0.2  # per measurement before its spread is checked
MAX_RUN_TIME_FACTOR = 10  # at most this many times min_run_time per measurement, whatever the spread


def _conv3x3(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1)


def _operations(info: DeviceInfo, matmul_size: int, conv_shape: tuple[int, int, int, int]) -> dict:
    """Per operation: function, inputs, FLOPs and the switch that governs it."""
    n = matmul_size
    batch, channels, height, width = conv_shape
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=generator).to(info.device) for _ in range(2))
    x = torch.randn(conv_shape, generator=generator).to(info.device)
    w = torch.randn(channels, channels, 3, 3, generator=generator).to(info.device) / (9 * channels) ** 0.5
    return {
        f"matmul {n}x{n}": (torch.matmul, (a, b), 2 * n**3, "matmul_tf32"),
        f"conv3x3 {batch}x{channels}x{height}x{width}": (
            _conv3x3, (x, w), 2 * batch * channels * channels * 9 * height * width, "cudnn_tf32"),
    }


def _measure_ops(info: DeviceInfo, matmul_size: int, conv_shape: tuple[int, int, int, int],
                 min_run_time: float) -> pd.DataFrame:
    """Time every operation with its switch off and on; relative error against fp64; speed-up against off."""
    rows = []
    for op, (fn, args, flops, knob) in _operations(info, matmul_size, conv_shape).items():
        exact = fn(*(t.double() for t in args))
        for on in (False, True):
            with backend_flags(RunConfig(**{"matmul_tf32": False, "cudnn_tf32": False, knob: on})):
                error = (fn(*args).double() - exact).norm() / exact.norm()
                timer = benchmark.Timer("fn(*args)", globals={"fn": fn, "args": args}, label="TF32", sub_label=op,
                                        description=f"{knob}={on}")
                measurement = timer.adaptive_autorange(threshold=0.1, min_run_time=min_run_time,
                                                       max_run_time=MAX_RUN_TIME_FACTOR * min_run_time)
            rows.append({"device": info.name, "op": op, "switch": knob, "tf32": on, "median_s": measurement.median,
                         "iqr_s": measurement.iqr, "runs": len(measurement.times),
                         "tflops": flops / measurement.median / 1e12, "rel_err_vs_fp64": float(error)})
    frame = pd.DataFrame(rows)
    off = frame[~frame["tf32"]].set_index("op")["median_s"]
    frame["speedup"] = frame["op"].map(off) / frame["median_s"]
    return frame


def tf32_benchmark(device: str = "cuda", matmul_size: int = MATMUL_SIZE,
                   conv_shape: tuple[int, int, int, int] = CONV_SHAPE,
                   min_run_time: float = MIN_RUN_TIME_S) -> pd.DataFrame:
    """On a CUDA device: one row per operation and switch setting, with median, IQR, TFLOP/s, fp64 error, speed-up."""
    if isinstance(matmul_size, bool) or not isinstance(matmul_size, int) or matmul_size < 1:
        raise OptlabError(f"matmul_size must be a positive integer, got {matmul_size!r}")
    if len(conv_shape) != 4 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in conv_shape):
        raise OptlabError("conv_shape must be four positive integers (batch, channels, height, width), "
                          f"got {conv_shape!r}")
    info = resolve_device(device)
    if not info.is_cuda:
        raise OptlabError(f"the TF32 benchmark needs a CUDA device and got {info.name} ({info.device.type}): TF32 is "
                          "a tensor-core math mode of NVIDIA GPUs (Ampere and newer) and its switches do nothing on a "
                          "CPU; read the stored GPU table with store.reference_tables('precision_tf32')")
    return _measure_ops(info, matmul_size, tuple(conv_shape), min_run_time)


def run_reference(out: "str | Path", device: str = "cuda") -> list[Path]:
    """The GPU reference: both switches timed on the default sizes, saved as precision_tf32.csv."""
    return [store.save_table(tf32_benchmark(device), out, "precision_tf32")]
