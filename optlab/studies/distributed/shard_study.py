"""DDP against FSDP2 on the same global batch, measured on every rank of one torchrun job.

Every rank trains the same workload three ways (one process, DDP, FSDP2) and measures what it holds, the
collectives one step issues (from the profiler), the step time in paired rounds, the parity of two sharded ranks with
one process on the concatenated batch, and it saves the sharded model with ``torch.distributed.checkpoint``. Rank 0
writes ``study.json``; :func:`shard_study` launches the job and reads it back.
"""
from __future__ import annotations

import copy
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from ...core.results import store
from ...core.errors import OptlabError
from ...core.knobs.limits import check_count, cpu_cores
from ...core.stats.sequential import visit_order
from ...core.measuring.timing import speed_up
from .group import Group, barrier, gather, process_group
from .launch import launch, torchrun_command
from .shard_scaling import WORLD_SIZES, fake_rank_bytes, scaling_table
from .shard_checkpoint import PROBE_SEED, loaded_outputs, save_sharded
from .sharding import BF16_POLICY, TRANSFORMER, Workload, shard, state_bytes
from .training import wrap

SHARD_TOLERANCE = 1e-5  # max |FSDP2 parameter - one-process parameter| after the parity steps, fp32
# The parity steps use SGD with momentum. AdamW's first steps move every weight by about lr x sign(gradient), so a
# gradient within rounding of 0 (1e-9 here) can flip its sign between two summation orders and move by 2 lr: that
# would hide a real fault behind rounding. Memory and timing use AdamW, whose two moments are the state worth sharding.
MAX_ROUNDS, MAX_STEPS, MAX_BATCH = 100, 1_000, 256
COLLECTIVES = {"all-gather": "c10d::_allgather_base_", "reduce-scatter": "c10d::_reduce_scatter_base_",
               "all-reduce": "c10d::allreduce_"}  # the c10d ops each collective runs as, in the CPU profile


