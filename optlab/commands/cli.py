"""The command line: ``python -m optlab list | run TECHNIQUE | reference``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import pandas as pd

from ..core.errors import OptlabError

DEFAULT_RUN_DIR = Path("results") / "runs"


def _whole_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m optlab", description="Measure PyTorch speed-ups.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the techniques")

    run = commands.add_parser("run", help="run one technique's comparison")
    run.add_argument("technique")
    _add_common(run, default_out=DEFAULT_RUN_DIR)
    run.add_argument("--models", nargs="+", help="models to run (default: the profile's)")
    run.add_argument("--batch-size", type=_whole_number, help="images per batch (default: the profile's)")
    run.add_argument("--num-workers", type=_whole_number, help="DataLoader workers for the common config")
    run.add_argument("--distributed", action="store_true",
                     help="one process per device with DistributedDataParallel; start it with "
                          "torchrun --nproc-per-node N -m optlab run TECHNIQUE --distributed")

    reference = commands.add_parser("reference", help="run every technique: the GPU reference run")
    _add_common(reference, default_out=Path("results") / "reference" / "this-machine")
    reference.add_argument("--set", default="seed",
                           help="which techniques: seed (default), beyond, compile (torch.compile and CUDA graphs), "
                                "stack (all together) or all")
    return parser


def _add_common(command: argparse.ArgumentParser, default_out: Path) -> None:
    command.add_argument("--profile", help="smoke, quick, full or auto (default: $OPTLAB_PROFILE or auto)")
    command.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    command.add_argument("--out", type=Path, default=default_out, help=f"results folder (default: {default_out})")
    command.add_argument("--download", action="store_true", help="download CIFAR-10 into $OPTLAB_DATA first")
    command.add_argument("--quiet", action="store_true", help="no progress bar")


def _print_table(summary: pd.DataFrame) -> None:
    from ..book.report import comparison_table

    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 40):
        print(comparison_table(summary).drop(columns=["img/s", "TFLOP/s"]).to_string(index=False))


def _list() -> None:
    from ..core.registry import list_experiments

    with pd.option_context("display.width", 200, "display.max_colwidth", 90):
        print(list_experiments().to_string(index=False))


def _run(args: argparse.Namespace) -> None:
    from ..studies.distributed import run_distributed
    from ..core.experiments import run_experiment

    overrides = {k: v for k, v in {"batch_size": args.batch_size, "num_workers": args.num_workers}.items() if v is not None}
    run = run_distributed if args.distributed else run_experiment
    result = run(args.technique, models=args.models, profile=args.profile, device=args.device,
                 overrides=overrides, out=args.out, progress=not args.quiet, download=args.download)
    if result is not None:  # a distributed run returns its result on rank 0 only
        _print_table(result.summary)


def _reference(args: argparse.Namespace) -> None:
    from .reference import run_reference

    for result in run_reference(args.out, set_name=args.set, profile=args.profile, device=args.device,
                                progress=not args.quiet, download=args.download):
        _print_table(result.summary)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"list": lambda: _list(), "run": lambda: _run(args), "reference": lambda: _reference(args)}[args.command]()
    except OptlabError as error:
        print(f"optlab: error: {error}", file=sys.stderr)
        return 2
    return 0
