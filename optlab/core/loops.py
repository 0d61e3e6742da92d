"""The measured training and evaluation loops. Each knob of :class:`RunConfig` switches lines here."""
from __future__ import annotations

import contextlib
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

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
    """Raw samples of one pass: loader start-up, warm-up and timed step times, wall time, peak memory, losses."""

    startup_s: float
    step_times_s: list[float]
    wall_s: float  # the whole pass after start-up, warm-up included
    peak_mem_mb: float
    warmup_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    correct: int = 0
    images: int = 0
    warmup_losses: list[float] = field(default_factory=list)  # the first is every variant's loss on the same weights
    graphs_compiled: int = 0  # graphs torch.compile built during this pass (warm-up included)


_IMPLEMENTATIONS = {"default": {}, "for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def make_optimizer(model: nn.Module, config: RunConfig | None = None) -> torch.optim.Optimizer:
    """The seed's SGD (lr 0.1, momentum 0.9, weight decay 5e-4) or Adam (lr 1e-3), in the config's implementation."""
    config = config or RunConfig()
    implementation = _IMPLEMENTATIONS[config.optimizer_impl]
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4, **implementation)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, **implementation)


def make_scaler(config: RunConfig, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=config.amp_dtype == "fp16")


def prepare_model(model: nn.Module, config: RunConfig, device: torch.device) -> nn.Module:
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if config.compile_mode != "none":
        model = torch.compile(model, mode=None if config.compile_mode == "default" else config.compile_mode)
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
def backend_flags(config: RunConfig) -> Iterator[None]:
    """Set cudnn.benchmark and the TF32 switches for one phase, and restore them after."""
    flags = [(torch.backends.cudnn, "benchmark", config.cudnn_benchmark),
             (torch.backends.cudnn, "allow_tf32", config.cudnn_tf32),
             (torch.backends.cuda.matmul, "allow_tf32", config.matmul_tf32)]
    previous = [getattr(owner, name) for owner, name, _ in flags]
    for owner, name, value in flags:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name, _), value in zip(flags, previous):
            setattr(owner, name, value)


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


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (Dynamo's counter; 0 if Dynamo was never used)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return int(dynamo_utils.counters["stats"]["unique_graphs"]) if dynamo_utils is not None else 0


def run_timed(step, loader, device, steps, warmup) -> tuple[PhaseResult, list[torch.Tensor]]:
    """Every step is timed; the first ``warmup`` (compilation, autotuning, cold caches) are kept apart."""
    reset_peak(device)
    graphs_before = compiled_graphs()
    startup, batches = _timed_batches(loader, steps, warmup)
    timer = StepTimer(device)
    outputs = []
    timer.start()
    for index, batch in enumerate(batches):
        out = step(batch, index)
        timer.mark()
        if index >= warmup:
            outputs.append(out)
    intervals, wall = timer.finish()
    if len(intervals) <= warmup:
        raise RuntimeError(f"the loader ran out before {warmup} warm-up steps and one timed step")
    result = PhaseResult(startup, intervals[warmup:], wall, peak_mb(device), warmup_times_s=intervals[:warmup],
                         graphs_compiled=compiled_graphs() - graphs_before)
    return result, outputs


StepContext = Callable[[int], contextlib.AbstractContextManager]


def train_phase(model, loader, optimizer, scaler, config: RunConfig, device: torch.device,
                steps: int | None, warmup: int, step_context: StepContext | None = None) -> PhaseResult:
    """Time ``steps`` training micro-steps after ``warmup`` untimed ones (``steps=None``: the whole epoch).

    ``step_context(micro_step)``, if given, wraps each micro-step (DDP's ``no_sync`` between optimizer steps).
    """
    model.train()
    optimizer.zero_grad(set_to_none=config.set_to_none)
    warmup_losses: list[torch.Tensor] = []

    def step(batch, index: int) -> torch.Tensor:
        with step_context(index) if step_context else contextlib.nullcontext():
            loss = train_step(model, batch, optimizer, scaler, config, device, index)
        if index < warmup:
            warmup_losses.append(loss)
        return loss

    with backend_flags(config):
        result, losses = run_timed(step, loader, device, steps, warmup)
    result.losses = torch.stack(losses).float().cpu().tolist()
    result.warmup_losses = torch.stack(warmup_losses).float().cpu().tolist() if warmup_losses else []
    result.images = len(losses) * config.images_per_step
    return result


def eval_phase(model, loader, config: RunConfig, device: torch.device, steps: int | None, warmup: int) -> PhaseResult:
    """Time ``steps`` evaluation steps after ``warmup`` untimed ones."""
    model.eval()
    with backend_flags(config):
        result, correct = run_timed(lambda batch, i: eval_step(model, batch, config, device), loader, device, steps, warmup)
    result.correct = int(torch.stack(correct).sum())
    result.images = len(correct) * config.images_per_step
    return result
