"""Running an experiment: its variants interleaved on every model of a profile, timed, summarised and stored.

The variants take turns within each round, in mirrored pairs of rounds (A B, then B A; see ``sequential``), so
that drift hits every variant alike and no variant always runs in the same slot. ``run_experiment`` returns a tidy
DataFrame (one row per model, variant, repeat and phase), a summary table and the stored record; the record is
rewritten after each model, so a run killed midway keeps every model it finished, and ``resume=True`` runs only the
models that a record under ``out`` from the same machine, torch version, commit and profile does not have yet.

An experiment with ``isolate_variants`` runs each variant in a fresh process of its own (on every device: one code
path, which the CPU tests cover as the GPU runs it); the variants still take turns, repeat after repeat. Where only one
variant is timed (the others have no effect on the device), it runs in this process: there is no other to keep apart.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import math
import multiprocessing
import os
import signal
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd
import torch
from tqdm import tqdm

from ..machine import compiler, machine_load
from ..process import quiet, shutdown
from ..results import store
from ..knobs.config import RunConfig
from ..machine.device import DeviceInfo, effective_config, resolve_device
from ..machine.environment import capture
from ..errors import OptlabError
from ..measuring.flops import forward_flops_of
from ..knobs.limits import check_overrides, check_phase_sizes
from ..measuring.loops import Pass, PhaseResult, backend_flags, drive, eval_pass, train_pass
from ..measuring.memory import is_out_of_memory, memory_kind
from ..techniques.no_effect import no_effect_variants
from ..knobs.profiles import Profile, chosen_sizes, get_profile
from .progress import finish, progress_bar
from ..techniques.registry import Experiment, get_experiment
from ..measuring.samples import failed_row, sample_row
from ..stats.sequential import OUT_OF_REACH, StoppingRule, visit_order
from ..stats.summary import LOOK_CONFIDENCE, LOOK_ROUNDS, summarize_runs
from ..measuring.timing import BAD_TIME, EARLY_STOP_BIAS, INTERVAL
from .variants import VariantState, build_state
from ..workload import DataSource, Workload, get_workload

LOADER_WARNING = "This DataLoader will create"  # more workers than CPUs: the run's notes say it once


@dataclass
class ExperimentResult:
    """What a run returns: the tidy samples, the summary, the stored record and where it was written."""

    experiment: Experiment
    samples: pd.DataFrame
    summary: pd.DataFrame
    record: dict[str, Any]
    path: Path | None = None


@functools.lru_cache(maxsize=2)
def cached_datasets(workload: Workload, source: DataSource, download: bool = False) -> tuple:
    """The workload's train and test data sets, built once per process (a reference run calls many experiments)."""
    return workload.datasets(source, download)


def phase_pass(state: VariantState, phase: str, profile: Profile, info: DeviceInfo) -> Pass[PhaseResult]:
    """One timed pass of ``phase`` with the variant's own loader and the profile's step counts (``lockstep_steps``
    timed steps where its rounds run in lockstep); it yields after each step."""
    known = state.step_increase_mb.get(phase)  # the CPU memory figure: profiled on the variant's first pass only
    loss_fn = get_workload(state.config.workload).loss
    if phase == "train":
        result = yield from train_pass(state.model, state.loaders["train"], state.optimizer, state.scaler,
                                       state.config, info.device, profile.steps, profile.warmup_steps,
                                       loss_fn=loss_fn, step_increase_mb=known)
    else:
        result = yield from eval_pass(state.model, state.loaders["test"], state.config, info.device,
                                      profile.test_steps, profile.warmup_steps, step_increase_mb=known,
                                      loss_fn=loss_fn)
    state.step_increase_mb[phase] = result.step_increase_mb
    return result