@dataclass(frozen=True)
class ShardStudy:
    """What rank 0 gathered: memory per rank, collectives per step, paired step times, parity, the checkpoint."""

    world_size: int
    backend: str
    batch_size: int  # sequences per rank and step
    memory: list[dict]  # one row per setup: bytes held by each rank, and how they were measured
    collectives: dict[str, dict[str, int]]  # per setup: calls of each collective in one training step
    round_times_s: dict[str, list[float]]  # per setup: the mean step time of each round (slowest rank)
    slot_shifts: dict[str, list[int]]  # per setup: how many slots after DDP it ran in each round
    losses: list[float]  # FSDP2's loss at each parity step (mean over ranks)
    reference_losses: list[float]  # one process on the concatenated batches
    parameter_difference: float  # max |FSDP2 parameter - one-process parameter| after the parity steps
    max_update: float  # how far the parity steps moved the parameters
    mixed_precision: dict[str, str | float]  # FSDP2 with bf16 parameters and fp32 reduction: one step
    checkpoint: str  # the folder every rank wrote its shard to
    probe_outputs: list  # the sharded model's logits on the probe batch after the parity steps
    scaling: list[dict]  # bytes rank 0 holds under FSDP2 at each world size, measured under a fake group

    def scaling_table(self) -> pd.DataFrame:
        """:func:`.shard_scaling.scaling_table` of this study's measurements."""
        return scaling_table(self.scaling)

    @property
    def loss_difference(self) -> float:
        return float(np.max(np.abs(np.subtract(self.losses, self.reference_losses))))

    def memory_table(self) -> pd.DataFrame:
        """Per-rank MiB of parameters, gradients and optimizer state, and the total against one process's."""
        table = pd.DataFrame(self.memory).set_index("setup")
        parts = ["parameters", "gradients", "optimizer state"]
        table[parts] = table[parts] / 2**20
        table["total"] = table[parts].sum(axis=1)
        table["of one process"] = table["total"] / table.loc["one process", "total"]
        return table.rename(columns={part: f"{part} MiB" for part in [*parts, "total"]}).round(4)

    def collectives_table(self) -> pd.DataFrame:
        """Calls of each collective in one training step, one row per setup."""
        return pd.DataFrame(self.collectives).T.rename_axis("setup")

    def timing_table(self) -> pd.DataFrame:
        """Median step time of each setup and its speed-up over DDP with the interval, from the paired rounds."""
        rows = []
        for label, times in self.round_times_s.items():
            row = {"setup": label, "step ms (median)": 1e3 * float(np.median(times)), "rounds": len(times)}
            if label == "DDP":  # the reference: compared with itself it has no interval, only its own 1
                rows.append(row | {"speed-up over DDP": 1.0, "low": 1.0, "high": 1.0, "verdict": "reference"})
                continue
            result = speed_up(self.round_times_s["DDP"], times, self.slot_shifts[label])
            rows.append(row | {"speed-up over DDP": result.ratio, "low": result.low, "high": result.high,
                               "verdict": result.verdict})
        return pd.DataFrame(rows).set_index("setup").round(3)

    def speedups(self) -> pd.DataFrame:
        """The FSDP2 setups' speed-ups over DDP as tidy rows, in the columns ``optlab.book.report`` plots."""
        table = self.timing_table().drop(index="DDP")
        return pd.DataFrame({"model": "GPT", "phase": "train", "variant": table.index, "source": "live",
                             "speedup": table["speed-up over DDP"], "ci_low": table["low"], "ci_high": table["high"],
                             "verdict": table["verdict"], "role": None, "versus": "DDP"}).reset_index(drop=True)

    def round_trip_difference(self) -> float:
        """Max |logits of one process that loaded the ranks' checkpoint - logits of the sharded model that saved it|."""
        loaded = loaded_outputs(self.checkpoint, self.batch_size)
        return float((loaded - torch.tensor(self.probe_outputs)).abs().max())

    def describe_parity(self) -> str:
        return (f"FSDP2 on {self.world_size} ranks vs one process on the concatenated batches, "
                f"{len(self.losses)} SGD steps with momentum: max parameter difference {self.parameter_difference:.2e} "
                f"(training moved them by up to {self.max_update:.2e}), max loss difference {self.loss_difference:.2e}")


SETUPS = {"DDP": None, "FSDP2": {"reshard_after_forward": True},
          "FSDP2, no reshard after forward": {"reshard_after_forward": False}}


def _build(workload: Workload, initial: nn.Module, setup: str, group: Group, **knobs) -> nn.Module:
    model = copy.deepcopy(initial).to(group.info.device)
    return wrap(model, group.info) if setup == "DDP" else shard(model, **knobs)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, loss_fn) -> torch.Tensor:
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _parity_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _held(make: Callable[[], nn.Module], workload: Workload, batch: torch.Tensor, device: torch.device) -> dict:
    """Bytes this rank holds after one step of the model ``make`` builds: the CUDA allocator's growth at each stage
    on a GPU, the tensors' own storages on a CPU (which has no allocator to ask)."""
    cuda = device.type == "cuda"
    start = torch.cuda.memory_allocated(device) if cuda else 0
    model = make()
    optimizer = _optimizer(model)
    after_parameters = torch.cuda.memory_allocated(device) if cuda else 0
    workload.loss(model, batch.to(device)).backward()
    after_gradients = torch.cuda.memory_allocated(device) if cuda else 0
    optimizer.step()
    if not cuda:
        return {**state_bytes(model, optimizer), "measured": "tensor storages"}
    end = torch.cuda.memory_allocated(device)
    return {"parameters": after_parameters - start, "gradients": after_gradients - after_parameters,
            "optimizer state": end - after_gradients, "measured": "CUDA allocator"}


def _collectives(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], workload: Workload,
                 batch: torch.Tensor) -> dict[str, dict[str, int]]:
    """Calls of each collective in one training step of each (warmed-up) setup, counted from the profiler's c10d
    ops under the step's ``record_function`` range."""
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        for label, model in models.items():
            with record_function(label):
                _step(model, optimizers[label], batch, workload.loss)
    counts = {label: dict.fromkeys(COLLECTIVES, 0) for label in models}
    names = {op: name for name, op in COLLECTIVES.items()}
    for event in trace.events():
        if event.name in names:
            parent = event.cpu_parent
            while parent is not None and parent.name not in counts:
                parent = parent.cpu_parent
            if parent is not None:
                counts[parent.name][names[event.name]] += 1
    return counts


