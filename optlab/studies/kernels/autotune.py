"""The first call of a new input shape against later calls, with and without ``torch.backends.cudnn.benchmark``.

With ``benchmark=True`` cuDNN times its convolution algorithms on the first call of every new shape and keeps the
fastest. PyTorch keeps the chosen plans in a cache that lives as long as the process, and its key (shapes, dtype,
layout, alignment, ``deterministic``, ``allow_tf32``) has no benchmark flag: a shape first met with benchmark off
keeps its heuristic plan after the flag is switched on. :func:`compare_modes` therefore runs each setting in a fresh
process, and also re-runs ``benchmark=True`` in the process that ran ``False`` first, to show that trap.

On the CPU the flag does nothing. A new shape still costs more the first time: oneDNN creates its convolution
primitives per shape, and the allocator has to find memory for the new sizes.
"""
from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterable

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from ...core.results import store
from ...core.knobs.config import RunConfig
from ...core.machine.device import resolve_device
from ...core.errors import OptlabError, choice_error
from ...core.measuring.loops import backend_flags
from ...core.cifar.models import MODEL_NAMES, NUM_CLASSES, build_model

WARMUP_SHAPE = (2, 8)  # (batch, image size) run untimed first: start-up costs that do not belong to any one shape
MIN_IMAGE_SIZE = 16  # above the warm-up's size, so the warm-up never pre-pays a measured shape
FRESH = "benchmark={} (fresh process)"
AFTER_FALSE = "benchmark=True after False (same process)"
MODES = (FRESH.format(False), AFTER_FALSE, FRESH.format(True))
REFERENCE_TABLE = "cudnn_autotune"
REFERENCE_SHAPES = ((128, 32), (64, 32), (128, 40))  # the batch, a partial last batch, larger images


def validate_shapes(shapes: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``shapes`` as a tuple of distinct ``(batch, image size)`` pairs, or an OptlabError that says what is wrong."""
    shapes = tuple(tuple(shape) if isinstance(shape, (tuple, list)) else shape for shape in shapes)
    if not shapes:
        raise OptlabError("shapes is empty; give (batch, image size) pairs, e.g. [(128, 32), (64, 32)]")
    for shape in shapes:
        ok = (isinstance(shape, tuple) and len(shape) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in shape))
        if not ok or shape[0] < 1 or shape[1] < MIN_IMAGE_SIZE:
            raise OptlabError(f"bad shape {shape!r}: each shape is (batch >= 1, image size >= {MIN_IMAGE_SIZE}), "
                              "two integers")
    repeated = sorted({s for s in shapes if shapes.count(s) > 1})
    if repeated:
        raise OptlabError(f"shapes {repeated} appear more than once; a repeated shape has no first call to time")
    return shapes


def _check_request(model: str, calls: int) -> None:
    if model not in MODEL_NAMES:
        raise choice_error("model", model, MODEL_NAMES)
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 2:
        raise OptlabError(f"calls must be an integer >= 2 (the first call and at least one later call), got {calls!r}")


def _batch(shape: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    batch, size = shape
    return torch.randn(batch, 3, size, size, device=device), torch.randint(0, NUM_CLASSES, (batch,), device=device)


def _timed_pass(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Seconds for one forward and backward pass, with the device synchronized on both sides of the clock."""
    cuda = inputs.is_cuda
    if cuda:
        torch.cuda.synchronize(inputs.device)
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(inputs), targets).backward()
    if cuda:
        torch.cuda.synchronize(inputs.device)
    return time.perf_counter() - start


def shape_sweep(model: str, shapes: Iterable[tuple[int, int]], device: str = "auto", benchmark: bool = False,
                calls: int = 5, width: float = 1.0, seed: int = 0) -> pd.DataFrame:
    """Time ``calls`` training passes of every shape in this process; the first is that shape's first call.

    One row per shape, in order: ``first_call_s``, ``steady_s`` (median of the later calls), ``setup_s``
    (their difference) and the raw ``times_s``. A shape this process has already run is not new: use
    :func:`compare_modes` for a clean comparison.
    """
    shapes = validate_shapes(shapes)
    _check_request(model, calls)
    info = resolve_device(device)
    torch.manual_seed(seed)
    net = build_model(model, width=width).to(info.device).train()
    rows = []
    with backend_flags(RunConfig(cudnn_benchmark=benchmark)):  # the other flags as the training loops set them
        _timed_pass(net, *_batch(WARMUP_SHAPE, info.device))
        for shape in shapes:
            inputs, targets = _batch(shape, info.device)
            times = [_timed_pass(net, inputs, targets) for _ in range(calls)]
            steady = statistics.median(times[1:])
            rows.append({"model": model, "device": info.device.type, "pid": os.getpid(), "benchmark": benchmark,
                         "batch": shape[0], "image_size": shape[1], "first_call_s": times[0], "steady_s": steady,
                         "setup_s": times[0] - steady, "times_s": times})
    return pd.DataFrame(rows)


def _fresh_process_sweeps(model: str, shapes: tuple[tuple[int, int], ...], device: str, flags: tuple[bool, ...],
                          calls: int, width: float) -> list[pd.DataFrame]:
    """Run in a new process: one sweep per flag, in order, sharing that process's caches."""
    return [shape_sweep(model, shapes, device, flag, calls, width) for flag in flags]


def _in_fresh_process(*args) -> list[pd.DataFrame]:
    context = multiprocessing.get_context("spawn")  # a new interpreter: empty cuDNN and oneDNN caches
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_fresh_process_sweeps, *args).result()


def compare_modes(model: str, shapes: Iterable[tuple[int, int]], device: str = "auto", calls: int = 5,
                  width: float = 1.0) -> pd.DataFrame:
    """:func:`shape_sweep` in the three ``MODES``, one after the other; each row says its ``mode`` and ``pid``.

    Process 1 runs ``benchmark=False`` and then ``benchmark=True`` on the same shapes; process 2 runs
    ``benchmark=True`` alone. Both processes are new, so every shape is new to them.
    """
    shapes = validate_shapes(shapes)
    _check_request(model, calls)
    first = _in_fresh_process(model, shapes, device, (False, True), calls, width)
    second = _in_fresh_process(model, shapes, device, (True,), calls, width)
    frames = [frame.assign(mode=mode) for frame, mode in zip(first + second, MODES)]
    return pd.concat(frames, ignore_index=True)


def run_reference(out: str | Path, device: str = "cuda") -> list[Path]:
    """The GPU reference: :func:`compare_modes` of full-width ResNet18 on ``REFERENCE_SHAPES``, saved as
    ``out/cudnn_autotune.csv``."""
    sweep = compare_modes("resnet18", REFERENCE_SHAPES, device=device, calls=5)
    return [store.save_table(sweep, out, REFERENCE_TABLE)]