def failure_status(error: BaseException) -> str:
    """``out of memory`` (:func:`memory.is_out_of_memory`), or ``failed: <the error's first line>``, for a variant
    that raised."""
    if is_out_of_memory(error):
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
    resume: bool = False,
    deadline: float | None = None,
) -> ExperimentResult:
    """Run ``experiment`` on every model, interleaving its variants; save the record under ``out`` if given.

    A variant that raises (out of memory, or any other error) is recorded with its status and left out of the
    later repeats; the other variants go on. ``resume``: keep the models already in ``out/filename`` when it comes
    from this machine, torch version, commit and profile, and run only the others. ``deadline`` (on
    ``optlab.core.process.shutdown.now()``'s clock): no round starts that would end past it.
    """
    experiment = get_experiment(experiment)
    info = resolve_device(device)
    if experiment.needs_cuda and not info.is_cuda:
        raise OptlabError(f"{experiment.name} needs a CUDA device and this run is on {info.name} (cpu); "
                          "its chapter shows the stored GPU reference instead")
    prof = get_profile(profile, info.is_cuda)
    workload = get_workload(experiment.workload)
    chosen = workload.validate_models(models or experiment.default_models(prof))
    check_overrides(overrides or {}, workload)
    requested = {m: experiment.configs(m, prof, overrides) for m in chosen}
    effective = {m: {label: effective_config(c, info) for label, c in cfgs.items()} for m, cfgs in requested.items()}
    check_phase_sizes([c for cfgs in effective.values() for c, _ in cfgs.values()], experiment.phases,
                      prof.warmup_steps, {"train": prof.steps, "test": prof.test_steps},
                      workload.sizes(), workload.sample_name)
    compiler.require_compiler([c for cfgs in effective.values() for c, _ in cfgs.values()], info)
    out_dir = store.writable_dir(out) if out is not None else None
    filename = filename or store.record_filename(experiment.name)
    source = workload.find_source(download)
    sizes = {**(workload.profile_knobs.get(prof.name) or {}), **chosen_sizes(), **(overrides or {})}  # typed wins
    print(f"optlab {experiment.name}: {prof.describe(chosen, sizes)}")
    threads = quiet.fix_threads(info.is_cuda)
    print(f"device: {info.describe()}; {threads} torch thread{'s' if threads != 1 else ''}")
    print(f"data source: {source.description}")
    notes = sorted({note for cfgs in effective.values() for _, ns in cfgs.values() for note in ns})
    for note in notes:
        print(f"note: {note}")
    untimed = {m: no_effect_variants(requested[m], effective[m], experiment.comparisons) for m in chosen}
    for label, status in {label: s for skipped in untimed.values() for label, s in skipped.items()}.items():
        print(f"not timed: {label}: {status}")
    warnings.filterwarnings("ignore", message=LOADER_WARNING)
    datasets = cached_datasets(workload, source, download)
    environment = capture(info, source.description, prof.name)
    previous = store.resumable(out_dir / filename, environment, prof) if resume and out_dir else None
    rows: list[dict[str, Any]] = list(previous["samples"]) if previous else []
    done = {row["model"] for row in rows}
    if done:
        print(f"resumed: {', '.join(sorted(done))} already in {store.display_path(out_dir / filename)}")

    def record_of(rows: list[dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
        samples = pd.DataFrame(rows)
        summary = summarize_runs(samples, experiment.baseline_label, experiment.control_phases, experiment.comparisons)
        old = previous or {"configs": {}, "effective_configs": {}, "notes": []}
        record = store.make_record(
            experiment=experiment, profile=prof, environment=environment,
            configs=old["configs"] | {m: {label: c.to_dict() for label, c in cfgs.items()}
                                      for m, cfgs in requested.items()},
            effective=old["effective_configs"] | {m: {label: c.to_dict() for label, (c, _) in cfgs.items()}
                                                  for m, cfgs in effective.items()},
            notes=sorted(set(old["notes"]) | set(notes)), memory_kind=memory_kind(info.device), samples=samples,
            summary=summary, rounds=old.get("rounds", {}) | rounds,
        )
        return samples, summary, record

    path = None
    to_run = [m for m in chosen if m not in done]
    rounds: dict[str, dict[str, Any]] = {}
    total = (sum(len(effective[m]) - len(untimed[m]) for m in to_run) * (prof.warmup_repeats + prof.max_repeats)
             * len(experiment.phases))  # every round to the cap: a run that stops early says so on the bar
    bar = progress_bar(total, experiment.name, progress)
    for model_name in to_run:
        before = machine_load.snapshot()
        ran = _run_model(experiment, model_name, effective[model_name], prof, info, datasets, source, download,
                         seed, bar, untimed[model_name], deadline)
        load = machine_load.between(before, machine_load.snapshot())
        rows += ran.rows
        rounds[model_name] = ran.record() | {"machine_load": load}
        print(f"{model_name}: {ran.describe()}")
        if (busy := machine_load.warning(load)) is not None:
            print(f"{model_name}: {busy}")
        if out_dir is not None:  # after every model: a run killed later keeps what it finished
            path = store.save_record(record_of(rows)[2], out_dir, filename)
    bar.close()
    if previous and path is None:  # every model was recorded already
        path = out_dir / filename

    samples, summary, record = record_of(rows)
    if path is not None and to_run:
        print(f"wrote {store.display_path(path)}")
    return ExperimentResult(experiment, samples, summary, record, path)


def run_variant_phase(state: VariantState, phase: str, profile: Profile, info: DeviceInfo,
                      phase_seed: int) -> PhaseResult:
    """One phase of one variant, seeded with ``phase_seed`` (the same augmentation and dropout for every variant)."""
    torch.manual_seed(phase_seed)
    return drive(variant_pass(state, phase, profile, info))


def variant_pass(state: VariantState, phase: str, profile: Profile, info: DeviceInfo) -> Pass[PhaseResult]:
    """:func:`phase_pass`; afterwards the gradients are dropped, so that the next variant's phase does not run beside
    them (the next training phase's warm-up creates them again)."""
    try:
        return (yield from phase_pass(state, phase, profile, info))
    finally:
        state.optimizer.zero_grad(set_to_none=True)


class LocalVariant:
    """A variant whose state lives in this process, beside the other variants'."""

    def __init__(self, config: RunConfig, info: DeviceInfo, datasets: tuple, seed: int) -> None:
        self.info, self.state = info, build_state(config, info, *datasets, seed)

    def run(self, phase: str, profile: Profile, phase_seed: int) -> PhaseResult:
        return run_variant_phase(self.state, phase, profile, self.info, phase_seed)

    def start(self, phase: str, profile: Profile) -> Pass[PhaseResult]:
        """The phase's pass, to be advanced a step at a time (a lockstep round; seeded by the caller)."""
        return variant_pass(self.state, phase, profile, self.info)

    def close(self) -> None:
        self.state = None


_WORKER: dict[str, Any] = {}  # inside an isolated variant's own process: its device and state


def _isolated_build(config: RunConfig, device: str, workload_module: str, source: DataSource, download: bool,
                    seed: int, threads: int) -> None:
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message=LOADER_WARNING)
    if workload_module:
        importlib.import_module(workload_module)  # registers the workload in this fresh process
    info = resolve_device(device)
    datasets = get_workload(config.workload).datasets(source, download)
    _WORKER.update(info=info, state=build_state(config, info, *datasets, seed))


def _isolated_phase(phase: str, profile: Profile, phase_seed: int) -> PhaseResult:
    return run_variant_phase(_WORKER["state"], phase, profile, _WORKER["info"], phase_seed)


class IsolatedVariant:
    """A variant in a fresh process of its own, kept for all its repeats: a new interpreter (spawned), so nothing
    that lives per process is shared with the other variants (cuDNN's plan cache, oneDNN's primitives, the caching
    allocator's pools, compiled code)."""

    def __init__(self, config: RunConfig, info: DeviceInfo, source: DataSource, download: bool,
                 seed: int) -> None:
        # Within a run that handles the ending signals, the process ignores them: the run ends it (close)
        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=shutdown.ignore_in_child if shutdown.active() else None)
        try:
            self.pid = self.pool.submit(os.getpid).result()
            self.pool.submit(_isolated_build, config, str(info.device), get_workload(config.workload).module, source,
                             download, seed, torch.get_num_threads()).result()
        except BaseException:
            self.close()
            raise

    def run(self, phase: str, profile: Profile, phase_seed: int) -> PhaseResult:
        return self.pool.submit(_isolated_phase, phase, profile, phase_seed).result()

    def close(self) -> None:
        """End the variant's process: at once where a signal is ending the run, else after its work."""
        if shutdown.received() and getattr(self, "pid", None):
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
            self.pool.shutdown(wait=False, cancel_futures=True)
            return
        self.pool.shutdown(cancel_futures=True)


