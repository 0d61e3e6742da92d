"""Experiments: a baseline and its variants, run interleaved (A B A B) on every model of a profile.

A technique is data: an :class:`Experiment` in the registry. ``run_experiment`` returns a tidy DataFrame (one row
per model, variant, repeat and phase), a summary table and the stored record.
"""
from __future__ import annotations

import gc
import sys
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import torch
from tqdm import tqdm

from . import compiler, data, store
from .config import RunConfig, apply_changes, changed_knobs
from .device import DeviceInfo, effective_config, resolve_device
from .device_data import DeviceResidentLoader
from .environment import capture
from .errors import OptlabError, choice_error
from .flops import step_flops, tflops
from .loops import eval_phase, make_optimizer, make_scaler, prepare_model, train_phase
from .memory import memory_kind
from .models import MODEL_NAMES, build_model
from .profiles import Profile, get_profile
from .summary import summarize_runs
from .timing import epoch_equivalent

PHASES = ("train", "test")


@dataclass(frozen=True)
class Experiment:
    """One technique: shared knobs, then labelled variants whose first entry is the baseline."""

    name: str
    title: str
    section: str  # the seed article's section, "" for techniques beyond the seed
    variants: tuple[tuple[str, dict[str, Any]], ...]  # (label, knob changes)
    phases: tuple[str, ...] = PHASES
    base: dict[str, Any] = field(default_factory=dict)  # knob changes shared by every variant
    description: str = ""
    needs_cuda: bool = False  # meaningless without a GPU: refused on the CPU instead of pretending
    models: tuple[str, ...] | None = None  # the profile's models to run by default (None: all of them)

    def __post_init__(self) -> None:
        if len(self.variants) < 2:
            raise OptlabError(f"experiment {self.name!r} needs a baseline and at least one variant")
        bad = set(self.phases) - set(PHASES)
        if bad:
            raise choice_error("phase", sorted(bad)[0], PHASES)

    @property
    def labels(self) -> list[str]:
        return [label for label, _ in self.variants]

    @property
    def baseline_label(self) -> str:
        return self.variants[0][0]

    def default_models(self, profile: Profile) -> tuple[str, ...]:
        """The models a run uses when none are given: the profile's, narrowed to this technique's own if it has
        any (compiling every model would take a GPU reference run past its time budget)."""
        chosen = tuple(m for m in profile.models if self.models is None or m in self.models)
        return chosen or profile.models

    def configs(self, model: str, profile: Profile, overrides: dict[str, Any] | None = None) -> dict[str, RunConfig]:
        """The requested config of every variant for ``model`` under ``profile`` and user ``overrides``."""
        common = RunConfig(model=model, batch_size=profile.batch_size, width=profile.width,
                           num_workers=profile.num_workers)
        common = apply_changes(apply_changes(common, self.base), overrides or {})
        return {label: apply_changes(common, changes) for label, changes in self.variants}

    def with_variants(self, *variants: tuple[str, dict[str, Any]], name: str | None = None) -> "Experiment":
        """A copy with other variants (a chapter's own comparison), keeping everything else."""
        return replace(self, name=name or self.name, variants=tuple(variants))

    def for_phases(self, *phases: str) -> "Experiment":
        """A copy that times only ``phases`` (a CPU chapter that cannot afford every phase)."""
        return replace(self, phases=tuple(phases))


REGISTRY: dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    REGISTRY[experiment.name] = experiment
    return experiment


def get_experiment(name: str | Experiment) -> Experiment:
    if isinstance(name, Experiment):
        return name
    from . import techniques  # noqa: F401  (fills the registry)

    if name not in REGISTRY:
        raise choice_error("technique", name, list(REGISTRY))
    return REGISTRY[name]


def list_experiments() -> pd.DataFrame:
    """Every registered technique with its seed section, timed phases and variants."""
    from . import techniques  # noqa: F401

    return pd.DataFrame(
        [
            {"technique": e.name, "section": e.section or "beyond", "title": e.title, "timed": "+".join(e.phases),
             "device": "cuda" if e.needs_cuda else "any", "variants": " | ".join(e.labels)}
            for e in REGISTRY.values()
        ]
    )


