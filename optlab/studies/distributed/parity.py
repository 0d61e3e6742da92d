"""The parity check: N gloo processes train to the same weights as one process on the concatenated batches.

``python -m optlab.studies.distributed parity`` (``make ddp-check``) prints the max parameter difference.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import Dataset

from ...core.cifar import data
from ...core.measuring import loops
from ...core.results import store
from ...core.knobs.config import RunConfig
from ...core.errors import OptlabError
from ...core.knobs.limits import check_count, cpu_cores
from ...core.cifar.models import build_model
from .group import Group, gather, process_group
from .launch import launch, torchrun_command
from .training import ddp_step, distributed_loader, wrap

PARITY_TOLERANCE = 1e-5
# stored GPU runs, one folder per machine; apart from results/reference, whose pages summarise single-process runs


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

CHECK_STEPS, CHECK_ACCUMULATION_STEPS = 3, 2  # the check's optimizer steps and micro-steps per step, by default
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


def check_in_group(group: Group, steps: int, accumulation_steps: int) -> Parity | None:
    """The parity check on the ranks of a joined ``group``: every rank trains its DDP replica both ways, rank 0 also
    the single-process reference, and rank 0 returns what they found (the other ranks return None)."""
    config = replace(PARITY_CONFIG, accumulation_steps=accumulation_steps)
    # the test split with the test transform: no random augmentation, so every rank's batches are known exactly
    dataset = data.StandInCIFAR10(train=False, transform=data.test_transform())
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
    if not group.is_main:
        return None
    reference = _flat(_single_process(copy.deepcopy(initial), dataset, config, steps, group.world_size))
    return Parity(
        group.world_size, steps, accumulation_steps,
        difference={mode: float((final - reference).abs().max()) for mode, final in finals.items()},
        rank_difference=max(float((p - per_rank[0]).abs().max()) for p in per_rank),
        max_update=float((reference - _flat(initial)).abs().max()),
        allreduce_calls={mode: c["calls"] for mode, c in traffic.items()},
        allreduce_bytes={mode: c["bytes"] for mode, c in traffic.items()},
    )


def check_sizes(nproc: int, steps: int, accumulation_steps: int) -> None:
    """Refuse a check the test set cannot feed, or one of fewer than 2 processes, with the limit in the message."""
    try:
        check_count("nproc", nproc, 2, max(2, cpu_cores()), "one process per CPU core")
        micro_batches = data.TEST_SIZE // (PARITY_CONFIG.batch_size * nproc)
        check_count("accumulation_steps", accumulation_steps, 1, micro_batches, "micro-batches in the test set")
        check_count("steps", steps, 1, micro_batches // accumulation_steps, "optimizer steps the test set can feed")
    except OptlabError as error:
        raise OptlabError(f"parity check: {error}") from None


def check_for_run(group: Group) -> dict[str, Any]:
    """The parity check as a distributed run's first step (``optlab run --distributed --check-parity``): rank 0
    prints it and returns it as a dict for the record, the other ranks return an empty one; a difference beyond
    :data:`PARITY_TOLERANCE` stops the run, since its timing would describe a broken setup."""
    if group.info.is_cuda:
        raise OptlabError("--check-parity compares CPU processes (gloo) with one CPU process; on GPUs run the job "
                          "without it, and make ddp-check on a CPU")
    check_sizes(group.world_size, CHECK_STEPS, CHECK_ACCUMULATION_STEPS)
    result = check_in_group(group, CHECK_STEPS, CHECK_ACCUMULATION_STEPS)
    if result is None:
        return {}
    print(f"parity check: {result.describe()}")
    if not result.max_difference < PARITY_TOLERANCE:  # rank 0 stops, and torchrun stops the others
        raise OptlabError(f"the parity check failed: DDP and one process differ by {result.max_difference:.3g}, beyond "
                          f"{PARITY_TOLERANCE:g}; timing such a job would measure a broken setup")
    return asdict(result)


def parity_rank(steps: int, accumulation_steps: int, out: Path) -> None:
    """One rank of the parity check (run under torchrun); rank 0 writes the result to ``out``."""
    with process_group("cpu") as group:
        result = check_in_group(group, steps, accumulation_steps)
        if result is not None:
            store.atomic_write_text(out, json.dumps(asdict(result)))


def parity(nproc: int = 2, steps: int = CHECK_STEPS, accumulation_steps: int = CHECK_ACCUMULATION_STEPS,
           timeout: float = 300.0) -> Parity:
    """Launch the parity check on ``nproc`` CPU processes (gloo) and return what rank 0 measured."""
    check_sizes(nproc, steps, accumulation_steps)
    with tempfile.TemporaryDirectory(prefix="optlab-parity-") as folder:
        out = Path(folder) / "parity.json"
        args = ["-m", "optlab.studies.distributed", "parity-rank", "--steps", str(steps), "--accumulation-steps",
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
        command.add_argument("--steps", type=int, default=CHECK_STEPS)
        command.add_argument("--accumulation-steps", type=int, default=CHECK_ACCUMULATION_STEPS)
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