PhaseRunner = Callable[[str, Profile, int], PhaseResult]  # (phase, profile, phase seed) -> the phase's samples
PassStarter = Callable[[str, Profile], Pass[PhaseResult]]  # (phase, profile) -> the phase's pass, a step at a time


@dataclass
class Rounds:
    """What :func:`interleave` did: the tidy rows, how many timed rounds it ran, why it stopped, and the looks it took
    (each look's rounds and level; the level the answers were read at)."""

    rows: list[dict[str, Any]]
    repeats: int
    stopped: str  # "every answer clear", "at the cap of N repeats", "at the time budget", "fixed number of repeats"
    looks: dict[str, Any] = field(default_factory=dict)
    lockstep_steps: int | None = None  # timed steps per variant of a lockstep round; None: a pass per variant
    left: dict[str, int] = field(default_factory=dict)  # variant -> rounds it ran before no open comparison needed it

    def record(self) -> dict[str, Any]:
        """What the record keeps of a model's rounds: how many, why they stopped, the looks, where comparisons were
        closed and variants left, the interval's name and what early stopping does to the estimate."""
        return {"repeats": self.repeats, "stopped": self.stopped, **self.looks, "left_after": self.left,
                "interval": INTERVAL, "early_stopping": EARLY_STOP_BIAS, "lockstep_steps": self.lockstep_steps}

    def describe(self) -> str:
        """One line: how many rounds, why they stopped, and which variants left early (their comparisons closed)."""
        line = f"{self.repeats} repeats, stopped {self.stopped}"
        if self.left:
            line += "; closed and left early: " + ", ".join(f"{label} after {rounds}"
                                                            for label, rounds in self.left.items())
        return line