@dataclass
class ExperimentResult:
    """What a run returns: the tidy samples, the summary, the stored record and where it was written."""

    experiment: Experiment
    samples: pd.DataFrame
    summary: pd.DataFrame
    record: dict[str, Any]
    path: Path | None = None


@dataclass
class VariantState:
    """A variant's live objects during a run: its model, optimizer, scaler and loaders."""

    config: RunConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loaders: dict[str, torch.utils.data.DataLoader]
    failed: str | None = None


def _validate_models(models: Iterable[str]) -> tuple[str, ...]:
    models = tuple(models)
    for model in models:
        if model not in MODEL_NAMES:
            raise choice_error("model", model, MODEL_NAMES)
    if not models:
        raise OptlabError("no models given; choose from: " + ", ".join(MODEL_NAMES))
    return models


def build_state(config: RunConfig, info: DeviceInfo, train_set, test_set, seed: int) -> VariantState:
    """A fresh model (same weights for every seed), its optimizer, scaler and loaders, as ``config`` asks."""
    torch.manual_seed(seed)  # every variant starts from the same weights
    model = build_model(config.model, config.model_variant, config.width)
    model = prepare_model(model, config, info.device)
    if config.data_on_device:
        loaders = {phase: DeviceResidentLoader(dataset, config.images_per_step, info.device, phase == "train",
                                               config.drop_last, seed)
                   for phase, dataset in (("train", train_set), ("test", test_set))}
    else:
        loaders = {
            "train": data.make_loader(train_set, config, train=True, seed=seed),
            "test": data.make_loader(test_set, config, train=False, seed=seed),
        }
    return VariantState(config, model, make_optimizer(model, config), make_scaler(config, info.device), loaders)


