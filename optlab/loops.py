"""The measured training and evaluation loops. Each knob of :class:`RunConfig` switches lines here."""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from .config import RunConfig
from .device import TORCH_DTYPES
from .memory import peak_mb, reset_peak
from .timing import StepTimer


@dataclass
class PhaseResult:
    """Raw samples of one timed pass: loader start-up, per-step times, wall time, peak memory, losses."""

    startup_s: float
    step_times_s: list[float]
    wall_s: float
    peak_mem_mb: float
    losses: list[float] = field(default_factory=list)
    correct: int = 0
    images: int = 0


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The seed's optimizer: SGD, lr 0.1, momentum 0.9, weight decay 5e-4."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)


def make_scaler(config: RunConfig, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=config.amp_dtype == "fp16")


def prepare_model(model: nn.Module, config: RunConfig, device: torch.device) -> nn.Module:
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def to_device(batch: tuple[torch.Tensor, torch.Tensor], config: RunConfig, device: torch.device):
    inputs, targets = batch
    inputs = inputs.to(device, non_blocking=config.non_blocking)
    targets = targets.to(device, non_blocking=config.non_blocking)
    if config.channels_last:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets


def train_step(model, batch, optimizer, scaler, config: RunConfig, device: torch.device, micro_step: int) -> torch.Tensor:
    """One micro-step; the optimizer steps every ``accumulation_steps`` micro-steps. Returns the detached loss."""
    inputs, targets = to_device(batch, config, device)
    amp_dtype = TORCH_DTYPES[config.amp_dtype]
    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss / config.accumulation_steps).backward()
    if (micro_step + 1) % config.accumulation_steps == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=config.set_to_none)
    return loss.detach()


def grad_mode(mode: str) -> contextlib.AbstractContextManager:
    """``grad``: autograd records the graph; ``no_grad``: it does not; ``inference_mode``: no graph, no version counters."""
    return {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]()


def eval_step(model, batch, config: RunConfig, device: torch.device) -> torch.Tensor:
    """One evaluation step; returns the number of correct predictions as a device tensor."""
    inputs, targets = to_device(batch, config, device)
    amp_dtype = TORCH_DTYPES[config.amp_dtype]
    with grad_mode(config.eval_grad_mode), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        outputs = model(inputs)
    return (outputs.argmax(dim=1) == targets).sum()


@contextlib.contextmanager
def cudnn_benchmark(enabled: bool) -> Iterator[None]:
    """Set ``torch.backends.cudnn.benchmark`` for one phase and restore it after."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


def _timed_batches(loader: DataLoader, steps: int | None, warmup: int) -> tuple[float, Iterator]:
    """Start the loader (its workers' start-up is timed) and return the batches of one repeat."""
    start = time.perf_counter()
    batches = iter(loader)
    first = next(batches)
    startup = time.perf_counter() - start
    stream = itertools.chain([first], batches)
    if steps is not None:
        stream = itertools.islice(stream, warmup + steps)
    return startup, stream


def _run_timed(step, loader, device, steps, warmup) -> tuple[PhaseResult, list[torch.Tensor]]:
    reset_peak(device)
    startup, batches = _timed_batches(loader, steps, warmup)
    timer = StepTimer(device)
    outputs = []
    if warmup == 0:
        timer.start()
    for index, batch in enumerate(batches):
        out = step(batch, index)
        if index + 1 == warmup:
            timer.start()
        elif index >= warmup:
            timer.mark()
            outputs.append(out)
    step_times, wall = timer.finish()
    if not step_times:
        raise RuntimeError(f"the loader ran out before {warmup} warm-up steps and one timed step")
    return PhaseResult(startup, step_times, wall, peak_mb(device)), outputs


def train_phase(model, loader, optimizer, scaler, config: RunConfig, device: torch.device,
                steps: int | None, warmup: int) -> PhaseResult:
    """Time ``steps`` training micro-steps after ``warmup`` untimed ones (``steps=None``: the whole epoch)."""
    model.train()
    optimizer.zero_grad(set_to_none=config.set_to_none)
    with cudnn_benchmark(config.cudnn_benchmark):
        result, losses = _run_timed(
            lambda batch, i: train_step(model, batch, optimizer, scaler, config, device, i), loader, device, steps, warmup
        )
    result.losses = torch.stack(losses).float().cpu().tolist()
    result.images = len(losses) * config.images_per_step
    return result


def eval_phase(model, loader, config: RunConfig, device: torch.device, steps: int | None, warmup: int) -> PhaseResult:
    """Time ``steps`` evaluation steps after ``warmup`` untimed ones."""
    model.eval()
    with cudnn_benchmark(config.cudnn_benchmark):
        result, correct = _run_timed(lambda batch, i: eval_step(model, batch, config, device), loader, device, steps, warmup)
    result.correct = int(torch.stack(correct).sum())
    result.images = len(correct) * config.images_per_step
    return result