def stopping_rule(prof: Profile, comparisons: dict[str, str], phases: Iterable[str],
                  deadline: float | None = None, controls: Iterable[str] = ()) -> StoppingRule:
    """The profile's rule for adding rounds, waiting for the ``comparisons`` (variant -> reference) in ``phases``
    (A/A control phases too, named in ``controls``: an answer there says whether the machine is calm enough to tell
    2 %)."""
    return StoppingRule(prof.repeats, prof.max_repeats, prof.time_budget_s, dict(comparisons), tuple(phases),
                        deadline=math.inf if deadline is None else deadline, controls=tuple(controls))


def bad_time(row: dict[str, Any]) -> str | None:
    """Why a finished phase's sample cannot be compared (a time that is NaN, infinite, zero or negative), or None."""
    seconds = row.get("epoch_equiv_s")
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return f"{BAD_TIME} (epoch time {seconds} s)"
    return None


def lockstep_ready(variants: dict[str, Any], configs: dict[str, RunConfig], prof: Profile, info: DeviceInfo) -> bool:
    """Whether a model's rounds can run in lockstep (:func:`lockstep_round`): the profile asks for it, on a CPU, with
    two or more variants in this process, none of which loads data in worker processes (they would go on loading
    while the other variants' steps run) or compiles, and all with the same backend flags."""
    timed = [configs[label] for label in variants]
    flags = {(c.cudnn_benchmark, c.cudnn_tf32, c.matmul_tf32) for c in timed}
    return (prof.lockstep_steps is not None and not info.is_cuda and len(timed) > 1 and len(flags) == 1
            and all(isinstance(variant, LocalVariant) for variant in variants.values())
            and all(c.num_workers == 0 and c.compile_mode == "none" for c in timed))


