"""Data-parallel training under ``torchrun``: DistributedDataParallel, a DistributedSampler, timings gathered to rank 0.

Launch one process per device (``torchrun --nproc-per-node N -m optlab run TECHNIQUE --distributed``); NCCL joins
GPUs, gloo joins CPU processes. Every rank trains a replica on its own shard of the data; DDP averages the gradients
in buckets while backward runs. Rank 0 gathers every rank's step times and alone writes the record.
``python -m optlab.distributed parity`` checks that 2 processes train to the same weights as one process on the
concatenated batches.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from . import data, experiments, loops, store
from .config import RunConfig, apply_changes
from .device import DeviceInfo, effective_config, resolve_device
from .environment import capture
from .errors import OptlabError
from .experiments import Experiment, ExperimentResult, get_experiment
from .memory import memory_kind
from .models import build_model
from .profiles import Profile, get_profile
from .summary import summarize_runs

TIMEOUT_ENV = "OPTLAB_DDP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0  # how long a rank waits in a collective for the others before it raises
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SYNC_SUFFIX = ", all-reduce every micro-step"  # the label of an accumulating variant run without no_sync
PARITY_TOLERANCE = 1e-5
# stored GPU runs, one folder per machine; apart from results/reference, whose pages summarise single-process runs
STORED_DIR = store.REPO_ROOT / "results" / "distributed"


@dataclass(frozen=True)
class Group:
    """This process's place in the job: its ranks, the job's size, the backend and its own device."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    info: DeviceInfo

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    def describe(self) -> str:
        return (f"distributed: {self.world_size} process(es) on {self.nnodes} node(s), backend {self.backend}, "
                f"{torch.get_num_threads()} thread(s) per process")


def timeout_s() -> float:
    """Seconds a collective waits for the other ranks: ``$OPTLAB_DDP_TIMEOUT_S``, else 600."""
    text = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise OptlabError(f"{TIMEOUT_ENV} must be a number of seconds above 0, got {text!r}")
    return value


@contextlib.contextmanager
def process_group(device: str = "auto") -> Iterator[Group]:
    """Join the job torchrun started and leave it on exit: NCCL on CUDA, where each process takes the GPU of its
    LOCAL_RANK (whatever index ``device`` names), gloo on the CPU."""
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise OptlabError(f"a distributed run must be started by torchrun ({', '.join(missing)} not set); launch it as "
                          "torchrun --nproc-per-node N -m optlab run TECHNIQUE --distributed")
    local_rank = int(os.environ["LOCAL_RANK"])
    info = resolve_device(device)
    if info.is_cuda:
        info = resolve_device(f"cuda:{local_rank}")
        torch.cuda.set_device(info.device)
    backend = "nccl" if info.is_cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s()),
                            device_id=info.device if info.is_cuda else None)
    try:
        yield Group(dist.get_rank(), local_rank, dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"]),
                    backend, info)
    finally:
        dist.destroy_process_group()


TIMEOUT_WORDS = re.compile(r"timed out|timeout", re.IGNORECASE)


@contextlib.contextmanager
def explain_timeouts(group: Group) -> Iterator[None]:
    """Turn a collective's timeout into an error that names the setting and the likely cause."""
    try:
        yield
    except RuntimeError as error:  # gloo raises a RuntimeError (DistBackendError); NCCL's watchdog ends the process
        if not TIMEOUT_WORDS.search(str(error)):
            raise
        raise OptlabError(f"rank {group.rank} waited {timeout_s():g} s ({TIMEOUT_ENV}) for the other ranks in a "
                          f"collective and gave up: another rank died or hangs, and its own messages say why "
                          f"({str(error).splitlines()[0]})") from error


def gather(value: Any, group: Group) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    values: list[Any] = [None] * group.world_size
    dist.all_gather_object(values, value)
    return values


def distributed_loader(dataset: Dataset, config: RunConfig, train: bool, seed: int, rank: int, world_size: int) -> DataLoader:
    """``data.make_loader`` with a DistributedSampler: rank ``r`` reads its 1/world_size of every epoch.

    The sampler shuffles with ``seed`` plus the epoch (``set_epoch``) the same way on every rank, and pads the data set so
    that every rank gets as many batches as the others.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=train, seed=seed)
    return data.make_loader(dataset, config, train, seed, sampler=sampler)


def wrap(model: nn.Module, info: DeviceInfo) -> DDP:
    """DDP over ``model``: it broadcasts rank 0's weights now, and all-reduces gradients in buckets during backward."""
    return DDP(model, device_ids=[info.device.index] if info.is_cuda else None)


