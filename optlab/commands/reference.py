"""The reference run, sized to a lent GPU's minutes and resumable across sessions.

A *part* is one model of one technique (it adds that model to ``OUT/<technique>.json``) or one study's extra tables
(``OUT/<table>.csv``, CUDA only). Parts run in a fixed priority order: the nine seed techniques and their tables,
then precision, the data pipeline and the optimizers with theirs, the all-together stack, and the compiling
techniques. ``--plan`` prints every part with its steps and its estimated H200 seconds (:func:`estimate`, from the
step-time table below); ``--budget`` runs parts until the next would not fit. A part already recorded under ``OUT``
by this machine, torch version and commit in this profile is skipped, so each lent session adds what is missing:
a technique's record says which models it holds, and ``reference-parts.csv`` lists every part that ran.
"""
from __future__ import annotations

import datetime as dt
import importlib
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pandas as pd
import torch

from ..core import store
from ..core.config import RunConfig
from ..core.device import DeviceInfo, resolve_device
from ..core.environment import git_commit
from ..core.errors import OptlabError
from ..core.experiments import ExperimentResult, run_experiment
from ..core.profiles import Profile, get_profile
from ..core.registry import Experiment, get_experiment
from ..core.techniques import technique_set

PRIORITY = ("seed", "beyond", "stack", "compile")  # the order of the sets in a run; "all" is every one
TECHNIQUE_ORDER = {"beyond": ("precision", "data_pipeline", "optimizers")}  # within a set, where it differs
# The extra tables of each set: modules whose ``run_reference(out, device)`` measures and saves them (CUDA only).
EXTRAS = {
    "seed": ("microbench", "autotune"),
    "beyond": ("numerics", "tf32", "optimizer_bench", "cuda_graphs", "pipeline"),
    "stack": ("profiling", "learning"),  # profiling's "after" configuration compiles
    "compile": (),
}
MANIFEST = "reference-parts"  # OUT/reference-parts.csv: every part that ran, with its key, status and seconds

# Estimated H200 seconds. A training step at batch 128, full width, eager fp32 (TF32 convolutions): the issue's
# survey of public numbers, not yet measured here. The rest: the loader's per-image cost measured on the 2-core CI
# machine, and guesses for compilation and set-up, to be replaced by the first GPU run's reference-parts.csv.
TRAIN_STEP_S = {"resnet18": 0.012, "resnet50": 0.035, "resnet101": 0.060, "mobilenet_v2": 0.010}
AMP_FACTOR = 0.5  # fp16 or bf16 autocast: half the step
EVAL_FACTOR = 1 / 3  # an evaluation step is a forward pass, about a third of a training step
MIN_STEP_S = 0.002  # a step launches hundreds of kernels: never faster than this
IMAGE_S = {"train": 60e-6, "test": 30e-6}  # one loader process's PIL decode and transforms per image
WORKER_STARTUP_S = 0.3  # starting a phase's loader workers
COMPILE_S = {"train": 60.0, "test": 25.0}  # a cold Inductor compile of a CIFAR model per phase (40-90 s a model)
COMPILE_FACTOR = {"default": 1.0, "reduce-overhead": 1.2, "max-autotune": 3.0}
VARIANT_SETUP_S = 0.4  # a variant's model, optimizer and loaders (ResNet101 builds in 0.4 s on the CI machine)
FRESH_PROCESS_S = 4.0  # an isolated variant's own process: interpreter, torch, CUDA context, data sets
PART_SETUP_S = 0.3  # a part's environment capture (nvidia-smi) and record writes
TABLE_S = {"microbench": 20, "autotune": 45, "numerics": 40, "tf32": 15, "optimizer_bench": 30, "cuda_graphs": 60,
           "pipeline": 40, "profiling": 120, "learning": 150}  # each study's tables, whole
EPOCH_IMAGES = {"train": 50_000, "test": 10_000}  # a whole epoch, for the full profile
PART_LIMIT_S = 240  # no part may need more than 4 minutes: a killed command loses only the part it was in


@dataclass(frozen=True)
class Part:
    """One unit of the reference run: a technique on one model, or one study's tables."""

    set_name: str
    name: str
    steps: int  # training and evaluation steps, warm-up included (0 for tables)
    estimate_s: float  # estimated seconds on one H200
    technique: str | None = None
    model: str | None = None
    module: str | None = None  # a study whose run_reference writes tables
    needs_cuda: bool = False


def step_seconds(config: RunConfig, phase: str) -> float:
    """Estimated H200 seconds of one step of ``config`` in ``phase``, the loader included."""
    compute = TRAIN_STEP_S[config.model] * config.images_per_step / 128 * config.width ** 2
    compute *= (AMP_FACTOR if config.amp_dtype != "none" else 1) * (EVAL_FACTOR if phase == "test" else 1)
    compute = max(compute, MIN_STEP_S)
    if config.data_on_device:
        return compute
    loading = config.images_per_step * IMAGE_S[phase]
    return compute + loading if config.num_workers == 0 else max(compute, loading / config.num_workers)