def lockstep_profile(prof: Profile, first_round: bool = True) -> Profile:
    """The profile a lockstep round runs: ``lockstep_steps`` timed steps in both phases, after the profile's warm-up
    steps in a model's first round only. The variants live on between rounds, so their one-off costs (the first
    step's allocations and kernel choices) are paid once, and a later pass loads its first batch in its first timed
    step, as every batch after it (:func:`loops.timed_pass`); only the gradients, dropped after every pass, come
    back in that step. A warm-up step in every round cost a quarter of a ResNet18 round and did not lower the noise
    (``benchmarks/noise.py --shapes 1+3 0+3``)."""
    warmup = prof.warmup_steps if first_round else 0
    return replace(prof, steps=prof.lockstep_steps, test_steps=prof.lockstep_steps, warmup_steps=warmup)


def lockstep_round(passes: dict[str, PassStarter], order: list[str], phase: str, prof: Profile,
                   flags: RunConfig, phase_seed: int) -> dict[str, "PhaseResult | Exception"]:
    """Every variant's pass of ``phase`` a step at a time: a step of each in ``order``, turn after turn (A B, A B,
    ...), so that the machine's drift reaches every variant alike and every step follows another variant's (the
    rounds' orders are mirrored, :func:`sequential.visit_order`, for the drift within a turn). Each pass keeps its own
    random stream, seeded with ``phase_seed`` (the same augmentation and dropout as a pass on its own), and the time
    between its steps is not counted (:meth:`timing.StepTimer.pause`). ``flags``: the backend flags every variant
    shares. Each variant's result, or the error its pass raised."""
    running, streams, outcomes = {}, {}, {}
    outer = torch.get_rng_state()
    for label in order:
        torch.manual_seed(phase_seed)
        streams[label] = torch.get_rng_state()
        try:
            running[label] = passes[label](phase, prof)
        except Exception as error:  # noqa: BLE001  (recorded by the caller, and the other variants go on)
            outcomes[label] = error
    torch.set_rng_state(outer)
    with backend_flags(flags):  # one setting for the whole round: the passes' own switches nest out of order
        while running:
            for label in list(running):
                outer = torch.get_rng_state()
                torch.set_rng_state(streams[label])
                try:
                    next(running[label])
                except StopIteration as done:
                    outcomes[label] = done.value
                    del running[label]
                except Exception as error:  # noqa: BLE001  (recorded by the caller, and the other variants go on)
                    outcomes[label] = error
                    del running[label]
                finally:
                    streams[label] = torch.get_rng_state()
                    torch.set_rng_state(outer)
    return outcomes


