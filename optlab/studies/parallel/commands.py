"""The rank commands torchrun starts: ``tensor-rank``, ``pipeline-rank``, ``compose-rank``; each writes rank 0's
findings to ``--out``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from ...core.errors import OptlabError
from .compose_study import compose_rank
from .pipeline_study import pipeline_rank
from .tensor_study import tensor_rank


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m optlab.studies.parallel",
                                     description="One rank of a parallelism study (started by torchrun).")
    commands = parser.add_subparsers(dest="command", required=True)
    tensor = commands.add_parser("tensor-rank", help="tensor and sequence parallelism against one process")
    tensor.add_argument("--out", type=Path, required=True)
    tensor.add_argument("--steps", type=int, default=3)
    tensor.add_argument("--rounds", type=int, default=10)
    pipeline = commands.add_parser("pipeline-rank", help="pipeline schedules against one process")
    pipeline.add_argument("--out", type=Path, required=True)
    pipeline.add_argument("--microbatches", type=lambda text: [int(part) for part in text.split(",")], default=[4, 8])
    pipeline.add_argument("--repeats", type=int, default=0)
    compose = commands.add_parser("compose-rank", help="FSDP2 over TP on a 2 x 2 mesh against one process")
    compose.add_argument("--out", type=Path, required=True)
    compose.add_argument("--steps", type=int, default=2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "tensor-rank":
            tensor_rank(args.out, args.steps, args.rounds)
        elif args.command == "pipeline-rank":
            pipeline_rank(args.out, args.microbatches, args.repeats)
        elif args.command == "compose-rank":
            compose_rank(args.out, args.steps)
    except OptlabError as error:
        print(f"optlab: error: {error}", file=sys.stderr)
        return 2
    return 0
