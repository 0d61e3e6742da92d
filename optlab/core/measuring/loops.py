"""The measured training and evaluation loops. Each knob of :class:`RunConfig` switches lines here."""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Iterator, TypeVar, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ..machine import compiler
from . import memory
from ..knobs.config import RunConfig
from ..machine.device import TORCH_DTYPES
from ..gpt.fp8 import swap_linears_to_fp8
from .timing import StepTimer
from ..workload import LossFn, correct_predictions


@dataclass
class PhaseResult:
    """Raw samples of one pass: loader start-up, warm-up and timed step times, wall time, peak memory, losses."""

    startup_s: float
    step_times_s: list[float]
    wall_s: float  # the whole pass after start-up, warm-up included
    peak_mem_mb: float  # see memory.memory_kind: on CUDA the variant's resident tensors + this phase's increase
    warmup_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    correct: int = 0  # evaluation: predictions that equal their targets
    predictions: int = 0  # evaluation: predictions made (one per sample, or one per token)
    samples: int = 0  # samples in the timed steps
    warmup_losses: list[float] = field(default_factory=list)  # the first is every variant's loss on the same weights
    graphs_compiled: int = 0  # graphs torch.compile built during this pass (warm-up included)
    inductor_cache: str | None = None  # when it compiled: "cold", "warm" or "mixed" (compiler.cache_state)
    resident_mem_mb: float = 0.0  # the variant's own tensors on the device when the pass began
    cudagraph_skips: int = 0  # graphs Inductor compiled for CUDA-graph replay but ran without (compiler.cache_counts)
    graph_pool_mb: float = 0.0  # captured graphs' private pool, counted in peak_mem_mb (count_graph_pool)
    step_increase_mb: float = math.nan  # CPU: one profiled step's own peak (memory.cpu_step_increase_mb)
    pid: int = field(default_factory=os.getpid)  # the process that ran the pass


_IMPLEMENTATIONS = {"default": {}, "for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's AdamW parameter groups: the 2-D and larger tensors (the matmuls' weights and the embeddings) decay by
    ``weight_decay``; the biases and LayerNorm weights (1-D) do not."""
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    groups = [{"params": [p for p in parameters if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def make_optimizer(model: nn.Module, config: RunConfig | None = None) -> torch.optim.Optimizer:
    """The seed's SGD (lr 0.1, momentum 0.9, weight decay 5e-4), Adam (lr 1e-3), or nanoGPT's AdamW (lr 6e-4,
    betas 0.9/0.95, weight decay 0.1 on 2-D weights only: :func:`decay_groups`), in the config's implementation."""
    config = config or RunConfig()
    implementation = _IMPLEMENTATIONS[config.optimizer_impl]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(decay_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), **implementation)
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4, **implementation)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, **implementation)


def make_scaler(config: RunConfig, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=config.amp_dtype == "fp16")


def prepare_model(model: nn.Module, config: RunConfig, device: torch.device) -> nn.Module:
    model = model.to(device)
    if config.fp8:
        swap_linears_to_fp8(model)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if config.compile_mode != "none":
        model = torch.compile(model, mode=None if config.compile_mode == "default" else config.compile_mode)
    return model


Inputs = Union[torch.Tensor, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]  # one, positional or keyword


def input_tensors(inputs: Inputs) -> list[torch.Tensor]:
    """The tensors of a model's inputs, in order."""
    if isinstance(inputs, dict):
        return list(inputs.values())
    return list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]


