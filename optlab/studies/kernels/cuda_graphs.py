"""CUDA graphs by hand: capture a whole training step, or a model's forward, once; then replay it with one launch.

Eager PyTorch launches every kernel from Python: for a ResNet18 training step, hundreds of launches, each costing
microseconds of CPU time. When the kernels themselves are short (a small batch of 32x32 images), the GPU waits for
the CPU and the step time stays flat as the batch shrinks: the launch-bound regime. A captured graph replays all of
a step's kernels with one launch, from fixed memory addresses: each new batch is copied into the static input
tensors before the replay. Capture follows "Whole-network capture" in PyTorch's CUDA semantics notes.

:func:`sweep` times eager and graphed steps over batch sizes (``torch.utils.benchmark``: blocks of runs, the device
synchronized at each block's ends; median and IQR over the blocks, at least four unless a time limit ends it). On
the CPU there is nothing to capture: it times eager steps only, which still show the fixed per-step cost that graphs
remove on a GPU.
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from ...core.results import store
from ...core.machine.device import resolve_device
from ...core.errors import OptlabError, choice_error
from ...core.measuring.loops import make_optimizer
from ...core.cifar.models import MODEL_NAMES, NUM_CLASSES, build_model

if TYPE_CHECKING:
    from torch.utils import benchmark

MODES = ("inference", "training")
EXECUTIONS = ("eager", "CUDA graph")
BATCH_SIZES = {"cuda": (1, 2, 4, 8, 16, 32, 64, 128, 256), "cpu": (1, 4, 16, 64)}  # the CPU sweep: about 10 s
WARMUP_ITERS = 3  # eager iterations on a side stream before capture, as in PyTorch's CUDA semantics notes
BATCH_POOL = 4  # distinct batches cycled through while timing, so every step copies new data in
ATOL, RTOL = 1e-3, 1e-3  # eager against graphed: the same kernels on the same data, up to atomics' ordering
REFERENCE_TABLE = "cuda_graphs_sweep"

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _require_cuda(tensor: torch.Tensor, what: str) -> None:
    if tensor.device.type != "cuda":
        raise OptlabError(f"{what} captures CUDA work and needs tensors on a CUDA device, got {tensor.device}; "
                          "on a CPU use the eager sweep (sweep(device='cpu')) or the stored GPU reference")


def _side_stream_warmup(run: Callable[[], object]) -> None:
    """``WARMUP_ITERS`` calls on a side stream, so lazy initialisation (cuBLAS handles, cuDNN plans) is not captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_ITERS):
            run()
    torch.cuda.current_stream().wait_stream(stream)


def capture_inference(model: nn.Module, example: torch.Tensor) -> Step:
    """Capture ``model``'s forward (no autograd) on a batch shaped like ``example``; return ``step(inputs, _)``.

    Each call copies ``inputs`` into the static input, replays the graph and returns the static output, which the
    next call overwrites: clone it to keep it.
    """
    if model.training:
        raise OptlabError("capture_inference needs model.eval(): in training mode every replay would update the "
                          "BatchNorm statistics")
    _require_cuda(example, "capture_inference")
    static_input = example.clone()
    with torch.no_grad():
        _side_stream_warmup(lambda: model(static_input))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_output = model(static_input)

    def step(inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        static_input.copy_(inputs)
        graph.replay()
        return static_output

    return step


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]