def interleave(runners: dict[str, PhaseRunner], configs: dict[str, RunConfig], phases: Iterable[str],
               prof: Profile, info: DeviceInfo, technique: str, model: str, epoch_images: dict[str, int], seed: int,
               bar: tqdm, rule: StoppingRule, flops: int | None = None,
               on_result: Callable[[str, int, PhaseResult], None] | None = None,
               passes: dict[str, PassStarter] | None = None) -> Rounds:
    """Rounds of every variant and phase, each round in :func:`sequential.visit_order` of the variants still
    running, until ``rule`` stops them: the tidy rows, each with its slot among the variants still running and the look
    its comparison is read at (its level, and the rounds it was closed at: :func:`answer_columns`). A variant that no
    open comparison waits for any more (:meth:`StoppingRule.needed`) leaves the later rounds. A variant that raises is
    recorded with :func:`failure_status`, and one whose time is not a positive number with :data:`timing.BAD_TIME`;
    either leaves the later rounds and the rule at once. ``on_result(label, repeat, result)`` sees every finished phase,
    warm-up repeats included. With ``passes`` (each variant's :meth:`LocalVariant.start`, where :func:`lockstep_ready`
    allows) the variants of a round run each phase in lockstep (:func:`lockstep_round`) with the profile's
    ``lockstep_steps``."""
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    gone: dict[str, int] = {}  # variant -> the rounds it had when no open comparison needed it any more
    phases = tuple(phases)
    rule.start()
    round_index, kept = 0, 0
    started_at = bar.n

    def record(label: str, slot: int, phase: str, outcome: "PhaseResult | Exception") -> None:
        if isinstance(outcome, Exception):
            failed[label] = failure_status(outcome)
            rows.append(failed_row(technique, model, label, max(kept, 0), phase, configs[label], failed[label])
                        | {"slot": slot})
            if info.is_cuda:
                torch.cuda.empty_cache()
            return
        if on_result is not None:
            on_result(label, round_index, outcome)
        if kept >= 0:
            row = sample_row(technique, model, label, kept, phase, configs[label], outcome, epoch_images[phase],
                             flops) | {"slot": slot}
            if (why := bad_time(row)) is not None:
                failed[label] = why
                row = failed_row(technique, model, label, kept, phase, configs[label], why) | {"slot": slot}
            rows.append(row)

    while True:
        shutdown.check()  # a signal whose raise a library swallowed ends the run here at the latest
        kept = round_index - prof.warmup_repeats
        started = time.perf_counter()
        order = visit_order([label for label in runners if label not in failed and label not in gone],
                            max(kept, 0))
        if passes:
            for phase in phases:
                left = [label for label in order if label not in failed]
                bar.update(len(order))
                if not left:
                    continue
                outcomes = lockstep_round(passes, left, phase, lockstep_profile(prof, round_index == 0),
                                          configs[left[0]], seed + 1 + round_index)
                for label in left:
                    record(label, order.index(label), phase, outcomes[label])
        else:
            for slot, label in enumerate(order):
                for phase in phases:
                    bar.update()
                    if label in failed:
                        continue
                    try:
                        outcome = runners[label](phase, prof, seed + 1 + round_index)  # the same augmentation for all
                    except Exception as error:  # noqa: BLE001  (recorded, and the other variants go on)
                        outcome = error
                    record(label, slot, phase, outcome)
        round_index += 1
        if kept < 0:
            continue
        rule.round_done(time.perf_counter() - started)
        looks = len(rule.looks)
        if rule.stop_after(kept + 1, rows) or len(failed) == len(runners):
            break
        if len(rule.looks) > looks:  # a look: the comparisons it closed may leave variants no one waits for
            needed = rule.needed(rows)
            leaving = [label for label in order if label not in failed and label not in needed]
            gone.update(dict.fromkeys(leaving, kept + 1))
            if leaving:
                rule.variants_left()
    repeats = kept + 1
    for row in rows:
        row.update(answer_columns(rule, model, row))
    why = stop_reason(rule, repeats, rows)
    finish(bar, len(runners) * len(phases) * (prof.warmup_repeats + prof.max_repeats), bar.n - started_at,
           f"{model}: {repeats} of {prof.max_repeats} rounds, {why}" if repeats < prof.max_repeats else None)
    return Rounds(rows, repeats, why, rule.record(), prof.lockstep_steps if passes else None, gone)


def answer_columns(rule: StoppingRule, model: str, row: dict[str, Any]) -> dict[str, Any]:
    """The look a sample's comparison (its variant against its reference, in its phase) is read at: the level and
    rounds of the look that closed it, else the last look's level over every round (rounds None), or, where the run
    stopped at its deadline, over the rounds that look read (the rounds after it were never looked at: reading them
    at a level already spent would be a look the error spending did not count)."""
    closed = rule.closed.get((model, row["phase"], row["variant"]))
    if closed is None:
        return {LOOK_CONFIDENCE: rule.confidence, LOOK_ROUNDS: rule.read_rounds if rule.past_deadline else None}
    return {LOOK_CONFIDENCE: closed.confidence, LOOK_ROUNDS: closed.repeats}


