"""``python -m optlab.studies.distributed shard-check`` (``make shard-check``) and the sharding study's other commands."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from ...core.errors import OptlabError
from .clusters import cluster_commands
from .shard_checkpoint import ROUND_TRIP_TOLERANCE
from .shard_study import SHARD_TOLERANCE, shard_rank, shard_study

COMMANDS = ("shard-check", "shard-rank", "cluster-commands")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m optlab.studies.distributed", description="FSDP2 checks.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("shard-check", help="FSDP2 parity with one process, and a checkpoint round trip")
    check.add_argument("--nproc", type=int, default=2)
    rank = commands.add_parser("shard-rank", help="one rank of the sharding study (started by torchrun)")
    rank.add_argument("--out", type=Path, required=True)
    for command in (check, rank):
        command.add_argument("--steps", type=int, default=3)
        command.add_argument("--rounds", type=int, default=2)
        command.add_argument("--batch-size", type=int, default=4)
    clusters = commands.add_parser("cluster-commands", help="print the launch lines for several GPUs and nodes")
    clusters.add_argument("--nnodes", type=int, default=2)
    clusters.add_argument("--gpus-per-node", type=int, default=8)
    clusters.add_argument("--endpoint", default="node0:29500")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "shard-rank":
            shard_rank(args.out, args.steps, args.rounds, args.batch_size)
        elif args.command == "cluster-commands":
            for name, line in cluster_commands(args.nnodes, args.gpus_per_node, args.endpoint).items():
                print(f"# {name}\n{line}")
        else:
            return _check(args)
    except OptlabError as error:
        print(f"optlab: error: {error}", file=sys.stderr)
        return 2
    return 0


def _check(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="optlab-shard-check-") as folder:
        study = shard_study(args.nproc, args.steps, args.rounds, args.batch_size, folder)
        round_trip = study.round_trip_difference()
    print(study.describe_parity())
    print(f"checkpoint written by {study.world_size} ranks, loaded by 1 process: max logit difference {round_trip:.2e}")
    failed = False
    if not study.parameter_difference <= SHARD_TOLERANCE:
        print(f"optlab: error: FSDP2 and one process disagree beyond {SHARD_TOLERANCE:g}", file=sys.stderr)
        failed = True
    if not round_trip <= ROUND_TRIP_TOLERANCE:
        print(f"optlab: error: the loaded checkpoint gives other outputs (beyond {ROUND_TRIP_TOLERANCE:g})",
              file=sys.stderr)
        failed = True
    return 1 if failed else 0
