"""A technique under DistributedDataParallel: every rank times the core's training phase on its shard, rank 0 gathers
the step times and alone writes the record.

Variants that accumulate gradients are also run without ``no_sync`` (label + ``SYNC_SUFFIX``), so the chapter can
show what skipping the all-reduce on micro-steps saves.
"""
from __future__ import annotations

import contextlib
import platform
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from ...core.cifar import data
from ...core.measuring import loops
from ...core.results import store
from ...core.knobs.config import RunConfig, apply_changes
from ...core.machine.device import DeviceInfo, effective_config
from ...core.machine.environment import capture
from ...core.errors import OptlabError
from ...core.run.experiments import ExperimentResult
from ...core.stats.sequential import visit_order
from ...core.measuring.memory import memory_kind
from ...core.cifar.models import build_model, validate_names
from ...core.knobs.profiles import Profile, get_profile
from ...core.techniques.registry import PHASES, Experiment, get_experiment
from ...core.measuring.samples import sample_row
from ...core.stats.summary import summarize_runs
from .group import Group, barrier, explain_timeouts, gather, process_group, timeout_s

SYNC_SUFFIX = ", all-reduce every micro-step"  # the label of an accumulating variant run without no_sync


def distributed_loader(dataset: Dataset, config: RunConfig, train: bool, seed: int, rank: int, world_size: int) -> DataLoader:
    """``data.make_loader`` with a DistributedSampler: rank ``r`` reads its 1/world_size of every epoch.

    The sampler shuffles with ``seed`` plus the epoch (``set_epoch``) the same way on every rank, and pads the data set so
    that every rank gets as many batches as the others.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=train, seed=seed)
    return data.make_loader(dataset, config, train, seed, sampler=sampler)


def wrap(model: nn.Module, info: DeviceInfo, process_group: Any = None) -> DDP:
    """DDP over ``model``: it broadcasts rank 0's weights now, and all-reduces gradients in buckets during backward."""
    return DDP(model, device_ids=[info.device.index] if info.is_cuda else None, process_group=process_group)


def sync_context(model: DDP, config: RunConfig, micro_step: int, no_sync: bool = True) -> contextlib.AbstractContextManager:
    """``model.no_sync()`` on a micro-step that does not step the optimizer: its gradients only accumulate locally."""
    boundary = (micro_step + 1) % config.accumulation_steps == 0
    return model.no_sync() if no_sync and not boundary else contextlib.nullcontext()


def ddp_step(model: DDP, batch, optimizer, scaler, config: RunConfig, device: torch.device, micro_step: int,
             no_sync: bool = True) -> torch.Tensor:
    """``loops.train_step`` on the DDP model, inside ``no_sync`` where the gradients need no all-reduce yet."""
    with sync_context(model, config, micro_step, no_sync):
        return loops.train_step(model, batch, optimizer, scaler, config, device, micro_step)


def _slowest(per_rank: Sequence[list[float]]) -> list[float]:
    """Step times of the job: its step ``k`` ends when the slowest rank has ended its step ``k``."""
    if not per_rank[0]:
        return []
    ends = np.max([np.cumsum(times) for times in per_rank], axis=0)
    return np.diff(ends, prepend=0.0).tolist()


def merge_ranks(results: Sequence[loops.PhaseResult]) -> loops.PhaseResult:
    """The job's phase from every rank's: warm-up and timed steps end with the slowest rank.

    Ranks start each phase together (a barrier). Losses are averaged over ranks (each is its shard's mean, so the mean
    is the whole batch's loss); correct predictions, predictions and samples are summed.
    """
    losses = np.mean([r.losses for r in results], axis=0).tolist() if results[0].losses else []
    warmup = _slowest([r.warmup_times_s for r in results])
    caches = sorted({r.inductor_cache for r in results if r.inductor_cache})
    return loops.PhaseResult(
        startup_s=max(r.startup_s for r in results),
        step_times_s=_slowest([[*r.warmup_times_s, *r.step_times_s] for r in results])[len(warmup):],
        wall_s=max(r.wall_s for r in results),
        peak_mem_mb=max(r.peak_mem_mb for r in results),
        warmup_times_s=warmup,
        losses=losses,
        correct=sum(r.correct for r in results),
        predictions=sum(r.predictions for r in results),
        samples=sum(r.samples for r in results),
        graphs_compiled=max(r.graphs_compiled for r in results),
        inductor_cache=caches[0] if len(caches) == 1 else "mixed" if caches else None,
        resident_mem_mb=max(r.resident_mem_mb for r in results),
        cudagraph_skips=max(r.cudagraph_skips for r in results),
        graph_pool_mb=max(r.graph_pool_mb for r in results),
    )