def capture_training(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                     targets: torch.Tensor) -> Step:
    """Capture forward, loss, backward and ``optimizer.step()`` on a batch shaped like ``inputs``; return ``step``.

    ``step(inputs, targets)`` copies the batch into the static tensors, replays and returns the static loss. The
    warm-up steps before capture are undone (weights and BatchNorm statistics restored in place, the optimizer's
    new state zeroed, which is a fresh state for SGD with momentum and for capturable Adam), so the first replay is
    the model's first training step, as in eager mode. ``optimizer`` must be fresh: SGD, or one with
    ``capturable=True``.
    """
    if optimizer.state:
        raise OptlabError("capture_training needs a fresh optimizer (no state yet): its warm-up steps are undone by "
                          "zeroing the state they create")
    if not isinstance(optimizer, torch.optim.SGD) and not optimizer.defaults.get("capturable", False):
        raise OptlabError(f"{type(optimizer).__name__} must be built with capturable=True to be captured in a graph "
                          "(its step reads a step count on the host otherwise); SGD needs nothing")
    _require_cuda(inputs, "capture_training")
    model.train()
    static_inputs, static_targets = inputs.clone(), targets.clone()
    saved = {name: value.clone() for name, value in model.state_dict().items()}

    def train_step() -> torch.Tensor:
        loss = F.cross_entropy(model(static_inputs), static_targets)
        loss.backward()
        optimizer.step()
        return loss

    def eager_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        train_step()

    _side_stream_warmup(eager_step)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)  # backward allocates .grad from the graph's private memory pool
    with torch.cuda.graph(graph):
        static_loss = train_step()
    with torch.no_grad():  # capture ran nothing; undo the warm-up steps in place (the graph keeps these addresses)
        model.load_state_dict(saved)
        for value in _state_tensors(optimizer):
            value.zero_()

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        static_inputs.copy_(inputs)
        static_targets.copy_(targets)
        graph.replay()
        return static_loss

    return step


def eager_inference(model: nn.Module) -> Step:
    """The eager counterpart of :func:`capture_inference`: a forward without autograd."""
    def step(inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            return model(inputs)

    return step


def eager_training(model: nn.Module, optimizer: torch.optim.Optimizer) -> Step:
    """The eager counterpart of :func:`capture_training`: zero_grad, forward, loss, backward, optimizer step."""
    model.train()

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _batches(count: int, batch_size: int, device: torch.device, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randn(batch_size, 3, 32, 32, device=device, generator=generator),
             torch.randint(0, NUM_CLASSES, (batch_size,), device=device, generator=generator)) for _ in range(count)]


def _check_model(model: str) -> None:
    if model not in MODEL_NAMES:
        raise choice_error("model", model, MODEL_NAMES)


def agreement(model: str = "resnet18", width: float = 1.0, batch_size: int = 8, steps: int = 3,
              device: str = "cuda", seed: int = 0) -> pd.DataFrame:
    """Eager against graphed on the same weights and batches: inference logits, and the first ``steps`` losses.

    One row per comparison: the eager and graphed values (for logits, their largest magnitude), their largest
    absolute difference and the tolerance ``ATOL + RTOL * |eager|``.
    """
    _check_model(model)
    info = resolve_device(device)
    if not info.is_cuda:
        raise OptlabError(f"agreement compares eager with CUDA-graph replays and needs a CUDA device, got {info.name}")
    torch.manual_seed(seed)
    net = build_model(model, width=width).to(info.device)
    batches = _batches(steps + 1, batch_size, info.device, seed)
    rows = []
    eager_net, graphed_net = copy.deepcopy(net).eval(), copy.deepcopy(net).eval()
    replay = capture_inference(graphed_net, batches[0][0])
    eager_logits = eager_inference(eager_net)(batches[1][0])
    difference = float((replay(batches[1][0]) - eager_logits).abs().max())
    magnitude = float(eager_logits.abs().max())
    rows.append({"what": "inference logits", "step": 0, "eager": magnitude, "graphed": magnitude,
                 "abs_diff": difference})
    eager_net, graphed_net = copy.deepcopy(net), copy.deepcopy(net)
    eager = eager_training(eager_net, make_optimizer(eager_net))
    graphed = capture_training(graphed_net, make_optimizer(graphed_net), *batches[0])
    for index, batch in enumerate(batches[:steps]):
        eager_loss, graphed_loss = float(eager(*batch)), float(graphed(*batch))
        rows.append({"what": "training loss", "step": index, "eager": eager_loss, "graphed": graphed_loss,
                     "abs_diff": abs(eager_loss - graphed_loss)})
    frame = pd.DataFrame(rows)
    frame["tolerance"] = ATOL + RTOL * frame["eager"].abs()
    return frame


def _step_for(net: nn.Module, mode: str, execution: str, example: tuple[torch.Tensor, torch.Tensor]) -> Step:
    if mode == "inference":
        net.eval()
        return eager_inference(net) if execution == "eager" else capture_inference(net, example[0])
    optimizer = make_optimizer(net)
    return eager_training(net, optimizer) if execution == "eager" else capture_training(net, optimizer, *example)


MIN_BLOCKS = 2  # an interquartile range needs at least two blocks


