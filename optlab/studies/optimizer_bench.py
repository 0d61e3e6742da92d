"""``optimizer.step()`` alone: its time, what it launches, the state it keeps, and whether implementations agree.

Every variant of the ``optimizers`` registry entry (SGD and Adam, each as a for-loop, foreach and fused) is built by
:func:`optlab.loops.make_optimizer` on a real model's parameters, with random gradients in place of a backward pass.
``torch.utils.benchmark.Timer.adaptive_autorange`` times the step (median and IQR over blocks of runs);
``torch.profiler`` counts what one step dispatches: the top-level aten operators called from Python (host overhead,
on any device) and, on CUDA, the kernels the GPU runs.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils import benchmark

from ..core.results import store
from ..core.knobs.config import RunConfig
from ..core.machine.device import DeviceInfo, resolve_device
from ..core.errors import OptlabError
from ..core.techniques.registry import get_experiment
from ..core.measuring.loops import make_optimizer
from ..core.cifar.models import build_model
from ..core.knobs.profiles import Profile, get_profile

EXPERIMENT = "optimizers"
MIN_RUN_TIME_S = 0.05  # timed per variant before the spread is checked
MAX_RUN_TIME_FACTOR = 5  # at most this many times min_run_time per variant, whatever the spread
PARITY_STEPS = 3


def build_optimizer(model: nn.Module, config: RunConfig, info: DeviceInfo) -> torch.optim.Optimizer:
    """:func:`make_optimizer`, with a clear error when this torch has no such implementation for the device."""
    try:
        return make_optimizer(model, config)
    except (RuntimeError, ValueError) as error:
        raise OptlabError(f"{config.optimizer} {config.optimizer_impl} is not available on {info.name} "
                          f"({info.device.type}) in torch {torch.__version__}: {error}") from error


def fill_gradients(model: nn.Module, seed: int) -> None:
    """Give every parameter a random gradient (the same ones for the same ``seed``), as a backward pass would."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        parameter.grad = torch.randn(parameter.shape, generator=generator).to(parameter.device)


def state_mib(optimizer: torch.optim.Optimizer) -> float:
    """MiB held in the optimizer's state tensors (momentum buffers, Adam's two moments, step counters)."""
    tensors = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def launch_counts(optimizer: torch.optim.Optimizer, info: DeviceInfo) -> dict[str, float]:
    """One profiled step: top-level aten operators (not called by another aten op) and, on CUDA, GPU kernels."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.is_cuda else [])
    with profile(activities=activities) as prof:
        optimizer.step()
        if info.is_cuda:
            torch.cuda.synchronize(info.device)
    events = prof.events()
    top_level = [e for e in events if e.name.startswith("aten::") and e.device_type == torch.autograd.DeviceType.CPU
                 and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    return {"aten_ops_per_step": len(top_level), "kernels_per_step": len(kernels) if info.is_cuda else float("nan")}


def _step_extra_mib(optimizer: torch.optim.Optimizer, info: DeviceInfo) -> float:
    """CUDA only: the allocator's peak during one step above what was allocated before it (temporary buffers)."""
    if not info.is_cuda:
        return float("nan")
    torch.cuda.synchronize(info.device)
    before = torch.cuda.memory_allocated(info.device)
    torch.cuda.reset_peak_memory_stats(info.device)
    optimizer.step()
    torch.cuda.synchronize(info.device)
    return (torch.cuda.max_memory_allocated(info.device) - before) / 2**20


def _variant_configs(model: str, profile: Profile) -> dict[str, RunConfig]:
    return get_experiment(EXPERIMENT).configs(model, profile)


def step_benchmark(models: Iterable[str] | None = None, profile: "str | Profile | None" = None, device: str = "auto",
                   min_run_time: float = MIN_RUN_TIME_S, seed: int = 0) -> pd.DataFrame:
    """One row per model and registry variant: step time (median, IQR), launches per step and state memory.

    Models default to the profile's, built at the profile's width. Raises OptlabError for an implementation the
    device does not have.
    """
    info = resolve_device(device)
    prof = get_profile(profile, info.is_cuda)
    rows = []
    for model_name in models or prof.models:
        torch.manual_seed(seed)
        base = build_model(model_name, width=prof.width).to(info.device)
        for label, config in _variant_configs(model_name, prof).items():
            model = copy.deepcopy(base)
            fill_gradients(model, seed)
            optimizer = build_optimizer(model, config, info)
            optimizer.step()  # creates the state; later steps are the steady state
            timer = benchmark.Timer("optimizer.step()", globals={"optimizer": optimizer}, label="optimizer.step()",
                                    sub_label=model_name, description=label, num_threads=torch.get_num_threads())
            measurement = timer.adaptive_autorange(threshold=0.1, min_run_time=min_run_time,
                                                   max_run_time=MAX_RUN_TIME_FACTOR * min_run_time)
            params = list(model.parameters())
            rows.append({
                "device": info.name, "model": model_name, "variant": label, "optimizer": config.optimizer,
                "impl": config.optimizer_impl, "param_tensors": len(params),
                "params_mib": sum(p.numel() * p.element_size() for p in params) / 2**20,
                "median_ms": 1e3 * measurement.median, "iqr_ms": 1e3 * measurement.iqr, "runs": len(measurement.times),
                **launch_counts(optimizer, info), "state_mib": state_mib(optimizer),
                "step_extra_mib": _step_extra_mib(optimizer, info),
            })
    return pd.DataFrame(rows)


def parity(model: str = "resnet18", profile: "str | Profile | None" = None, device: str = "auto",
           steps: int = PARITY_STEPS, seed: int = 0) -> pd.DataFrame:
    """From the same weights and gradients, ``steps`` steps of every variant; the largest parameter difference
    against the for-loop implementation of the same optimizer (absolute, and relative to the largest weight), and how
    far the steps moved the weights (``max_update``: the differences mean something only next to it)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise OptlabError(f"steps must be an integer >= 1, got {steps!r}")
    info = resolve_device(device)
    prof = get_profile(profile, info.is_cuda)
    torch.manual_seed(seed)
    base = build_model(model, width=prof.width).to(info.device)
    weights: dict[str, list[torch.Tensor]] = {}
    configs = _variant_configs(model, prof)
    for label, config in configs.items():
        net = copy.deepcopy(base)
        optimizer = build_optimizer(net, config, info)
        for step in range(steps):
            fill_gradients(net, seed + step)
            optimizer.step()
        weights[label] = [p.detach().float() for p in net.parameters()]
    rows = []
    for label, config in configs.items():
        reference = next(w for name, w in weights.items()
                         if configs[name].optimizer == config.optimizer and configs[name].optimizer_impl == "for_loop")
        diff = max(float((a - b).abs().max()) for a, b in zip(weights[label], reference))
        scale = max(float(b.abs().max()) for b in reference)
        moved = max(float((a - b.detach().float()).abs().max()) for a, b in zip(weights[label], base.parameters()))
        rows.append({"model": model, "variant": label, "optimizer": config.optimizer, "impl": config.optimizer_impl,
                     "steps": steps, "max_abs_diff": diff, "max_rel_diff": diff / scale, "max_update": moved})
    return pd.DataFrame(rows)


def run_reference(out: "str | Path", device: str = "cuda") -> list[Path]:
    """The GPU reference: the step micro-benchmark on every model of the quick profile, saved as optimizer_step.csv."""
    table = step_benchmark(profile="quick", device=device)
    return [store.save_table(table, out, "optimizer_step")]