def rank_columns(results: Sequence[loops.PhaseResult]) -> dict[str, list]:
    """Every rank's own numbers, in rank order, for the job's row: step times, memory and graph counts."""
    return {"rank_warmup_times_s": [r.warmup_times_s for r in results],
            "rank_step_times_s": [r.step_times_s for r in results],
            "rank_peak_mem_mb": [r.peak_mem_mb for r in results],
            "rank_resident_mem_mb": [r.resident_mem_mb for r in results],
            "rank_graphs_compiled": [r.graphs_compiled for r in results],
            "rank_cudagraph_skips": [r.cudagraph_skips for r in results]}


def visits(labels: list[str], repeats: int) -> Iterator[tuple[int, str]]:
    """(repeat, variant) in the order a DDP run visits them: each repeat in :func:`visit_order`, the rotation every
    other run uses."""
    for repeat in range(repeats):
        for label in visit_order(labels, repeat):
            yield repeat, label


def job_config(config: RunConfig, world_size: int) -> RunConfig:
    """The whole job as one config: every rank's micro-batch together (the global batch)."""
    return replace(config, batch_size=config.batch_size * world_size, batch_offset=config.batch_offset * world_size)


@dataclass
class _State:
    config: RunConfig
    model: DDP
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loaders: dict[str, DataLoader]
    no_sync: bool


def _build_state(config: RunConfig, group: Group, sets: dict[str, Dataset], seed: int, no_sync: bool) -> _State:
    torch.manual_seed(seed)
    model = wrap(loops.prepare_model(build_model(config.model, config.model_variant, config.width), config,
                                     group.info.device), group.info, group.collectives)
    loaders = {phase: distributed_loader(sets[phase], config, phase == "train", seed, group.rank, group.world_size)
               for phase in PHASES}
    return _State(config, model, loops.make_optimizer(model, config), loops.make_scaler(config, group.info.device),
                  loaders, no_sync)


def _run_phase(state: _State, phase: str, profile: Profile, device: torch.device, epoch: int) -> loops.PhaseResult:
    loader = state.loaders[phase]
    loader.sampler.set_epoch(epoch)
    if phase == "train":
        model, config, no_sync = state.model, state.config, state.no_sync
        return loops.train_phase(model, loader, state.optimizer, state.scaler, config, device, profile.steps,
                                 profile.warmup_steps, lambda step: sync_context(model, config, step, no_sync))
    # inference needs no gradients to average: each rank runs the plain module on its shard
    return loops.eval_phase(state.model.module, loader, state.config, device, profile.test_steps, profile.warmup_steps)


def ddp_variants(experiment: Experiment) -> Experiment:
    """The experiment under DDP: every variant that accumulates is also run without ``no_sync`` (label + SYNC_SUFFIX)."""
    variants = list(experiment.variants)
    for label, changes in experiment.variants:
        probe = apply_changes(RunConfig(), {**experiment.base, **changes})
        if probe.accumulation_steps > 1:
            variants.append((label + SYNC_SUFFIX, changes))
    return experiment.with_variants(*variants)


def _datasets(source: data.DataSource, download: bool, group: Group) -> dict[str, Dataset]:
    """The data sets. With ``download``, each node's local rank 0 fetches them while the other ranks wait."""
    fetch = download and group.local_rank == 0
    if download and not fetch:
        dist.barrier()
    train_set, test_set = data.datasets(source, fetch)
    if fetch:
        dist.barrier()
    return {"train": train_set, "test": test_set}


def _check_same_data(source: data.DataSource, group: Group) -> list[str]:
    """Every rank's host name; raises on every rank alike if the ranks found different data."""
    seen = gather((platform.node(), source.kind), group, at_start=True)
    kinds = sorted({kind for _, kind in seen})
    if len(kinds) > 1:
        raise OptlabError(f"the ranks found different data ({', '.join(kinds)}); put CIFAR-10 under $OPTLAB_DATA "
                          "on every node, or on none")
    return sorted({host for host, _ in seen})


def run_distributed(
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
    parity: Callable[[Group], dict[str, Any]] | None = None,
) -> ExperimentResult | None:
    """``run_experiment`` on every rank of a torchrun job; rank 0 returns the result and writes it, the others return None.

    ``overrides`` are per process (``batch_size`` is each rank's micro-batch); the record's samples describe the job
    (the global batch, the job's step times) and keep every rank's raw step times. Data parallelism changes the
    training step, so a technique with a training phase times that phase only. ``parity``: a check to run on every
    rank once the job is joined and before timing (:func:`optlab.studies.distributed.parity.check_for_run`, the
    check of ``make ddp-check``); what it returns on rank 0 is kept in the record under ``distributed.parity``: a run
    that proves its own ranks train like one process, without a launch of its own.
    """
    experiment = ddp_variants(get_experiment(experiment))
    if "train" in experiment.phases:
        experiment = experiment.for_phases("train")
    with process_group(device) as group, explain_timeouts(group):
        return _run(experiment, group, models, profile, overrides, out, seed, progress, download, filename, parity)