def estimate(experiment: Experiment, configs: dict[str, RunConfig], profile: Profile) -> tuple[int, float]:
    """Steps and estimated H200 seconds of one model's run of ``experiment``: every variant, repeat and phase."""
    repeats = profile.warmup_repeats + profile.repeats
    steps, seconds = 0, PART_SETUP_S
    for config in configs.values():
        seconds += VARIANT_SETUP_S + (FRESH_PROCESS_S if experiment.isolate_variants else 0)
        for phase in experiment.phases:
            timed = profile.steps if phase == "train" else profile.test_steps
            epoch = EPOCH_IMAGES[phase] // config.images_per_step
            per_repeat = profile.warmup_steps + (epoch if timed is None else timed)
            startups = 1 if config.persistent_workers else repeats
            if config.num_workers == 0 or config.data_on_device:
                startups = 0
            steps += per_repeat * repeats
            seconds += per_repeat * repeats * step_seconds(config, phase) + startups * WORKER_STARTUP_S
            if config.compile_mode != "none":
                seconds += COMPILE_S[phase] * COMPILE_FACTOR[config.compile_mode]
    return steps, seconds


def set_names(set_name: str) -> tuple[str, ...]:
    """The sets ``set_name`` stands for, in priority order (an unknown name is an OptlabError)."""
    technique_set(set_name)
    return PRIORITY if set_name == "all" else (set_name,)


def plan(set_name: str, profile: Profile) -> list[Part]:
    """Every part of ``set_name`` (``all``: of every set) in priority order, with steps and H200 estimates."""
    parts = []
    for name in set_names(set_name):
        order = TECHNIQUE_ORDER.get(name, ())
        techniques = sorted(technique_set(name), key=lambda t: order.index(t) if t in order else len(order))
        for technique in techniques:
            experiment = get_experiment(technique)
            for model in experiment.default_models(profile):
                steps, seconds = estimate(experiment, experiment.configs(model, profile), profile)
                parts.append(Part(name, f"{technique} {model}", steps, seconds, technique=technique, model=model,
                                  needs_cuda=experiment.needs_cuda))
        parts += [Part(name, f"{module} tables", 0, TABLE_S[module], module=module, needs_cuda=True)
                  for module in EXTRAS[name]]
    return parts


def run_key(info: DeviceInfo) -> dict[str, str]:
    """What a recorded part must share with this run to be skipped: the machine, torch version and commit."""
    return {"device_name": info.name, "torch": torch.__version__, "git_commit": git_commit()}


def _manifest(folder: Path) -> pd.DataFrame:
    path = folder / f"{MANIFEST}.csv"
    return pd.read_csv(path, dtype=str) if path.is_file() else pd.DataFrame(columns=["part"])


def recorded(parts: list[Part], folder: Path, key: dict[str, str], profile: Profile) -> set[str]:
    """The names of ``parts`` already recorded under ``folder`` for ``key``: a technique's model in its record (made
    with ``profile``), a study's tables in the manifest with status ok (tables have sizes of their own)."""
    done = set()
    manifest = _manifest(folder)
    records = {part.technique: store.resumable(folder / f"{part.technique}.json", key, profile)
               for part in parts if part.technique}
    for part in parts:
        if part.technique:
            record = records[part.technique]
            if record and part.model in {row["model"] for row in record["samples"]}:
                done.add(part.name)
        elif not manifest.empty:
            rows = manifest[(manifest["part"] == part.name) & (manifest["status"] == "ok")]
            if any(all(row[k] == v for k, v in key.items()) for _, row in rows.iterrows()):
                done.add(part.name)
    return done