def stop_reason(rule: StoppingRule, repeats: int, rows: list[dict[str, Any]]) -> str:
    """Why the rounds stopped after ``repeats``, in words (variants that failed on the way say so too)."""
    failures = sorted({f"{row['variant']} {row['status']} in round {row['repeat'] + 1}" for row in rows
                       if row["status"] != "ok"})
    also = f" ({'; '.join(failures)}: left the rule)" if failures else ""
    if rule.past_deadline:
        return f"at the run's deadline{also}"
    if rule.max_repeats == rule.min_repeats:
        return f"fixed at {repeats} repeats{also}"
    if not rule.waits_for(rows):
        return f"no comparison to wait for{also}"
    if not rule.open_comparisons(rows):
        beyond = sum(closed.why == OUT_OF_REACH for closed in rule.closed.values())
        return f"every answer clear{also}" if not beyond else f"every comparison answered or out of reach{also}"
    if repeats >= rule.max_repeats:
        return f"at the cap of {rule.max_repeats} repeats{also}"
    return f"at the time budget of {rule.time_budget_s:g} s{also}"


def _run_model(experiment: Experiment, model_name: str, configs: dict, prof: Profile, info: DeviceInfo,
               datasets: tuple, source: DataSource, download: bool, seed: int, bar: tqdm,
               untimed: dict[str, str] | None = None, deadline: float | None = None) -> Rounds:
    """Every round of every variant and phase on one model; the variants' objects are freed at the end. The
    ``untimed`` variants (label -> status, :func:`no_effect.no_effect_variants`) get one row per phase saying why,
    and no time."""
    untimed = untimed or {}
    rows: list[dict[str, Any]] = [failed_row(experiment.name, model_name, label, 0, phase, configs[label][0], status)
                                  for label, status in untimed.items() for phase in experiment.phases]
    variants: dict[str, LocalVariant | IsolatedVariant] = {}
    epoch_images = {"train": len(datasets[0]), "test": len(datasets[1])}
    # A fresh process keeps one variant's per-process state from the others': with one variant timed there are none
    isolate = experiment.isolate_variants and len(configs) - len(untimed) > 1
    for label, (config, _) in configs.items():
        if label in untimed:
            continue
        try:
            variants[label] = (IsolatedVariant(config, info, source, download, seed) if isolate
                               else LocalVariant(config, info, datasets, seed))
        except Exception as error:  # noqa: BLE001  (recorded, and the other variants go on)
            rows += [failed_row(experiment.name, model_name, label, 0, phase, config, failure_status(error))
                     for phase in experiment.phases]
    for label in variants:  # counted before the rounds: a model's first count takes seconds the budget would pay
        forward_flops_of(configs[label][0])
    runners = {label: variant.run for label, variant in variants.items()}
    timed_configs = {label: config for label, (config, _) in configs.items()}
    passes = ({label: variant.start for label, variant in variants.items()}
              if lockstep_ready(variants, timed_configs, prof, info) else None)
    comparisons = {label: ref for label, ref in experiment.comparisons.items()
                   if label in configs and ref in configs and label not in untimed}
    try:
        ran = interleave(runners, timed_configs, experiment.phases, prof, info, experiment.name, model_name,
                         epoch_images, seed, bar, stopping_rule(prof, comparisons, experiment.phases, deadline,
                                                                  experiment.control_phases),
                         passes=passes)
    finally:  # on a signal too: an isolated variant's process ignores it and is ended here
        for variant in variants.values():
            variant.close()
    del variants
    gc.collect()
    if any(config.compile_mode != "none" for config, _ in configs.values()) and not isolate:
        torch._dynamo.reset()  # drop this model's compiled code: each model gets Dynamo's whole recompile limit
    if info.is_cuda:
        torch.cuda.empty_cache()
    return Rounds(rows + ran.rows, ran.repeats, ran.stopped, ran.looks, ran.lockstep_steps, ran.left)