def _round_times(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], workload: Workload,
                 batches: list[torch.Tensor], rounds: int, group: Group) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Mean step time of each setup in each round, the setups visited in :func:`visit_order`; a round of a setup
    ends when its slowest rank does."""
    labels = list(models)
    times: dict[str, list[float]] = {label: [] for label in labels}
    shifts: dict[str, list[int]] = {label: [] for label in labels}
    for round_index in range(rounds + 1):  # round 0 warms every setup up and is not kept
        order = visit_order(labels, round_index)
        for label in order:
            barrier(group)
            start = time.perf_counter()
            for batch in batches:
                _step(models[label], optimizers[label], batch, workload.loss)
            if round_index:
                slowest = max(gather(time.perf_counter() - start, group))
                times[label].append(slowest / len(batches))
                shifts[label].append(order.index(label) - order.index("DDP"))
    return times, shifts


def _flat(model: nn.Module) -> torch.Tensor:
    """Every parameter in full (a sharded one gathered from all ranks), flattened into one vector."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in full])


def _parity(workload: Workload, initial: nn.Module, group: Group, steps: int, batch_size: int):
    """FSDP2 on every rank's batch against one process on all of them concatenated: losses and final parameters."""
    model = shard(copy.deepcopy(initial).to(group.info.device))
    optimizer = _parity_optimizer(model)
    losses = []
    for step in range(steps):
        batch = workload.batch(batch_size, step * group.world_size + group.rank).to(group.info.device)
        loss = _step(model, optimizer, batch, workload.loss)
        dist.all_reduce(loss)  # the sum (gloo has no average); each rank's loss is its own batch's mean
        losses.append(float(loss) / group.world_size)
    sharded = _flat(model)
    reference, reference_losses = None, []
    if group.is_main:
        reference = copy.deepcopy(initial)
        optimizer = _parity_optimizer(reference)
        for step in range(steps):
            batch = torch.cat([workload.batch(batch_size, step * group.world_size + r) for r in range(group.world_size)])
            reference_losses.append(float(_step(reference, optimizer, batch, workload.loss)))
    return model, losses, sharded, reference, reference_losses


def shard_rank(out: Path, steps: int, rounds: int, batch_size: int, workload: Workload = TRANSFORMER) -> None:
    """One rank of the study (run under torchrun); rank 0 writes ``out/study.json`` and every rank its checkpoint
    shard under ``out/checkpoint``. After the job's group is left, rank 0 measures larger worlds under a fake group."""
    with process_group("auto") as group:
        results = _measure(out, steps, rounds, batch_size, workload, group)
    if results is not None:
        study = ShardStudy(**results, scaling=fake_rank_bytes(WORLD_SIZES, batch_size, workload))
        store.atomic_write_text(out / "study.json", json.dumps(asdict(study)))