def _note_part(folder: Path, part: Part, key: dict[str, str], profile: Profile, status: str, seconds: float) -> None:
    row = {"part": part.name, "set": part.set_name, "status": status, "seconds": round(seconds, 1),
           "estimate_s": round(part.estimate_s, 1), **key, "profile": profile.name,
           "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    manifest = _manifest(folder)
    manifest = manifest[manifest["part"] != part.name] if not manifest.empty else None
    store.save_table(pd.concat([manifest, pd.DataFrame([row])], ignore_index=True), folder, MANIFEST)


def plan_table(parts: list[Part], done: set[str], budget_s: float | None, cuda: bool) -> pd.DataFrame:
    """The plan as a table: each part's set, steps, estimate, and what this command would do with it."""
    rows, spent, stopped = [], 0.0, False
    for part in parts:
        if part.name in done:
            action = "recorded: skip"
        elif part.needs_cuda and not cuda:
            action = "needs CUDA: skip"
        elif stopped or (budget_s is not None and spent + part.estimate_s > budget_s):
            action, stopped = "left: over budget", True
        else:
            action, spent = "run", spent + part.estimate_s
        rows.append({"set": part.set_name, "part": part.name, "steps": part.steps,
                     "est_h200_s": round(part.estimate_s, 1), "this run": action})
    return pd.DataFrame(rows)


def reference_profile(profile: str | Profile | None, cuda: bool, repeats: int | None) -> Profile:
    """The run's profile (``auto``: quick on CUDA), with ``repeats`` instead of its own if given."""
    prof = get_profile(profile, cuda)
    return prof if repeats is None else prof.with_sizes(repeats=repeats)


def describe_plan(set_name: str = "all", profile: str | Profile | None = None, device: str = "auto",
                  out: str | Path | None = None, budget_s: float | None = None, repeats: int | None = None) -> str:
    """The plan of ``set_name`` as printed text: every part, then each set's total in minutes."""
    info = resolve_device(device)
    prof = reference_profile(profile, True, repeats)  # the reference's profile on a GPU: quick, unless one is named
    parts = plan(set_name, prof)
    done = recorded(parts, Path(out), run_key(info), prof) if out is not None and Path(out).is_dir() else set()
    table = plan_table(parts, done, budget_s, info.is_cuda)
    totals = table.groupby("set", sort=False)["est_h200_s"].agg(["count", "sum"])
    lines = [f"reference plan, profile {prof.name}, estimated seconds on one H200 (step times: "
             "optlab/commands/reference.py)", table.to_string(index=False), ""]
    lines += [f"set {name}: {int(row['count'])} parts, {row['sum'] / 60:.1f} min" for name, row in totals.iterrows()]
    lines.append(f"all listed: {table['est_h200_s'].sum() / 60:.1f} min; the command would run "
                 f"{table['est_h200_s'][table['this run'] == 'run'].sum() / 60:.1f} min of it"
                 + (f" within --budget {budget_s:g} s" if budget_s is not None else ""))
    lines += [f"warning: {part.name} may need more than {PART_LIMIT_S} s" for part in parts
              if part.estimate_s > PART_LIMIT_S]
    return "\n".join(lines)


def _run_part(part: Part, folder: Path, prof: Profile, device: str, progress: bool,
              download: bool) -> ExperimentResult | None:
    if part.module:
        for path in importlib.import_module(f"optlab.studies.{part.module}").run_reference(folder, device):
            print(f"wrote {store.display_path(path)}")
        return None
    return run_experiment(part.technique, models=[part.model], profile=prof, device=device, out=folder,
                          progress=progress, download=download, filename=f"{part.technique}.json", resume=True)


def run_reference(out: str | Path, set_name: str = "seed", profile: str | Profile | None = None,
                  device: str = "auto", progress: bool = True, download: bool = False, budget_s: float | None = None,
                  repeats: int | None = None) -> Iterator[ExperimentResult]:
    """Run every part of the set not yet recorded under ``out``, in priority order; with ``budget_s``, stop before
    the first part whose estimate would not fit in what is left. Yields each technique part's result.

    A part that fails, an OptlabError included, is reported and the run goes on; the end names every part that
    failed or was left.
    """
    started = time.monotonic()
    if budget_s is not None and not budget_s > 0:
        raise OptlabError(f"--budget must be a positive number of seconds, got {budget_s:g}")
    info = resolve_device(device)
    prof = reference_profile(profile, info.is_cuda, repeats)
    parts = plan(set_name, prof)
    folder = store.writable_dir(out)
    key = run_key(info)
    done = recorded(parts, folder, key, prof)
    failures, left, skipped = [], [], []
    for index, part in enumerate(parts):
        if part.name in done:
            skipped.append(part.name)
            continue
        if part.needs_cuda and not info.is_cuda:
            print(f"skip {part.name}: needs CUDA, this run is on {info.name}")
            continue
        elapsed = time.monotonic() - started
        if budget_s is not None and elapsed + part.estimate_s > budget_s:
            left = [p for p in parts[index:] if p.name not in done and (info.is_cuda or not p.needs_cuda)]
            break
        print(f"part {part.name} ({part.set_name}; about {part.estimate_s:.0f} s on an H200)")
        part_start = time.monotonic()
        try:
            result = _run_part(part, folder, prof, device, progress, download)
            status = "ok"
        except Exception as error:  # noqa: BLE001  (an OptlabError too: this part failed, the others go on)
            result, status = None, f"failed: {type(error).__name__}: {error}".splitlines()[0][:200]
            failures.append(part.name)
            traceback.print_exc()
        _note_part(folder, part, key, prof, status, time.monotonic() - part_start)
        if result is not None:
            yield result
    print(f"reference: {time.monotonic() - started:.0f} s; skipped {len(skipped)} part(s) already recorded under "
          f"{store.display_path(folder)}")
    if left:
        print(f"left for a later run (over --budget {budget_s:g} s): {', '.join(p.name for p in left)} "
              f"(about {sum(p.estimate_s for p in left) / 60:.1f} min on an H200)")
    if failures:
        raise OptlabError(f"these parts failed and have no new results: {', '.join(failures)}")