def sync_context(model: DDP, config: RunConfig, micro_step: int, no_sync: bool = True) -> contextlib.AbstractContextManager:
    """``model.no_sync()`` on a micro-step that does not step the optimizer: its gradients only accumulate locally."""
    boundary = (micro_step + 1) % config.accumulation_steps == 0
    return model.no_sync() if no_sync and not boundary else contextlib.nullcontext()


def ddp_step(model: DDP, batch, optimizer, scaler, config: RunConfig, device: torch.device, micro_step: int,
             no_sync: bool = True) -> torch.Tensor:
    """``loops.train_step`` on the DDP model, inside ``no_sync`` where the gradients need no all-reduce yet."""
    with sync_context(model, config, micro_step, no_sync):
        return loops.train_step(model, batch, optimizer, scaler, config, device, micro_step)


def train_phase(model: DDP, loader: DataLoader, optimizer, scaler, config: RunConfig, device: torch.device,
                steps: int | None, warmup: int, no_sync: bool = True) -> loops.PhaseResult:
    """``loops.train_phase`` with :func:`ddp_step` as the micro-step."""
    model.train()
    optimizer.zero_grad(set_to_none=config.set_to_none)
    step = lambda batch, i: ddp_step(model, batch, optimizer, scaler, config, device, i, no_sync)  # noqa: E731
    with loops.backend_flags(config):
        result, losses = loops._run_timed(step, loader, device, steps, warmup)
    result.losses = torch.stack(losses).float().cpu().tolist()
    result.images = len(losses) * config.images_per_step
    return result


def _slowest(per_rank: Sequence[list[float]]) -> list[float]:
    """Step times of the job: its step ``k`` ends when the slowest rank has ended its step ``k``."""
    if not per_rank[0]:
        return []
    ends = np.max([np.cumsum(times) for times in per_rank], axis=0)
    return np.diff(ends, prepend=0.0).tolist()


def merge_ranks(results: Sequence[loops.PhaseResult]) -> loops.PhaseResult:
    """The job's phase from every rank's: warm-up and timed steps end with the slowest rank.

    Ranks start each phase together (a barrier). Losses are averaged over ranks (each is its shard's mean, so the mean
    is the whole batch's loss); correct predictions and images are summed.
    """
    losses = np.mean([r.losses for r in results], axis=0).tolist() if results[0].losses else []
    warmup = _slowest([r.warmup_times_s for r in results])
    return loops.PhaseResult(
        startup_s=max(r.startup_s for r in results),
        step_times_s=_slowest([[*r.warmup_times_s, *r.step_times_s] for r in results])[len(warmup):],
        wall_s=max(r.wall_s for r in results),
        peak_mem_mb=max(r.peak_mem_mb for r in results),
        warmup_times_s=warmup,
        losses=losses,
        correct=sum(r.correct for r in results),
        images=sum(r.images for r in results),
    )


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
                                     group.info.device), group.info)
    loaders = {phase: distributed_loader(sets[phase], config, phase == "train", seed, group.rank, group.world_size)
               for phase in experiments.PHASES}
    return _State(config, model, loops.make_optimizer(model, config), loops.make_scaler(config, group.info.device),
                  loaders, no_sync)


def _run_phase(state: _State, phase: str, profile: Profile, device: torch.device, epoch: int) -> loops.PhaseResult:
    loader = state.loaders[phase]
    loader.sampler.set_epoch(epoch)
    if phase == "train":
        return train_phase(state.model, loader, state.optimizer, state.scaler, state.config, device, profile.steps,
                           profile.warmup_steps, state.no_sync)
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
    seen = gather((platform.node(), source.kind), group)
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
) -> ExperimentResult | None:
    """``run_experiment`` on every rank of a torchrun job; rank 0 returns the result and writes it, the others return None.

    ``overrides`` are per process (``batch_size`` is each rank's micro-batch); the record's samples describe the job
    (the global batch, the job's step times) and keep every rank's raw step times.
    """
    experiment = ddp_variants(get_experiment(experiment))
    with process_group(device) as group, explain_timeouts(group):
        return _run(experiment, group, models, profile, overrides, out, seed, progress, download, filename)