def _measure(out: Path, steps: int, rounds: int, batch_size: int, workload: Workload, group: Group) -> dict | None:
    """Every measurement of the study on this rank; rank 0 returns them, the others None."""
    device = group.info.device
    torch.manual_seed(0)
    initial = workload.build()
    local = workload.batch(batch_size, group.rank)
    memory = []
    if group.is_main:  # the same global batch in one process, before any other setup holds memory
        whole = torch.cat([workload.batch(batch_size, r) for r in range(group.world_size)])
        memory.append({"setup": "one process", **_held(lambda: copy.deepcopy(initial).to(device), workload,
                                                       whole, device)})
    for label, knobs in SETUPS.items():
        per_rank = gather(_held(lambda: _build(workload, initial, label, group, **(knobs or {})), workload,
                                local, device), group)
        memory.append({"setup": label, **per_rank[0], "ranks differ by bytes": max(
            abs(r[k] - per_rank[0][k]) for r in per_rank for k in ("parameters", "gradients", "optimizer state"))})
    models = {label: _build(workload, initial, label, group, **(knobs or {})) for label, knobs in SETUPS.items()}
    optimizers = {label: _optimizer(model) for label, model in models.items()}
    batches = [workload.batch(batch_size, 1000 + k * group.world_size + group.rank).to(device) for k in range(steps)]
    times, shifts = _round_times(models, optimizers, workload, batches, rounds, group)
    collectives = _collectives(models, optimizers, workload, local.to(device))
    del models
    model, losses, sharded, reference, reference_losses = _parity(workload, initial, group, steps, batch_size)
    mixed = _mixed_precision(workload, initial, group, local.to(device))
    checkpoint = out / "checkpoint"
    save_sharded(model, checkpoint)
    probe = workload.batch(batch_size, PROBE_SEED).to(device)
    with torch.no_grad():
        probe_outputs = model(probe).float().cpu()
    if not group.is_main:
        return None
    return dict(world_size=group.world_size, backend=group.backend, batch_size=batch_size, memory=memory,
                collectives=collectives, round_times_s=times, slot_shifts=shifts, losses=losses,
                reference_losses=reference_losses,
                parameter_difference=float((sharded - _flat(reference)).abs().max()),
                max_update=float((_flat(reference) - _flat(initial)).abs().max()),
                mixed_precision=mixed, checkpoint=str(checkpoint), probe_outputs=probe_outputs.tolist())


def _mixed_precision(workload: Workload, initial: nn.Module, group: Group, batch: torch.Tensor) -> dict:
    """One step of FSDP2 with bf16 parameters in compute and fp32 gradient reduction, against the fp32 loss."""
    model = shard(copy.deepcopy(initial).to(group.info.device), mixed_precision=BF16_POLICY)
    compute_dtypes = set()
    hook = model.blocks[0].register_forward_hook(lambda m, i, o: compute_dtypes.add(str(o.dtype)))
    loss = workload.loss(model, batch)
    loss.backward()
    hook.remove()
    fp32_loss = workload.loss(copy.deepcopy(initial).to(group.info.device), batch)
    parameter = next(model.parameters())
    return {"compute dtype": ", ".join(sorted(compute_dtypes)), "stored parameter dtype": str(parameter.dtype),
            "gradient dtype": str(parameter.grad.dtype), "loss": float(loss),
            "loss difference from fp32": abs(float(loss) - float(fp32_loss))}


def check_sizes(nproc: int, steps: int, rounds: int, batch_size: int) -> None:
    """Refuse sizes this machine cannot run, with the limit in the message."""
    check_count("nproc", nproc, 2, max(2, cpu_cores()), "one process per CPU core")
    check_count("steps", steps, 1, MAX_STEPS, "steps per round and parity steps")
    check_count("rounds", rounds, 2, MAX_ROUNDS, "a paired interval needs two and hardly narrows past that")
    check_count("batch_size", batch_size, 1, MAX_BATCH, "sequences per rank at the toy size")


def shard_study(nproc: int = 2, steps: int = 3, rounds: int = 8, batch_size: int = 4,
                folder: str | Path | None = None, timeout: float = 300.0) -> ShardStudy:
    """Launch the study on ``nproc`` CPU processes (gloo) and return what rank 0 measured. The checkpoint stays in
    ``folder`` (a new temporary folder if None)."""
    try:
        check_sizes(nproc, steps, rounds, batch_size)
    except OptlabError as error:
        raise OptlabError(f"sharding study: {error}") from None
    out = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="optlab-shard-"))
    out.mkdir(parents=True, exist_ok=True)
    args = ["-m", "optlab.studies.distributed", "shard-rank", "--out", str(out), "--steps", str(steps),
            "--rounds", str(rounds), "--batch-size", str(batch_size)]
    launch(torchrun_command(args, nproc), timeout, threads=1)
    return ShardStudy(**json.loads((out / "study.json").read_text()))
