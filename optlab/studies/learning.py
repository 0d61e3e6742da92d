"""The learning check: train a few configurations from the same weights on the same batches, and record the
training loss and test accuracy against steps, so that a faster configuration can be seen to learn as well.

The training time leaves out evaluation and compilation: a step during which torch.compile built a graph counts as
compile time (``compile_s``), not training time (``train_s``)."""
from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from ..core import compiler, store
from ..core.config import RunConfig
from ..core.device import DeviceInfo, effective_config, resolve_device
from ..core.errors import OptlabError
from ..core.registry import Experiment, get_experiment
from ..core.variants import build_state
from ..core.loops import backend_flags, eval_step, train_step
from ..core.profiles import Profile, get_profile
from ..core.workload import get_workload


def plan(profile: Profile) -> dict[str, int]:
    """Steps, evaluation interval and evaluated test images for ``profile``: about one epoch on a GPU."""
    if profile.name == "smoke":
        return {"steps": 60, "eval_every": 15, "eval_images": 256}
    return {"steps": 50_000 // profile.batch_size, "eval_every": 50, "eval_images": 4096}


def _endless(loader) -> Iterator:
    """The loader's batches epoch after epoch (each pass reshuffles, as training would)."""
    return itertools.chain.from_iterable(iter(loader) for _ in itertools.count())


def _accuracy(state, info: DeviceInfo, images: int) -> float:
    state.model.eval()
    correct = seen = 0
    with backend_flags(state.config):
        for batch in state.loaders["test"]:
            correct += int(eval_step(state.model, batch, state.config, info.device))
            seen += batch[1].numel()  # one prediction per image, or per token
            if seen >= images:
                break
    state.model.train()
    return correct / seen


def learning_curves(configs: dict[str, RunConfig], info: DeviceInfo, steps: int, eval_every: int,
                    eval_images: int, seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """Train each config ``steps`` optimizer steps from the same weights; every ``eval_every`` steps record the mean
    training loss since the last record, the test accuracy on the first ``eval_images`` test images, and the
    elapsed training time (evaluation and compilation excluded) and the compile time so far. The configs share one
    workload; ``images`` counts its samples (sequences for a token model) and a column named by its unit (images,
    tokens) the items seen; the accuracy is per prediction (per image, or per token)."""
    if steps < 1 or eval_every < 1 or eval_images < 1:
        raise OptlabError(f"steps, eval_every and eval_images must be positive, got {steps}, {eval_every}, {eval_images}")
    compiler.require_compiler([effective_config(config, info)[0] for config in configs.values()], info)
    workloads = {config.workload for config in configs.values()}
    if len(workloads) != 1:
        raise OptlabError(f"the configs of one learning check train one workload, got {sorted(workloads)}")
    workload = get_workload(workloads.pop())
    source = workload.find_source(False)
    print(f"data source: {source.description}")
    train_set, test_set = workload.datasets(source, False)
    rows = []
    for label, requested in configs.items():
        config, _ = effective_config(requested, info)
        state = build_state(config, info, train_set, test_set, seed)
        batches = _endless(state.loaders["train"])
        state.model.train()
        losses, elapsed, compile_s = [], 0.0, 0.0
        for step in tqdm(range(1, steps + 1), desc=label, disable=not progress, file=sys.stderr, leave=False):
            graphs, start = compiler.compiled_graphs(), time.perf_counter()
            with backend_flags(config):
                micro_losses = [train_step(state.model, next(batches), state.optimizer, state.scaler, config,
                                           info.device, micro, loss_fn=workload.loss)
                                for micro in range(config.accumulation_steps)]
            losses.append(float(torch.stack(micro_losses).float().mean()))  # a sync: the time covers the device's work
            seconds = time.perf_counter() - start
            if compiler.compiled_graphs() > graphs:
                compile_s += seconds
            else:
                elapsed += seconds
            if step % eval_every == 0 or step == steps:
                rows.append({"variant": label, "model": config.model, "step": step,
                             "images": step * config.images_per_step,
                             workload.unit: step * config.samples_per_step * workload.items_in(config),
                             "train_loss": sum(losses) / len(losses),
                             "test_accuracy": _accuracy(state, info, eval_images), "train_s": elapsed,
                             "compile_s": compile_s})
                losses = []
        del state
    return pd.DataFrame(rows)


def fastest_pair(profile: Profile, model: str = "resnet18", stack: Experiment | None = None) -> dict[str, RunConfig]:
    """The first and last steps of the all-together ``stack`` (default: the registry's): the seed's baseline and the
    fastest configuration."""
    stack = (stack or get_experiment("all_together")).configs(model, profile)
    labels = list(stack)
    return {labels[0]: stack[labels[0]], labels[-1]: stack[labels[-1]]}


def run_reference(out: str | Path, device: str = "cuda") -> list[Path]:
    """The GPU reference of the learning check (about one epoch per configuration), saved as ``learning_curves.csv``."""
    info = resolve_device(device)
    profile = get_profile(None, info.is_cuda)
    curves = learning_curves(fastest_pair(profile), info, **plan(profile))
    return [store.save_table(curves, out, "learning_curves")]