def _run_phase(state: VariantState, phase: str, profile: Profile, info: DeviceInfo):
    if phase == "train":
        return train_phase(state.model, state.loaders["train"], state.optimizer, state.scaler, state.config,
                           info.device, profile.steps, profile.warmup_steps)
    return eval_phase(state.model, state.loaders["test"], state.config, info.device, profile.test_steps,
                      profile.warmup_steps)


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)


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
    """Run ``experiment`` on every model, interleaving its variants; save the record under ``out`` if given."""
    experiment = get_experiment(experiment)
    info = resolve_device(device)
    if experiment.needs_cuda and not info.is_cuda:
        raise OptlabError(f"{experiment.name} needs a CUDA device and this run is on {info.name} (cpu); "
                          "its chapter shows the stored GPU reference instead")
    prof = get_profile(profile, info.is_cuda)
    chosen = _validate_models(models or experiment.default_models(prof))
    requested = {m: experiment.configs(m, prof, overrides) for m in chosen}
    effective = {m: {label: effective_config(c, info) for label, c in cfgs.items()} for m, cfgs in requested.items()}
    compiler.require_compiler([c for cfgs in effective.values() for c, _ in cfgs.values()], info)
    out_dir = store.writable_dir(out) if out is not None else None
    source = data.find_source(download)
    print(f"optlab {experiment.name}: {prof.describe(chosen)}")
    print(f"device: {info.describe()}")
    print(f"data source: {source.description}")
    notes = sorted({note for cfgs in effective.values() for _, ns in cfgs.values() for note in ns})
    for note in notes:
        print(f"note: {note}")
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # our note above says it once
    train_set, test_set = data.datasets(source, download)
    environment = capture(info, source.description, prof.name)

    rows: list[dict[str, Any]] = []
    total = len(chosen) * (prof.warmup_repeats + prof.repeats) * len(experiment.labels) * len(experiment.phases)
    bar = tqdm(total=total, desc=experiment.name, disable=not progress, file=sys.stderr, leave=False)
    for model_name in chosen:
        states: dict[str, VariantState] = {}
        for label, (config, _) in effective[model_name].items():
            states[label] = build_state(config, info, train_set, test_set, seed)
        for repeat in range(prof.warmup_repeats + prof.repeats):
            for label, state in states.items():  # A B A B: every repeat visits every variant in turn
                for phase in experiment.phases:
                    bar.update()
                    if state.failed:
                        continue
                    torch.manual_seed(seed + 1 + repeat)  # same augmentation and dropout for every variant
                    try:
                        result = _run_phase(state, phase, prof, info)
                    except RuntimeError as error:
                        if not _is_out_of_memory(error):
                            raise
                        state.failed = "out of memory"
                        rows.append(_failed_row(experiment, model_name, label, repeat - prof.warmup_repeats, phase, state))
                        torch.cuda.empty_cache()
                        continue
                    if repeat >= prof.warmup_repeats:
                        rows.append(_row(experiment, model_name, label, repeat - prof.warmup_repeats, phase, state,
                                         result, len(train_set if phase == "train" else test_set)))
        compiled = any(state.config.compile_mode != "none" for state in states.values())
        del states
        gc.collect()
        if compiled:  # drop this model's compiled code: each model gets Dynamo's whole recompile limit (8 per function)
            torch._dynamo.reset()
        if info.is_cuda:
            torch.cuda.empty_cache()
    bar.close()

    samples = pd.DataFrame(rows)
    summary = summarize_runs(samples, experiment.baseline_label)
    record = store.make_record(
        experiment=experiment,
        profile=prof,
        environment=environment,
        configs={m: {label: c.to_dict() for label, c in cfgs.items()} for m, cfgs in requested.items()},
        effective={m: {label: c.to_dict() for label, (c, _) in cfgs.items()} for m, cfgs in effective.items()},
        notes=notes,
        memory_kind=memory_kind(info.device),
        samples=samples,
        summary=summary,
    )
    path = store.save_record(record, out_dir, filename) if out_dir is not None else None
    if path is not None:
        print(f"wrote {path}")
    return ExperimentResult(experiment, samples, summary, record, path)


def _base_row(experiment: Experiment, model: str, label: str, repeat: int, phase: str, state: VariantState) -> dict[str, Any]:
    return {"technique": experiment.name, "model": model, "variant": label, "repeat": repeat, "phase": phase,
            "images_per_step": state.config.images_per_step}


def _failed_row(experiment, model, label, repeat, phase, state) -> dict[str, Any]:
    return {**_base_row(experiment, model, label, repeat, phase, state), "status": state.failed}


def _row(experiment, model, label, repeat, phase, state: VariantState, result, epoch_images: int) -> dict[str, Any]:
    config = state.config
    steps = result.step_times_s
    mean_step = sum(steps) / len(steps)
    flops = step_flops(config.model, config.model_variant, config.width, config.images_per_step, phase == "train")
    return {
        **_base_row(experiment, model, label, repeat, phase, state),
        "status": "ok",
        "epoch_images": epoch_images,
        "startup_s": result.startup_s,
        "first_step_s": result.warmup_times_s[0] if result.warmup_times_s else None,
        "wall_s": result.wall_s,
        "steps": len(steps),
        "step_median_s": float(pd.Series(steps).median()),
        "epoch_equiv_s": epoch_equivalent(result.startup_s, steps, config.images_per_step, epoch_images),
        "images_per_s": config.images_per_step / mean_step,
        "peak_mem_mb": result.peak_mem_mb,
        "flops_per_step": flops,
        "tflops": tflops(flops, mean_step),
        "loss_last": result.losses[-1] if result.losses else None,
        "accuracy": result.correct / result.images if phase == "test" and result.images else None,
        "step_times_s": steps,
        "warmup_times_s": result.warmup_times_s,
        "losses": result.losses,
        "warmup_losses": result.warmup_losses,
        "graphs_compiled": result.graphs_compiled,
    }
