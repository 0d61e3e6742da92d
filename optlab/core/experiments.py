"""Running an experiment: its variants interleaved on every model of a profile, timed, summarised and stored.

The variants take turns within each repeat, and the order rotates from one repeat to the next (A B, then B A), so
that drift hits every variant alike and no variant always runs in the same slot. ``run_experiment`` returns a tidy
DataFrame (one row per model, variant, repeat and phase), a summary table and the stored record; the record is
rewritten after each model, so a run killed midway keeps every model it finished.
"""
from __future__ import annotations

import gc
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import torch
from tqdm import tqdm

from . import compiler, data, store
from .device import DeviceInfo, effective_config, resolve_device
from .environment import capture
from .errors import OptlabError
from .loops import PhaseResult, eval_phase, train_phase
from .memory import memory_kind
from .models import validate_names
from .profiles import Profile, get_profile
from .registry import Experiment, get_experiment
from .samples import failed_row, sample_row
from .summary import summarize_runs
from .variants import VariantState, build_state


@dataclass
class ExperimentResult:
    """What a run returns: the tidy samples, the summary, the stored record and where it was written."""

    experiment: Experiment
    samples: pd.DataFrame
    summary: pd.DataFrame
    record: dict[str, Any]
    path: Path | None = None


def visit_order(labels: list[str], repeat: int) -> list[str]:
    """The order in which ``repeat`` visits the variants: the list rotated by ``repeat`` (A B, B A; A B C, B C A,
    C A B), so that over as many repeats as variants each variant takes each slot once."""
    shift = repeat % len(labels)
    return labels[shift:] + labels[:shift]


def run_phase(state: VariantState, phase: str, profile: Profile, info: DeviceInfo) -> PhaseResult:
    """One timed pass of ``phase`` with the variant's own loader and the profile's step counts."""
    if phase == "train":
        return train_phase(state.model, state.loaders["train"], state.optimizer, state.scaler, state.config,
                           info.device, profile.steps, profile.warmup_steps)
    return eval_phase(state.model, state.loaders["test"], state.config, info.device, profile.test_steps,
                      profile.warmup_steps)


def failure_status(error: BaseException) -> str:
    """``out of memory``, or ``failed: <the error's first line>``, for a variant that raised."""
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error):
        return "out of memory"
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    return f"failed: {type(error).__name__}: {first_line}".rstrip(": ")


def run_experiment(
    experiment: str | Experiment,
    models: Iterable[str] | None = None,
    profile: str | Profile | None = None,
    device: str = "auto",
    overrides: dict[str, Any] | None = None,
    out: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
    download: bool = False,
    filename: str | None = None,
) -> ExperimentResult:
    """Run ``experiment`` on every model, interleaving its variants; save the record under ``out`` if given.

    A variant that raises (out of memory, or any other error) is recorded with its status and left out of the
    later repeats; the other variants go on.
    """
    experiment = get_experiment(experiment)
    info = resolve_device(device)
    if experiment.needs_cuda and not info.is_cuda:
        raise OptlabError(f"{experiment.name} needs a CUDA device and this run is on {info.name} (cpu); "
                          "its chapter shows the stored GPU reference instead")
    prof = get_profile(profile, info.is_cuda)
    chosen = validate_names(models or experiment.default_models(prof))
    requested = {m: experiment.configs(m, prof, overrides) for m in chosen}
    effective = {m: {label: effective_config(c, info) for label, c in cfgs.items()} for m, cfgs in requested.items()}
    compiler.require_compiler([c for cfgs in effective.values() for c, _ in cfgs.values()], info)
    out_dir = store.writable_dir(out) if out is not None else None
    filename = filename or store.record_filename(experiment.name)
    source = data.find_source(download)
    print(f"optlab {experiment.name}: {prof.describe(chosen)}")
    print(f"device: {info.describe()}")
    print(f"data source: {source.description}")
    notes = sorted({note for cfgs in effective.values() for _, ns in cfgs.values() for note in ns})
    for note in notes:
        print(f"note: {note}")
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # our note above says it once
    train_set, test_set = data.datasets(source, download)
    epoch_images = {"train": len(train_set), "test": len(test_set)}
    environment = capture(info, source.description, prof.name)

    def record_of(rows: list[dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
        samples = pd.DataFrame(rows)
        summary = summarize_runs(samples, experiment.baseline_label)
        record = store.make_record(
            experiment=experiment, profile=prof, environment=environment,
            configs={m: {label: c.to_dict() for label, c in cfgs.items()} for m, cfgs in requested.items()},
            effective={m: {label: c.to_dict() for label, (c, _) in cfgs.items()} for m, cfgs in effective.items()},
            notes=notes, memory_kind=memory_kind(info.device), samples=samples, summary=summary,
        )
        return samples, summary, record

    rows: list[dict[str, Any]] = []
    path = None
    total = len(chosen) * (prof.warmup_repeats + prof.repeats) * len(experiment.labels) * len(experiment.phases)
    bar = tqdm(total=total, desc=experiment.name, disable=not progress, file=sys.stderr, leave=False)
    for model_name in chosen:
        rows += _run_model(experiment, model_name, effective[model_name], prof, info, train_set, test_set,
                           epoch_images, seed, bar)
        if out_dir is not None:  # after every model: a run killed later keeps what it finished
            path = store.save_record(record_of(rows)[2], out_dir, filename)
    bar.close()

    samples, summary, record = record_of(rows)
    if path is not None:
        print(f"wrote {store.display_path(path)}")
    return ExperimentResult(experiment, samples, summary, record, path)


def _run_model(experiment: Experiment, model_name: str, configs: dict, prof: Profile, info: DeviceInfo, train_set,
               test_set, epoch_images: dict[str, int], seed: int, bar: tqdm) -> list[dict[str, Any]]:
    """Every repeat of every variant and phase on one model; the variants' objects are freed at the end."""
    rows: list[dict[str, Any]] = []
    states: dict[str, VariantState] = {}
    for label, (config, _) in configs.items():
        try:
            states[label] = build_state(config, info, train_set, test_set, seed)
        except Exception as error:  # noqa: BLE001  (recorded, and the other variants go on)
            rows += [failed_row(experiment.name, model_name, label, 0, phase, config, failure_status(error))
                     for phase in experiment.phases]
    for repeat in range(prof.warmup_repeats + prof.repeats):
        kept = repeat - prof.warmup_repeats
        for label in visit_order([label for label in configs if label in states], repeat):
            state = states[label]
            for phase in experiment.phases:
                bar.update()
                if state.failed:
                    continue
                torch.manual_seed(seed + 1 + repeat)  # same augmentation and dropout for every variant
                try:
                    result = run_phase(state, phase, prof, info)
                except Exception as error:  # noqa: BLE001  (recorded, and the other variants go on)
                    state.failed = failure_status(error)
                    rows.append(failed_row(experiment.name, model_name, label, kept, phase, state.config, state.failed))
                    if info.is_cuda:
                        torch.cuda.empty_cache()
                    continue
                if kept >= 0:
                    rows.append(sample_row(experiment.name, model_name, label, kept, phase, state.config, result,
                                           epoch_images[phase]))
    compiled = any(state.config.compile_mode != "none" for state in states.values())
    del states
    gc.collect()
    if compiled:  # drop this model's compiled code: each model gets Dynamo's whole recompile limit (8 per function)
        torch._dynamo.reset()
    if info.is_cuda:
        torch.cuda.empty_cache()
    return rows