def _run(experiment: Experiment, group: Group, models, profile, overrides, out, seed, progress, download,
         filename) -> ExperimentResult | None:
    info, main = group.info, group.is_main
    if experiment.needs_cuda and not info.is_cuda:
        raise OptlabError(f"{experiment.name} needs a CUDA device and this run is on {info.name} (cpu)")
    prof = get_profile(profile, info.is_cuda)
    chosen = experiments._validate_models(models or prof.models)
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
    sets = _datasets(source, download, group)
    environment = capture(info, source.description, prof.name)

    rows: list[dict[str, Any]] = []
    total = len(chosen) * (prof.warmup_repeats + prof.repeats) * len(experiment.labels) * len(experiment.phases)
    bar = tqdm(total=total, desc=experiment.name, disable=not (progress and main), file=sys.stderr, leave=False)
    for model_name in chosen:
        states = {label: _build_state(config, group, sets, seed, no_sync=not label.endswith(SYNC_SUFFIX))
                  for label, (config, _) in effective[model_name].items()}
        for repeat in range(prof.warmup_repeats + prof.repeats):
            for label, state in states.items():
                for phase in experiment.phases:
                    bar.update()
                    torch.manual_seed((seed + 1 + repeat) * group.world_size + group.rank)  # each rank its own augmentation
                    dist.barrier()
                    per_rank = gather(_run_phase(state, phase, prof, info.device, repeat), group)
                    if main and repeat >= prof.warmup_repeats:
                        rows.append(_row(experiment, model_name, label, repeat - prof.warmup_repeats, phase, state,
                                         per_rank, len(sets[phase]), group))
        del states
    bar.close()
    if not main:
        return None

    samples = pd.DataFrame(rows)
    summary = summarize_runs(samples, experiment.baseline_label)
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
        "timeout_s": timeout_s(),
        "step_times": "configs are per process; samples describe the job: the global batch, and step k ends when "
                      "the slowest rank ends it; rank_warmup_times_s and rank_step_times_s keep every rank's own",
    }
    path = store.save_record(record, out_dir, filename) if out_dir is not None else None
    if path is not None:
        print(f"wrote {path}")
    return ExperimentResult(experiment, samples, summary, record, path)


def _row(experiment: Experiment, model: str, label: str, repeat: int, phase: str, state: _State,
         per_rank: list[loops.PhaseResult], epoch_images: int, group: Group) -> dict[str, Any]:
    job = SimpleNamespace(config=job_config(state.config, group.world_size))  # experiments._row reads only .config
    row = experiments._row(experiment, model, label, repeat, phase, job, merge_ranks(per_rank), epoch_images)
    return {**row, "world_size": group.world_size, "backend": group.backend,
            "rank_warmup_times_s": [r.warmup_times_s for r in per_rank],
            "rank_step_times_s": [r.step_times_s for r in per_rank]}


# --- launching torchrun from Python (notebooks, tests, the parity check) ---

