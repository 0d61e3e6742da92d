"""Tidy sample rows: one per model, variant, repeat and phase, with the raw step times and what follows from them."""
from __future__ import annotations

from typing import Any

import pandas as pd

from ..knobs.config import RunConfig
from .flops import config_step_flops, tflops
from .loops import PhaseResult
from .timing import epoch_equivalent
from ..workload import get_workload


def base_row(technique: str, model: str, label: str, repeat: int, phase: str, config: RunConfig) -> dict[str, Any]:
    """The keys every row has, whatever became of the run. ``images_per_step`` counts samples (images, sequences)
    under the name the records have always used."""
    return {"technique": technique, "model": model, "variant": label, "repeat": repeat, "phase": phase,
            "images_per_step": config.samples_per_step}


def failed_row(technique: str, model: str, label: str, repeat: int, phase: str, config: RunConfig,
               status: str) -> dict[str, Any]:
    """A run that did not finish: ``status`` says why (``out of memory`` or ``failed: <error>``)."""
    return {**base_row(technique, model, label, repeat, phase, config), "status": status}


def sample_row(technique: str, model: str, label: str, repeat: int, phase: str, config: RunConfig,
               result: PhaseResult, epoch_images: int, flops: int | None = None) -> dict[str, Any]:
    """A finished run: its raw samples, epoch-equivalent time, throughput, FLOP rate, memory and losses.

    Throughput is ``images_per_s`` (samples per second, the records' name) and ``items_per_s`` in the workload's
    ``unit`` (images, or tokens: sequences x sequence length). ``epoch_images`` is the samples of one epoch (of the workload's data set: ``items_per_sample`` items each), and
    the epoch-equivalent time counts items, so a config with other samples per step (shorter token sequences) is timed
    on the same epoch.
    ``flops`` is one step's FLOP count, for a model that is not one of optlab's own (default: counted for
    ``config.model`` of ``config.workload``)."""
    workload = get_workload(config.workload)
    steps = result.step_times_s
    mean_step = sum(steps) / len(steps)
    if flops is None:
        flops = config_step_flops(config, phase == "train")
    return {
        **base_row(technique, model, label, repeat, phase, config),
        "status": "ok",
        "epoch_images": epoch_images,
        "startup_s": result.startup_s,
        "first_step_s": result.warmup_times_s[0] if result.warmup_times_s else None,
        "wall_s": result.wall_s,
        "steps": len(steps),
        "step_median_s": float(pd.Series(steps).median()),
        "epoch_equiv_s": epoch_equivalent(result.startup_s, steps, config.samples_per_step * workload.items_in(config),
                                          epoch_images * workload.items_per_sample),
        "images_per_s": config.samples_per_step / mean_step,
        "unit": workload.unit,
        "items_per_s": config.samples_per_step * workload.items_in(config) / mean_step,
        "peak_mem_mb": result.peak_mem_mb,
        "resident_mem_mb": result.resident_mem_mb,
        "flops_per_step": flops,
        "tflops": tflops(flops, mean_step),
        "loss_last": result.losses[-1] if result.losses else None,
        "accuracy": result.correct / result.predictions if phase == "test" and result.predictions else None,
        "step_times_s": steps,
        "warmup_times_s": result.warmup_times_s,
        "losses": result.losses,
        "warmup_losses": result.warmup_losses,
        "graphs_compiled": result.graphs_compiled,
        "inductor_cache": result.inductor_cache,
        "cudagraph_skips": result.cudagraph_skips,
        "graph_pool_mb": result.graph_pool_mb,
        "pid": result.pid,
    }