def _run(experiment: Experiment, group: Group, models, profile, overrides, out, seed, progress, download,
         filename, parity: Callable[[Group], dict[str, Any]] | None = None) -> ExperimentResult | None:
    info, main = group.info, group.is_main
    if experiment.needs_cuda and not info.is_cuda:
        raise OptlabError(f"{experiment.name} needs a CUDA device and this run is on {info.name} (cpu)")
    prof = get_profile(profile, info.is_cuda)
    chosen = validate_names(models or prof.models)
    requested = {m: experiment.configs(m, prof, overrides) for m in chosen}
    resident = sorted({label for cfgs in requested.values() for label, c in cfgs.items() if c.data_on_device})
    if resident:
        raise OptlabError(f"--distributed shards the data with a DistributedSampler, and variant(s) {resident} keep the "
                          f"whole data set on the device (data_on_device); run {experiment.name} without --distributed")
    effective = {m: {label: effective_config(c, info) for label, c in cfgs.items()} for m, cfgs in requested.items()}
    out_dir = store.writable_dir(out) if out is not None and main else None
    source = data.find_source(download)
    hosts = _check_same_data(source, group)
    notes = sorted({note for cfgs in effective.values() for _, ns in cfgs.values() for note in ns})
    if main:
        print(f"optlab {experiment.name}: {prof.describe()} (per process)")
        print(f"device: {info.describe()}")
        print(group.describe())
        print(f"data source: {source.description}")
        for note in notes:
            print(f"note: {note}")
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    checked = parity(group) if parity is not None else None
    sets = _datasets(source, download, group)
    environment = capture(info, source.description, prof.name)

    rows: list[dict[str, Any]] = []
    total = len(chosen) * (prof.warmup_repeats + prof.repeats) * len(experiment.labels) * len(experiment.phases)
    bar = tqdm(total=total, desc=experiment.name, disable=not (progress and main), file=sys.stderr, leave=False)
    for model_name in chosen:
        states = {label: _build_state(config, group, sets, seed, no_sync=not label.endswith(SYNC_SUFFIX))
                  for label, (config, _) in effective[model_name].items()}
        for repeat, label in visits(list(states), prof.warmup_repeats + prof.repeats):
            state = states[label]
            for phase in experiment.phases:
                bar.update()
                torch.manual_seed((seed + 1 + repeat) * group.world_size + group.rank)  # each rank its own augmentation
                barrier(group)
                per_rank = gather(_run_phase(state, phase, prof, info.device, repeat), group)
                if main and repeat >= prof.warmup_repeats:
                    rows.append(_row(experiment, model_name, label, repeat - prof.warmup_repeats, phase, state,
                                     per_rank, len(sets[phase]), group))
        del states
    bar.close()
    if not main:
        return None

    samples = pd.DataFrame(rows)
    summary = summarize_runs(samples, experiment.baseline_label, experiment.control_phases)
    record = store.make_record(
        experiment=experiment, profile=prof, environment=environment,
        configs={m: {label: c.to_dict() for label, c in cfgs.items()} for m, cfgs in requested.items()},
        effective={m: {label: c.to_dict() for label, (c, _) in cfgs.items()} for m, cfgs in effective.items()},
        notes=notes, memory_kind=memory_kind(info.device), samples=samples, summary=summary,
    )
    record["distributed"] = {
        "world_size": group.world_size, "nnodes": group.nnodes, "nproc_per_node": group.local_world_size,
        "backend": group.backend, "hosts": hosts, "torch_threads_per_process": torch.get_num_threads(),
        "sync_every_micro_step": [label for label in experiment.labels if label.endswith(SYNC_SUFFIX)],
        "timeout_s": timeout_s(), "parity": checked,
        "step_times": "configs are per process; samples describe the job: the global batch, and step k ends when "
                      "the slowest rank ends it; rank_warmup_times_s and rank_step_times_s keep every rank's own",
    }
    path = store.save_record(record, out_dir, filename) if out_dir is not None else None
    if path is not None:
        print(f"wrote {store.display_path(path)}")
    return ExperimentResult(experiment, samples, summary, record, path)


def _row(experiment: Experiment, model: str, label: str, repeat: int, phase: str, state: _State,
         per_rank: list[loops.PhaseResult], epoch_images: int, group: Group) -> dict[str, Any]:
    job = job_config(state.config, group.world_size)
    row = sample_row(experiment.name, model, label, repeat, phase, job, merge_ranks(per_rank), epoch_images)
    return {**row, "world_size": group.world_size, "backend": group.backend, **rank_columns(per_rank)}