def torchrun_command(args: Sequence[str], nproc: int) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N ARGS``: one node, a free rendezvous port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def launch(command: Sequence[str], timeout: float, threads: int | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` (a torchrun line) to the end and return its output; raise OptlabError if it fails or overruns.

    ``threads`` sets OMP_NUM_THREADS for every process. On a timeout the whole process group (torchrun and its
    workers) is killed.
    """
    environment = {**os.environ, **(env or {})}
    if threads is not None:
        environment["OMP_NUM_THREADS"] = str(threads)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise OptlabError(f"{' '.join(command[:8])} ... did not finish within {timeout:.0f} s and was stopped") from None
    if process.returncode != 0:
        raise OptlabError(f"{' '.join(command[:8])} ... failed with exit status {process.returncode}: "
                          + "; ".join(_failure_lines(stderr)))
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


FAILURE_LINE = re.compile(r"^(\[rank\d+\]: )?(optlab: error: .*|[\w.]*(Error|Exception)\b: .*)$")


def _failure_lines(stderr: str) -> list[str]:
    """The workers' error messages (not their tracebacks), each once; the last lines of stderr if none is found."""
    lines = stderr.strip().splitlines()
    found = [line for line in lines if FAILURE_LINE.match(line) and "ChildFailedError" not in line]
    return list(dict.fromkeys(found)) or lines[-10:]


def scaling(samples: pd.DataFrame, phase: str = "train") -> pd.DataFrame:
    """Throughput of each variant against the number of processes, and the efficiency against 1 process.

    efficiency = images/s with N processes / (N x images/s with 1 process): 1.0 is perfect scaling.
    """
    rows = samples[(samples["status"] == "ok") & (samples["phase"] == phase)]
    table = (rows.groupby(["machine", "model", "variant", "world_size"], sort=False)["images_per_s"].median()
             .rename("images/s").reset_index())
    single = table[table["world_size"] == 1].set_index(["machine", "model", "variant"])["images/s"]
    keys = list(zip(table["machine"], table["model"], table["variant"]))
    table["speed-up"] = [ips / single.get(key, np.nan) for ips, key in zip(table["images/s"], keys)]
    table["efficiency"] = table["speed-up"] / table["world_size"]
    return table.round({"images/s": 1, "speed-up": 2, "efficiency": 2})


def stored_samples(folder: str | Path = STORED_DIR) -> pd.DataFrame:
    """The samples of every distributed record stored under ``folder`` (an empty frame if there is none)."""
    if not Path(folder).is_dir():
        return pd.DataFrame()
    frames = [store.load_samples(path) for path in store.record_paths(folder) if "distributed" in store.load_record(path)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def ring_allreduce_s(nbytes: float, world_size: int, bytes_per_s: float) -> float:
    """Seconds a ring all-reduce of ``nbytes`` needs at ``bytes_per_s`` per link: each rank sends (and receives)
    2 (N-1)/N x ``nbytes``. Large messages only: the per-message latency is left out."""
    return 2 * (world_size - 1) / world_size * nbytes / bytes_per_s


# --- the parity check: 2 processes against 1 process on the concatenated batches ---

@dataclass(frozen=True)
class Parity:
    """DDP against one process: parameter differences, how far training moved the weights, gradient traffic."""

    world_size: int
    steps: int
    accumulation_steps: int
    difference: dict[str, float]  # per mode: max |DDP parameter - single-process parameter|
    rank_difference: float  # max difference between the ranks' own parameters (DDP keeps them identical)
    max_update: float  # max |parameter after - before|: the differences are small next to this
    allreduce_calls: dict[str, int]  # per mode: bucket all-reduces in the whole run
    allreduce_bytes: dict[str, int]

    @property
    def max_difference(self) -> float:
        return max(self.difference.values())

    def describe(self) -> str:
        modes = ", ".join(f"{d:.2e} ({mode})" for mode, d in self.difference.items())
        traffic = ", ".join(f"{mode}: {self.allreduce_calls[mode]} all-reduces, {self.allreduce_bytes[mode] / 2**20:.2f} MiB"
                            for mode in self.difference)
        return (f"max parameter difference: {self.max_difference:.3e}\n"
                f"  {self.world_size} processes vs 1 on the concatenated batches, {self.steps} optimizer steps of "
                f"{self.accumulation_steps} micro-steps: {modes}\n"
                f"  ranks differ by {self.rank_difference:.1e}; training moved parameters by up to {self.max_update:.2e}\n"
                f"  gradient traffic per rank: {traffic}")


MODES = {"no_sync": True, "all-reduce every micro-step": False}
PARITY_CONFIG = RunConfig(model="resnet18", width=0.125, batch_size=4, num_workers=0, pin_memory=False)


def _counting_hook(counter, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP's own all-reduce (mean over ranks, a ``dist.GradBucket`` at a time), counting calls and bytes."""
    counter["calls"] += 1
    counter["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _single_process(model: nn.Module, dataset: Dataset, config: RunConfig, steps: int, world_size: int) -> nn.Module:
    """The same training in one process: each micro-step's batch is every rank's batch, concatenated."""
    loaders = [distributed_loader(dataset, config, True, 0, rank, world_size) for rank in range(world_size)]
    optimizer, scaler = loops.make_optimizer(model, config), loops.make_scaler(config, torch.device("cpu"))
    for micro_step, batches in zip(range(steps * config.accumulation_steps), zip(*loaders)):
        batch = tuple(torch.cat(parts) for parts in zip(*batches))
        loops.train_step(model, batch, optimizer, scaler, config, torch.device("cpu"), micro_step)
    return model


def parity_rank(steps: int, accumulation_steps: int, out: Path) -> None:
    """One rank of the parity check (run under torchrun); rank 0 also trains the single-process reference."""
    config = replace(PARITY_CONFIG, accumulation_steps=accumulation_steps)
    # the test split with the test transform: no random augmentation, so every rank's batches are known exactly
    dataset = data.StandInCIFAR10(train=False, transform=data.test_transform())
    with process_group("cpu") as group:
        torch.manual_seed(0)
        # eval-mode BatchNorm normalises with its fixed running statistics: in train mode each rank would use its own
        # shard's statistics, which differ from the whole batch's, and the comparison would not be exact in principle
        initial = build_model(config.model, width=config.width).eval()
        finals, traffic = {}, {}
        for mode, no_sync in MODES.items():
            model = wrap(copy.deepcopy(initial), group.info)
            counter = {"calls": 0, "bytes": 0}
            model.register_comm_hook(counter, _counting_hook)
            loader = distributed_loader(dataset, config, True, 0, group.rank, group.world_size)
            optimizer, scaler = loops.make_optimizer(model, config), loops.make_scaler(config, group.info.device)
            for micro_step, batch in zip(range(steps * accumulation_steps), loader):
                ddp_step(model, batch, optimizer, scaler, config, group.info.device, micro_step, no_sync)
            finals[mode], traffic[mode] = _flat(model.module), counter
        per_rank = gather(finals["no_sync"], group)
        if group.is_main:
            reference = _flat(_single_process(copy.deepcopy(initial), dataset, config, steps, group.world_size))
            result = Parity(
                group.world_size, steps, accumulation_steps,
                difference={mode: float((final - reference).abs().max()) for mode, final in finals.items()},
                rank_difference=max(float((p - per_rank[0]).abs().max()) for p in per_rank),
                max_update=float((reference - _flat(initial)).abs().max()),
                allreduce_calls={mode: c["calls"] for mode, c in traffic.items()},
                allreduce_bytes={mode: c["bytes"] for mode, c in traffic.items()},
            )
            store.atomic_write_text(out, json.dumps(asdict(result)))


def parity(nproc: int = 2, steps: int = 3, accumulation_steps: int = 2, timeout: float = 300.0) -> Parity:
    """Launch the parity check on ``nproc`` CPU processes (gloo) and return what rank 0 measured."""
    for name, value, minimum in (("nproc", nproc, 2), ("steps", steps, 1), ("accumulation_steps", accumulation_steps, 1)):
        if value < minimum:
            raise OptlabError(f"parity check: {name} must be at least {minimum}, got {value}")
    with tempfile.TemporaryDirectory(prefix="optlab-parity-") as folder:
        out = Path(folder) / "parity.json"
        args = ["-m", "optlab.distributed", "parity-rank", "--steps", str(steps), "--accumulation-steps",
                str(accumulation_steps), "--out", str(out)]
        launch(torchrun_command(args, nproc), timeout, threads=1)
        return Parity(**json.loads(out.read_text()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m optlab.distributed", description="DDP checks.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("parity", help="2 CPU processes against 1 on the concatenated batches")
    check.add_argument("--nproc", type=int, default=2)
    rank = commands.add_parser("parity-rank", help="one rank of the parity check (started by torchrun)")
    rank.add_argument("--out", type=Path, required=True)
    for command in (check, rank):
        command.add_argument("--steps", type=int, default=3)
        command.add_argument("--accumulation-steps", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        if args.command == "parity-rank":
            parity_rank(args.steps, args.accumulation_steps, args.out)
            return 0
        result = parity(args.nproc, args.steps, args.accumulation_steps)
    except OptlabError as error:
        print(f"optlab: error: {error}", file=sys.stderr)
        return 2
    print(result.describe())
    if result.max_difference > PARITY_TOLERANCE:
        print(f"optlab: error: DDP and one process disagree beyond {PARITY_TOLERANCE:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
