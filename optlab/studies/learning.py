"""The learning check: train a few configurations from the same weights on the same batches, and record the
training loss, the test (validation) loss and accuracy against steps, so that a faster configuration can be seen to
learn as well; on a text corpus, beside the losses of predictors that ignore the context (:func:`text_levels`), and
the tokens and seconds each configuration needs to reach a validation loss below them (:func:`time_to_target`).

The training time leaves out evaluation and compilation: a step during which torch.compile built a graph counts as
compile time (``compile_s``), not training time (``train_s``)."""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import torch

from ..core.machine import compiler
from ..core.results import store
from ..core.gpt import text_data
from ..core.knobs.config import RunConfig
from ..core.machine.device import DeviceInfo, effective_config, resolve_device
from ..core.errors import OptlabError
from ..core.techniques.registry import Experiment, get_experiment
from ..core.run.progress import progress_bar
from ..core.run.variants import build_state
from ..core.measuring.loops import backend_flags, eval_step, train_step
from ..core.knobs.profiles import Profile, get_profile
from ..core.workload import get_workload


def plan(profile: Profile) -> dict[str, int]:
    """Steps, evaluation interval and evaluated test images for ``profile``: about one epoch on a GPU."""
    if profile.name == "smoke":
        return {"steps": 60, "eval_every": 15, "eval_images": 256}
    return {"steps": 50_000 // profile.batch_size, "eval_every": 50, "eval_images": 4096}


def _endless(loader) -> Iterator:
    """The loader's batches epoch after epoch (each pass reshuffles, as training would)."""
    return itertools.chain.from_iterable(iter(loader) for _ in itertools.count())


def _test_batches(state, test_set, samples: int) -> Iterator:
    """The test batches of an evaluation: on a token stream, ``samples`` windows spread evenly over the whole split
    (its loader's windows start one token apart, so its first batches would cover only the split's first tokens);
    on any other data, the test loader's batches."""
    if not isinstance(test_set, text_data.TokenWindows):
        return iter(state.loaders["test"])
    windows = get_workload(state.config.workload).dataset_for(test_set, state.config)
    starts = torch.linspace(0, len(windows) - 1, min(samples, len(windows))).long().tolist()
    size = state.config.batch_size
    return (tuple(map(torch.stack, zip(*(windows[i] for i in starts[at:at + size]))))
            for at in range(0, len(starts), size))


def _evaluate(state, info: DeviceInfo, test_set, samples: int, loss_fn) -> tuple[float, float]:
    """The accuracy and the mean loss per prediction on the first ``samples`` test samples (:func:`_test_batches`)."""
    state.model.eval()
    correct = predictions = seen = 0
    total = 0.0
    with backend_flags(state.config):
        for batch in _test_batches(state, test_set, samples):
            losses: list[torch.Tensor] = []
            correct += int(eval_step(state.model, batch, state.config, info.device, losses, loss_fn))
            total += float(losses[0]) * batch[1].numel()  # one prediction per image, or per token
            predictions += batch[1].numel()
            seen += len(batch[1])
            if seen >= samples:
                break
    state.model.train()
    return correct / predictions, total / predictions


LEVELS = ("uniform", "unigram", "bigram")  # the columns ``level_<name>`` of a text workload's curves


def text_levels(test_set) -> dict[str, float]:
    """The entropy levels (:func:`~optlab.core.gpt.text_data.entropy_levels`) of a text workload's test split, in nats
    per token; empty for a workload whose test set is not a token stream."""
    if not isinstance(test_set, text_data.TokenWindows):
        return {}
    return text_data.entropy_levels(test_set.tokens, test_set.vocab_size)


def learning_curves(configs: dict[str, RunConfig], info: DeviceInfo, steps: int, eval_every: int,
                    eval_images: int, seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """Train each config ``steps`` optimizer steps from the same weights; every ``eval_every`` steps record the mean
    training loss since the last record, the test loss and accuracy on ``eval_images`` test samples (sequences of a
    token model, spread over the split), and
    the elapsed training time (evaluation and compilation excluded) and the compile time so far. The configs share one
    workload; ``images`` counts its samples (sequences for a token model) and a column named by its unit (images,
    tokens) the items seen; the loss and accuracy are per prediction (per image, or per token). On a text workload
    every row also carries the test split's entropy levels (``level_uniform``, ``level_unigram``, ``level_bigram``)."""
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
    levels = {f"level_{name}": value for name, value in text_levels(test_set).items()}
    rows = []
    for label, requested in configs.items():
        config, _ = effective_config(requested, info)
        state = build_state(config, info, train_set, test_set, seed)
        batches = _endless(state.loaders["train"])
        state.model.train()
        losses, elapsed, compile_s = [], 0.0, 0.0
        bar = progress_bar(steps, label, progress)
        for step in range(1, steps + 1):
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
                accuracy, test_loss = _evaluate(state, info, test_set, eval_images, workload.loss)
                rows.append({"variant": label, "model": config.model, "step": step,
                             "images": step * config.images_per_step,
                             workload.unit: step * config.samples_per_step * workload.items_in(config),
                             "train_loss": sum(losses) / len(losses),
                             "test_loss": test_loss, "test_accuracy": accuracy, "train_s": elapsed,
                             "compile_s": compile_s, **levels})
                losses = []
            bar.update()
        bar.close()
        del state
    return pd.DataFrame(rows)


def target_loss(curves: pd.DataFrame, share: float) -> float:
    """The validation loss ``share`` of the way down from the unigram level to the bigram level of the curves' text
    (0: the unigram level, a model that has learned the characters' frequencies; 1: the bigram level)."""
    if not 0 <= share <= 1:
        raise OptlabError(f"share={share}: the target lies between the unigram (0) and the bigram (1) level")
    missing = [f"level_{name}" for name in LEVELS if f"level_{name}" not in curves]
    if missing:
        raise OptlabError(f"the curves have no {missing}: a target loss needs a text workload's entropy levels")
    unigram, bigram = curves["level_unigram"].iloc[0], curves["level_bigram"].iloc[0]
    return float(unigram - share * (unigram - bigram))


def time_to_target(curves: pd.DataFrame, target: float) -> pd.DataFrame:
    """Per variant, the first record whose test loss is at or below ``target``: the tokens trained and the training
    seconds (compilation apart, in ``compile s``) it took, NaN where no record reached it, and the last test loss."""
    rows = []
    for label, curve in curves.groupby("variant", sort=False):
        curve = curve.sort_values("step")
        reached = curve[curve["test_loss"] <= target]
        first = reached.iloc[0] if len(reached) else None
        rows.append({"variant": label, "target loss": target,
                     "tokens to target": math.nan if first is None else first["tokens"],
                     "seconds to target": math.nan if first is None else first["train_s"],
                     "compile s": math.nan if first is None else first["compile_s"],
                     "last test loss": curve["test_loss"].iloc[-1]})
    return pd.DataFrame(rows)


def learning_failures(curves: pd.DataFrame, target: float) -> list[str]:
    """One line per variant that did not learn from the context: its last test loss not below the unigram level of
    the text (a model that only learned which characters are frequent, or which rows of a padded head never occur,
    stops there), or no record at or below ``target``."""
    failures = []
    for label, row in time_to_target(curves, target).set_index("variant").iterrows():
        unigram = curves.loc[curves["variant"] == label, "level_unigram"].iloc[0]
        if not row["last test loss"] < unigram:
            failures.append(f"{label}: test loss {row['last test loss']:.3f} is not below the unigram level "
                            f"{unigram:.3f}")
        elif math.isnan(row["tokens to target"]):
            failures.append(f"{label}: test loss never reached the target {target:.3f} "
                            f"(last {row['last test loss']:.3f})")
    return failures


PUBLISHED_TIME_TO_TARGET = pd.DataFrame([
    {"source": "nanoGPT shakespeare_char", "model": "10.7M parameters, characters", "data": "tiny Shakespeare",
     "hardware": "1x NVIDIA A100", "target loss": 1.47, "minutes": 3.0,
     "url": "https://github.com/karpathy/nanoGPT#quick-start"},
    {"source": "llm.c baseline (modded-nanogpt's start)", "model": "GPT-2 124M, GPT-2 tokens", "data": "FineWeb",
     "hardware": "8x NVIDIA H100", "target loss": 3.28, "minutes": 45.0,
     "url": "https://github.com/KellerJordan/modded-nanogpt"},
    {"source": "modded-nanogpt record", "model": "GPT-2 124M, GPT-2 tokens", "data": "FineWeb",
     "hardware": "8x NVIDIA H100", "target loss": 3.28, "minutes": 1.23,
     "url": "https://github.com/KellerJordan/modded-nanogpt"},
])  # what they published, on their hardware and data: a validation loss and the wall time to reach it


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