def map_inputs(function: Callable[[torch.Tensor], torch.Tensor], inputs: Inputs) -> Inputs:
    """The same inputs with ``function`` applied to each tensor."""
    if isinstance(inputs, dict):
        return {key: function(tensor) for key, tensor in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return tuple(function(tensor) for tensor in inputs)
    return function(inputs)


def call_model(model: Callable, inputs: Inputs):
    """``model(x)``, ``model(*inputs)`` for a tuple, ``model(**inputs)`` for a dict of keyword tensors."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


def inputs_to(inputs: Inputs, device: torch.device, channels_last: bool = False, non_blocking: bool = False) -> Inputs:
    """Inputs on ``device``; with ``channels_last``, 4-D floating-point ones (images) in that layout, every other
    tensor contiguous."""
    def move(tensor: torch.Tensor) -> torch.Tensor:
        image = channels_last and tensor.dim() == 4 and tensor.is_floating_point()
        layout = torch.channels_last if image else torch.contiguous_format
        return tensor.to(device, non_blocking=non_blocking).contiguous(memory_format=layout)
    return map_inputs(move, inputs)


def to_device(batch: tuple[Inputs, torch.Tensor], config: RunConfig, device: torch.device):
    """The batch on ``device`` in the config's memory format, whatever layout it came in (a device-resident batch
    can arrive channels-last strided from its augmentation)."""
    inputs, targets = batch
    return (inputs_to(inputs, device, config.channels_last, config.non_blocking),
            targets.to(device, non_blocking=config.non_blocking))


def prefetch_to_device(batches: Iterable, config: RunConfig, device: torch.device) -> Iterator:
    """Each batch copied to ``device`` on a side CUDA stream one step ahead: batch i+1's copy is queued before step
    i's kernels, so the copy engine moves it while step i computes. A copy on the compute stream, non_blocking or
    not, runs between two steps' kernels; only the host's wait is saved there."""
    side, compute = torch.cuda.Stream(device), torch.cuda.current_stream(device)

    def start_copy(batch):
        with torch.cuda.stream(side):
            tensors = to_device(batch, config, device)
            landed = torch.cuda.Event()
            landed.record(side)
        return tensors, landed

    def hand_over(copied):
        tensors, landed = copied
        compute.wait_event(landed)  # this batch only: the next batch's copy keeps running
        for tensor in [*input_tensors(tensors[0]), tensors[1]]:
            tensor.record_stream(compute)  # the allocator must not reuse its memory while the step reads it
        return tensors

    pending = None
    for batch in batches:
        started = start_copy(batch)
        if pending is not None:
            yield hand_over(pending)
        pending = started
    if pending is not None:
        yield hand_over(pending)


def train_step(model, batch, optimizer, scaler, config: RunConfig, device: torch.device, micro_step: int,
               loss_fn: LossFn = F.cross_entropy) -> torch.Tensor:
    """One micro-step; the optimizer steps every ``accumulation_steps`` micro-steps. Returns the detached loss."""
    inputs, targets = to_device(batch, config, device)
    amp_dtype = TORCH_DTYPES[config.amp_dtype]
    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        loss = loss_fn(call_model(model, inputs), targets)
    scaler.scale(loss / config.accumulation_steps).backward()
    if (micro_step + 1) % config.accumulation_steps == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=config.set_to_none)
    return loss.detach()


def grad_mode(mode: str) -> contextlib.AbstractContextManager:
    """``grad``: autograd records the graph; ``no_grad``: it does not; ``inference_mode``: no graph, no version counters."""
    return {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]()


def eval_step(model, batch, config: RunConfig, device: torch.device,
              losses: list[torch.Tensor] | None = None, loss_fn: LossFn = F.cross_entropy) -> torch.Tensor:
    """One evaluation step; returns the number of correct predictions (argmax over the outputs' last dimension, so
    ``[N, C]`` logits or ``[N, T, V]`` per token) as a device tensor. With ``losses``, the batch's ``loss_fn`` is
    appended to it (the warm-up steps': every variant's loss on the same weights and batch)."""
    inputs, targets = to_device(batch, config, device)
    amp_dtype = TORCH_DTYPES[config.amp_dtype]
    with grad_mode(config.eval_grad_mode), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        outputs = call_model(model, inputs)
        if losses is not None:
            losses.append(loss_fn(outputs, targets).detach())
    return correct_predictions(outputs, targets)


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
    """Start the loader (its workers' start-up is timed) and return the batches of one repeat. The start-up holds
    the first batch, which waits for the workers; without workers and without a warm-up step the first batch is
    loaded in the first timed step instead, as every later batch is in its step."""
    start = time.perf_counter()
    batches = iter(loader)
    first = [] if warmup == 0 and getattr(loader, "num_workers", 0) == 0 else [next(batches)]
    startup = time.perf_counter() - start
    stream = itertools.chain(first, batches)
    if steps is not None:
        stream = itertools.islice(stream, warmup + steps)
    return startup, stream


T = TypeVar("T")
Pass = Generator[None, None, T]  # a pass that yields after each step, so that a lockstep round can run others between


def drive(steps: Pass[T]) -> T:
    """Run a pass to its end, no other work between its steps; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def run_timed(step, loader, device, steps, warmup, resident: Iterable[object] = (),
              prefetch: RunConfig | None = None,
              step_increase_mb: float | None = None) -> tuple[PhaseResult, list[torch.Tensor]]:
    """:func:`timed_pass` run to its end."""
    return drive(timed_pass(step, loader, device, steps, warmup, resident, prefetch, step_increase_mb))


def timed_pass(step, loader, device, steps, warmup, resident: Iterable[object] = (),
               prefetch: RunConfig | None = None,
               step_increase_mb: float | None = None) -> Pass[tuple[PhaseResult, list[torch.Tensor]]]:
    """Every step is timed; the first ``warmup`` (compilation, autotuning, cold caches) are kept apart. The pass
    yields after each step; on a CPU the time until it is resumed is not counted (:meth:`StepTimer.pause`).

    On the CPU the last batch then runs once more, untimed, under the profiler's memory records
    (:func:`memory.cpu_step_increase_mb`): the phase's peak memory without the profiler's cost on a timed step.
    ``step_increase_mb``: that figure from an earlier pass of the same variant and phase (the same shapes), which
    spares the extra step.
    ``resident``: what the variant holds (model, optimizer, loader), counted for the phase's memory. ``prefetch``:
    the config to copy batches with, one step ahead on a side stream (:func:`prefetch_to_device`).
    """
    resident_mb = memory.resident_mb(resident, device)
    start_bytes = memory.phase_start(device)
    graphs_before, cache_before = compiler.compiled_graphs(), compiler.cache_counts()
    startup, batches = _timed_batches(loader, steps, warmup)
    if prefetch is not None:
        batches = prefetch_to_device(batches, prefetch, device)
    timer = StepTimer(device)
    outputs = []
    timer.start()
    index, batch = -1, None
    for index, batch in enumerate(batches):
        out = step(batch, index)
        timer.mark()
        if index >= warmup:
            outputs.append(out)
        timer.pause()
        yield
        timer.resume()
    intervals, wall = timer.finish()
    if len(intervals) <= warmup:
        raise RuntimeError(f"the loader ran out before {warmup} warm-up steps and one timed step")
    increase_mb = math.nan
    if device.type == "cpu":
        increase_mb = (step_increase_mb if step_increase_mb is not None
                       else memory.cpu_step_increase_mb(lambda: step(batch, index + 1)))
    graphs = compiler.compiled_graphs() - graphs_before
    cache = {key: count - cache_before[key] for key, count in compiler.cache_counts().items()}
    result = PhaseResult(startup, intervals[warmup:], wall, memory.phase_peak_mb(device, start_bytes, resident_mb, increase_mb),
                         warmup_times_s=intervals[:warmup], graphs_compiled=graphs, resident_mem_mb=resident_mb,
                         step_increase_mb=increase_mb)
    if graphs:
        result.inductor_cache = compiler.cache_state(cache["cache hits"], cache["cache misses"])
    result.cudagraph_skips = cache["cudagraph skips"]
    return result, outputs


_GRAPH_POOLS: "weakref.WeakKeyDictionary[nn.Module, memory.GraphPoolTally]" = weakref.WeakKeyDictionary()


def graph_pool_tally(model: nn.Module, config: RunConfig, device: torch.device) -> memory.GraphPoolTally:
    """The tally of ``model``'s own CUDA graphs (:class:`memory.GraphPoolTally`), kept across all its passes: a
    variant's graphs are recorded in its first pass and replayed in the later ones. Counted only for a config that
    replays CUDA graphs on CUDA."""
    counted = device.type == "cuda" and compiler.uses_cuda_graphs(config)
    return _GRAPH_POOLS.setdefault(model, memory.GraphPoolTally(device, counted))


def count_graph_pool(result: PhaseResult, tally: memory.GraphPoolTally) -> PhaseResult:
    """The variant's graphs' private pool (``tally``), which a replay uses without allocating, added to the phase's
    peak and kept apart in ``graph_pool_mb``."""
    result.graph_pool_mb = tally.mb
    result.peak_mem_mb += tally.mb
    return result


StepContext = Callable[[int], contextlib.AbstractContextManager]


def train_phase(model, loader, optimizer, scaler, config: RunConfig, device: torch.device,
                steps: int | None, warmup: int, step_context: StepContext | None = None,
                loss_fn: LossFn = F.cross_entropy, step_increase_mb: float | None = None) -> PhaseResult:
    """:func:`train_pass` run to its end."""
    return drive(train_pass(model, loader, optimizer, scaler, config, device, steps, warmup, step_context, loss_fn,
                            step_increase_mb))


def train_pass(model, loader, optimizer, scaler, config: RunConfig, device: torch.device,
               steps: int | None, warmup: int, step_context: StepContext | None = None,
               loss_fn: LossFn = F.cross_entropy, step_increase_mb: float | None = None) -> Pass[PhaseResult]:
    """Time ``steps`` training micro-steps after ``warmup`` untimed ones (``steps=None``: the whole epoch).

    With gradient accumulation both counts are rounded up to whole optimizer steps (:meth:`RunConfig.train_window`).
    ``step_context(micro_step)``, if given, wraps each micro-step (DDP's ``no_sync`` between optimizer steps);
    ``loss_fn(outputs, targets)`` is the loss (cross-entropy unless a reader's own model needs another);
    ``step_increase_mb`` as for :func:`run_timed`.
    """
    warmup, steps = config.train_window(warmup, steps)
    model.train()
    optimizer.zero_grad(set_to_none=config.set_to_none)
    warmup_losses: list[torch.Tensor] = []

    def step(batch, index: int) -> torch.Tensor:
        with step_context(index) if step_context else contextlib.nullcontext():
            loss = train_step(model, batch, optimizer, scaler, config, device, index, loss_fn)
        if index < warmup:
            warmup_losses.append(loss)
        return loss

    prefetch = config if config.prefetch_to_device else None
    pool = graph_pool_tally(model, config, device)
    with backend_flags(config), pool.run():
        result, losses = yield from timed_pass(step, loader, device, steps, warmup, (model, optimizer, loader),
                                               prefetch, step_increase_mb)
    count_graph_pool(result, pool)
    result.losses = torch.stack(losses).float().cpu().tolist()
    result.warmup_losses = torch.stack(warmup_losses).float().cpu().tolist() if warmup_losses else []
    result.samples = len(losses) * config.samples_per_step
    return result


def eval_phase(model, loader, config: RunConfig, device: torch.device, steps: int | None, warmup: int,
               step_increase_mb: float | None = None, loss_fn: LossFn = F.cross_entropy) -> PhaseResult:
    """:func:`eval_pass` run to its end."""
    return drive(eval_pass(model, loader, config, device, steps, warmup, step_increase_mb, loss_fn))


def eval_pass(model, loader, config: RunConfig, device: torch.device, steps: int | None, warmup: int,
              step_increase_mb: float | None = None, loss_fn: LossFn = F.cross_entropy) -> Pass[PhaseResult]:
    """Time ``steps`` evaluation steps after ``warmup`` untimed ones (the memory counts the model and its data, not
    the optimizer that inference does not use); the warm-up steps' ``loss_fn`` is kept, as in training."""
    model.eval()
    prefetch = config if config.prefetch_to_device else None
    predictions: dict[int, int] = {}
    warmup_losses: list[torch.Tensor] = []

    def step(batch, index: int) -> torch.Tensor:
        predictions[index] = batch[1].numel()  # one per sample, or one per token
        return eval_step(model, batch, config, device, warmup_losses if index < warmup else None, loss_fn)

    pool = graph_pool_tally(model, config, device)
    with backend_flags(config), pool.run():
        result, correct = yield from timed_pass(step, loader, device, steps, warmup, (model, loader), prefetch,
                                                step_increase_mb)
    count_graph_pool(result, pool)
    result.correct = int(torch.stack(correct).sum())
    result.warmup_losses = torch.stack(warmup_losses).float().cpu().tolist() if warmup_losses else []
    result.predictions = sum(predictions[i] for i in range(warmup, warmup + len(correct)))
    result.samples = len(correct) * config.samples_per_step
    return result