def _time_step(step: Step, batches: list[tuple[torch.Tensor, torch.Tensor]], min_run_time: float,
               max_run_time: float) -> benchmark.Measurement:
    """Blocks of runs until there are four and their IQR is under 10 % of the median, or ``max_run_time`` is spent;
    at least :data:`MIN_BLOCKS` blocks in any case (a slow step can spend ``max_run_time`` in one block)."""
    from torch.utils import benchmark  # imported here: it imports setuptools, a sixth of a second of every start

    cycle = itertools.cycle(batches)
    for _ in range(WARMUP_ITERS):  # first calls of a shape: cuDNN/oneDNN plans, allocator growth
        step(*next(cycle))
    timer = benchmark.Timer(stmt="step(*next(cycle))", globals={"step": step, "cycle": cycle},
                            num_threads=torch.get_num_threads())
    measurement = timer.adaptive_autorange(threshold=0.1, min_run_time=min_run_time, max_run_time=max_run_time)
    while len(measurement.times) < MIN_BLOCKS:
        measurement = benchmark.Measurement.merge([measurement, timer.timeit(measurement.number_per_run)])[0]
    return measurement


def _validate(batch_sizes: Iterable[int], modes: Iterable[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    sizes, modes = tuple(batch_sizes), tuple(modes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise OptlabError(f"batch_sizes must be a non-empty list of positive integers, got {sizes!r}")
    for mode in modes or ("",):
        if mode not in MODES:
            raise choice_error("sweep mode", mode, MODES)
    return sizes, modes


def sweep(model: str = "resnet18", width: float = 1.0, batch_sizes: Iterable[int] | None = None,
          modes: Iterable[str] = MODES, device: str = "auto", min_run_time: float = 0.1, max_run_time: float = 0.5,
          seed: int = 0) -> pd.DataFrame:
    """Time per step and per image of eager and (on CUDA) graphed steps, for every mode and batch size.

    One row per mode, batch size and execution: ``median_s`` and ``iqr_s`` per step, the number of timed blocks,
    and ``per_image_us``. On the CPU only ``eager`` rows exist: there is no graph to capture.
    """
    _check_model(model)
    info = resolve_device(device)
    sizes, modes = _validate(batch_sizes or BATCH_SIZES[info.device.type], modes)
    executions = EXECUTIONS if info.is_cuda else EXECUTIONS[:1]
    rows = []
    for mode in modes:
        for size in sizes:
            batches = _batches(BATCH_POOL, size, info.device, seed)
            for execution in executions:
                torch.manual_seed(seed)
                net = build_model(model, width=width).to(info.device)
                step = _step_for(net, mode, execution, batches[0])
                measurement = _time_step(step, batches, min_run_time, max_run_time)
                rows.append({"device": info.name, "model": model, "width": width, "mode": mode, "batch_size": size,
                             "execution": execution, "median_s": measurement.median, "iqr_s": measurement.iqr,
                             "blocks": len(measurement.times), "per_image_us": 1e6 * measurement.median / size})
                del net, step  # a captured graph keeps its memory pool until it is freed
            if info.is_cuda:
                torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def sweep_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per mode and batch size: step time and IQR, time per image, eager and graphed side by side.

    Graphed columns are present but empty where nothing was captured (a CPU sweep), and the speed-up with them.
    """
    table = frame.assign(step_ms=1e3 * frame["median_s"], iqr_ms=1e3 * frame["iqr_s"]).pivot_table(
        index=["mode", "batch_size"], columns="execution", values=["step_ms", "iqr_ms", "per_image_us"])
    table = table.reindex(columns=pd.MultiIndex.from_product([["step_ms", "iqr_ms", "per_image_us"], EXECUTIONS]))
    table[("graph speed-up", "")] = table[("step_ms", "eager")] / table[("step_ms", "CUDA graph")]
    return table.round(3)


def run_reference(out: str | Path, device: str = "cuda") -> list[Path]:
    """The GPU reference: the eager and graphed sweep of full-width ResNet18, saved as ``out/cuda_graphs_sweep.csv``."""
    if not resolve_device(device).is_cuda:
        raise OptlabError(f"the CUDA-graph reference needs a CUDA device, got {device!r}")
    return [store.save_table(sweep("resnet18", 1.0, device=device), out, REFERENCE_TABLE)]
