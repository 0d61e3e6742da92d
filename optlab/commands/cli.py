"""The command line: ``python -m optlab list | run TECHNIQUE | reference | tune | serve STUDY | ceilings | parallel-plan``."""
from __future__ import annotations

import argparse
import contextlib
import functools
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import pandas as pd

from ..core.errors import OptlabError
from ..core.knobs.profiles import Profile
from ..core.process.shutdown import ENDING_SIGNALS, Interrupted, held, signals_interrupt
from ..core.measuring.timing import TIMES_BESIDE
from . import serve

if TYPE_CHECKING:
    from ..core.run.experiments import ExperimentResult
    from ..studies.tune import InferenceResult, TuneResult

DEFAULT_RUN_DIR = Path("results") / "runs"
REFERENCE_OUT = Path("results") / "reference" / "this-machine"


def _whole_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    return value


def _whole_numbers(text: str) -> list[int]:
    return [_whole_number(part) for part in text.split(",")]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistyped argument ends like every other bad input: one ``optlab: error:`` line, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"optlab: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m optlab", description="Measure PyTorch speed-ups.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the techniques")

    run = commands.add_parser("run", help="run one technique's comparison")
    run.add_argument("technique")
    _add_common(run, default_out=DEFAULT_RUN_DIR)
    run.add_argument("--models", nargs="+", help="models to run (default: the profile's)")
    run.add_argument("--batch-size", type=_whole_number, help="images per batch (default: the profile's)")
    run.add_argument("--num-workers", type=_whole_number, help="DataLoader workers for the common config")
    run.add_argument("--steps", type=_whole_number, help="timed steps per repeat, train and test (default: the profile's)")
    _add_repeats(run)
    run.add_argument("--distributed", action="store_true",
                     help="one process per device with DistributedDataParallel; start it with "
                          "torchrun --nproc-per-node N -m optlab run TECHNIQUE --distributed")
    run.add_argument("--check-parity", action="store_true",
                     help="with --distributed on CPU processes: before timing, check that the ranks train to the "
                          "weights of one process (make ddp-check's check, kept in the record)")

    reference = commands.add_parser(
        "reference", help="run every technique: the GPU reference run",
        description="The GPU reference run, part by part (a technique on one model, or a study's tables), in a fixed "
                    "priority order; parts already recorded under --out for this machine, torch version and commit "
                    "are skipped. Records are stamped with the git commit of the checkout, or with "
                    "$OPTLAB_GIT_COMMIT where the copy has no .git (set it to the commit the copy was made from).")
    _add_common(reference, default_out=REFERENCE_OUT)
    reference.add_argument("--set", help="which techniques: seed (the default for a run), beyond, compile "
                                         "(torch.compile and CUDA graphs), stack (all together), transformer (the "
                                         "GPT's), serving (serving the GPT: tables only), first_step (compile time and "
                                         "changing shapes: tables only) or all (the default for "
                                         "--plan)")
    reference.add_argument("--plan", action="store_true",
                           help="print every part with its steps and estimated H200 seconds, and run nothing")
    reference.add_argument("--budget", type=float, metavar="SECONDS",
                           help="a deadline SECONDS after the process start: a part that would end past it is "
                                "skipped (later ones that fit still run), a running one stops at a repeat's end")
    _add_repeats(reference)
    reference.add_argument("--archive", type=Path, metavar="PATH.tar.gz",
                           help="after every part, and when the run ends or is stopped by SIGTERM, SIGINT or "
                                "SIGHUP, pack everything in --out (records, tables, reference-parts.csv, "
                                "reference.log) into this one compressed file")
    reference.add_argument("--unpack", type=Path, metavar="PATH.tar.gz",
                           help="run nothing: merge an archive that --archive wrote into --out (default: "
                                "results/reference/<the folder it was packed from>)")

    ceilings = commands.add_parser("ceilings", help="this device's measured ceilings: MAMF, bandwidth, launch")
    ceilings.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ceilings.add_argument("--dtypes", help="matmul dtypes, comma-separated (default: all the device runs)")
    ceilings.add_argument("--mib", type=_whole_number, help="MiB copied and read (default: 4x all last-level caches, "
                          "at least 64 on a CPU, 4096 on a GPU)")
    ceilings.add_argument("--min-run-time", type=float, metavar="SECONDS",
                          help="timed per figure, over its 6 rounds (default 0.2-0.25)")
    ceilings.add_argument("--out", type=Path, help="a folder to keep ceilings.csv in (default: none is written)")

    tune = commands.add_parser("tune", help="the stack of techniques, one step at a time, on your own model")
    tune.add_argument("--model", required=True, metavar="PACKAGE.MODULE:CALLABLE",
                      help="what builds the model, such as torchvision.models:resnet50")
    tune.add_argument("--kwargs", default="{}", metavar="JSON",
                      help='keyword arguments for it, as a JSON object, such as \'{"num_classes": 10}\'')
    inputs = tune.add_argument_group("inputs", "one of --input-shape, --input or --example-batch; a batch size scales "
                                               "the first dimension")
    inputs.add_argument("--input-shape", metavar="C,H,W", help="one input's shape, random normal, such as 3,224,224")
    inputs.add_argument("--input", action="append", metavar="[NAME=]KIND:...",
                        help="an input of the model, repeated for several (positional in order, or all NAME= for "
                             "keyword inputs): float:D1,D2,... (random normal) or tokens:VOCAB:LEN[:mask] (integer "
                             "ids, with an attention mask; training targets are the next tokens), such as "
                             "--input input_ids=tokens:32000:128:mask")
    inputs.add_argument("--example-batch", metavar="PACKAGE.MODULE:CALLABLE",
                        help="returns an example batch: with --inference the inputs (a tensor, a tuple, a dict of "
                             "keyword tensors), for training (inputs, targets)")
    tune.add_argument("--num-classes", type=_whole_number,
                      help="classes of the synthetic labels (training); with --inference, checked against the output")
    tune.add_argument("--batch-size", type=_whole_number, help="samples per batch (default: the profile's)")
    tune.add_argument("--steps", type=_whole_number, help="timed steps per repeat (default: the profile's)")
    _add_repeats(tune)
    tune.add_argument("--optimizer", default="sgd", help="sgd (default), adam or adamw")
    tune.add_argument("--profile", help="smoke, quick or auto (default: $OPTLAB_PROFILE or auto)")
    tune.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    tune.add_argument("--out", type=Path, help="a folder for the record (default: none is written)")
    tune.add_argument("--quiet", action="store_true", help="no progress bar")
    tune.add_argument("--memory", action="store_true",
                      help="one training step's memory by category instead: the largest, what moves it, each fix "
                           "measured, and the largest batch that fits (on a GPU)")
    tune.add_argument("--compile", action="store_true",
                      help="whether torch.compile pays instead: graph breaks with their lines, recompiles over "
                           "--shapes, the model's own compile seconds cold and warm beside the machine's setup, the speed-up "
                           "and the break-even (the training step; the forward with --inference)")
    tune.add_argument("--shapes", nargs="+", metavar="D1,D2,...",
                      help="with --compile, the per-sample shapes your data has, such as 3,224,224 3,160,160 or, for "
                           "token ids, 128 200 512: the recompiles over them")
    inference = tune.add_argument_group("inference", "--inference tries the inference stack, then batch sizes")
    inference.add_argument("--inference", action="store_true",
                           help="eval() + inference_mode, 16-bit autocast, channels_last, torch.compile (and CUDA "
                                "graphs on a GPU), then latency and throughput at batch sizes 1, 2, 4, ...")
    inference.add_argument("--output-fn", metavar="PACKAGE.MODULE:CALLABLE",
                           help="picks the tensor to compare from a model that returns something else (a dict)")
    inference.add_argument("--max-batch", type=_whole_number, help="the largest batch size to try (default 1024)")
    inference.add_argument("--dtype", default="auto", help="the autocast step's dtype: auto (bf16 where native, "
                                                         "else fp16), bf16, fp16 or none")
    inference.add_argument("--sweep-compile", action="store_true",
                           help="sweep batch sizes with torch.compile too (it compiles each batch size again)")
    inference.add_argument("--request-seconds", type=float, metavar="SECONDS",
                           help="time request latency (one request at a time) for at least this long at each batch "
                                "size, and at least 30 requests (default 2)")
    inference.add_argument("--request-batches", type=_whole_numbers, metavar="B1,B2,...",
                           help="the batch sizes whose request latency is timed (default 1)")
    serve.add_parser(commands)

    plan = commands.add_parser("parallel-plan", help="memory per GPU and bytes per step of each way to split a GPT "
                                                     "over GPUs (DP, ZeRO-1/2, FSDP, HSDP, TP, SP, PP and their "
                                                     "compositions)")
    plan.add_argument("--model", default="7b", help="gpt2_small, gpt2_medium, gpt2_large, gpt2_xl or 7b (default)")
    plan.add_argument("--gpus", type=_whole_number, default=8, help="GPUs in all (default 8)")
    plan.add_argument("--gpu-memory", type=float, default=80.0, metavar="GB",
                      help="memory of one GPU in GB of 1e9 bytes (default 80)")
    plan.add_argument("--margin", type=float, default=0.1, metavar="FRACTION",
                      help="the share of the memory kept free for the allocator, the CUDA context and temporaries "
                           "(default 0.1)")
    plan.add_argument("--gpus-per-node", type=_whole_number, default=8, help="GPUs in one node (default 8)")
    plan.add_argument("--intra-node", default="nvlink4", help="the link inside a node: nvlink4 (default), nvlink3, "
                                                              "pcie5 or pcie4")
    plan.add_argument("--inter-node", default="infiniband-ndr", help="the link between nodes, per GPU: "
                                                                     "infiniband-ndr (default) or infiniband-hdr")
    plan.add_argument("--micro-batch", type=_whole_number, default=1, help="sequences per micro-batch (default 1)")
    plan.add_argument("--micro-batches", type=_whole_number, default=8, help="micro-batches per step (default 8)")
    plan.add_argument("--bytes-per-parameter", type=int, default=16, choices=(16, 18),
                      help="model state a parameter: 16 (bf16 gradients, the ZeRO paper's count; default) or 18 "
                           "(fp32 gradients, Megatron's)")
    plan.add_argument("--recompute", action="store_true", help="recompute each block's activations in backward")
    plan.add_argument("--vocab-parallel", action="store_true",
                      help="split the embedding, head and loss by vocabulary over the tensor-parallel ranks")
    plan.add_argument("--top", type=_whole_number, help="print only the first N layouts")
    return parser


def _add_common(command: argparse.ArgumentParser, default_out: Path) -> None:
    command.add_argument("--profile", help="smoke, quick, full or auto (default: $OPTLAB_PROFILE or auto)")
    command.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    command.add_argument("--out", type=Path, help=f"results folder (default: {default_out})")
    command.set_defaults(default_out=default_out)
    command.add_argument("--download", action="store_true", help="download CIFAR-10 into $OPTLAB_DATA first")
    command.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_repeats(command: argparse.ArgumentParser) -> None:
    command.add_argument("--repeats", type=_whole_number,
                         help="the minimum of timed repeats per variant (default: the profile's)")
    command.add_argument("--max-repeats", type=_whole_number,
                         help="the hard cap (at most 100): more repeats, in pairs, while any answer is unclear and "
                              "the time budget allows (default: the profile's)")
    command.add_argument("--time-budget", type=float, metavar="SECONDS",
                         help="no new pair of repeats once one model's comparison would pass SECONDS "
                              "(default: the profile's)")


def _sized_profile(args: argparse.Namespace, cuda: bool | None = None) -> "str | Profile | None":
    """The profile as named, or a copy with the steps and repeats the user typed (``auto`` read for ``cuda``, or
    for the device the run asks for)."""
    from ..core.machine.device import resolve_device
    from ..core.knobs.profiles import get_profile

    sizes = (getattr(args, "steps", None), args.repeats, args.max_repeats, args.time_budget)
    if all(size is None for size in sizes):
        return args.profile
    cuda = resolve_device(args.device).is_cuda if cuda is None else cuda
    return get_profile(args.profile, cuda).with_sizes(*sizes)


def _print_table(result: "ExperimentResult") -> None:
    """The comparison, its throughput in the unit of the workload that ran (images/s, tokens/s). The first import of
    the tables (seaborn, matplotlib) comes between a reference run's parts, where a signal is likely: it is held until
    the import ends (an exception raised inside a C extension's start left the interpreter to abort at exit)."""
    with held():
        from ..book.report.tables import DETAILS, comparison_table, throughput_details
    from ..core.workload import get_workload

    details = throughput_details(result.summary)  # the columns comparison_table names, in the summary's unit
    throughput = details.get("items_per_s") or details["images_per_s"]
    unit = f"{get_workload(result.experiment.workload).unit}/s"
    table = comparison_table(result.summary, samples=result.samples)
    table = table.drop(columns=[DETAILS["tflops"]]).rename(columns={throughput: unit})
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 80):
        print(table.to_string(index=False))


def _list() -> None:
    from ..core.techniques.registry import list_experiments

    with pd.option_context("display.width", 200, "display.max_colwidth", 90):
        print(list_experiments().to_string(index=False))


def _run(args: argparse.Namespace) -> None:
    from ..studies.distributed import check_for_run, run_distributed
    from ..core.run.experiments import run_experiment

    overrides = {k: v for k, v in {"batch_size": args.batch_size, "num_workers": args.num_workers}.items() if v is not None}
    if args.check_parity and not args.distributed:
        raise OptlabError("--check-parity checks the ranks of a distributed run; add --distributed and start it with "
                          "torchrun --nproc-per-node N (N from 2)")
    parity = check_for_run if args.check_parity else None
    run = functools.partial(run_distributed, parity=parity) if args.distributed else run_experiment
    out = args.out or args.default_out
    try:
        result = run(args.technique, models=args.models, profile=_sized_profile(args), device=args.device,
                     overrides=overrides, out=out, progress=not args.quiet, download=args.download)
    except Interrupted as stop:
        stop.args = (f"{stop}: every model finished before it is kept in {out}",)
        raise
    if result is not None:  # a distributed run returns its result on rank 0 only
        _print_table(result)


def _reference(args: argparse.Namespace) -> None:
    from .reference import describe_plan, run_reference, unpack

    if args.unpack is not None:
        print(unpack(args.unpack, args.out))
        return
    out = args.out or args.default_out
    profile = _sized_profile(args, cuda=True if args.plan else None)
    if args.plan:
        print(describe_plan(args.set or "all", profile, args.device, out, args.budget))
        return
    try:
        with contextlib.closing(run_reference(out, set_name=args.set or "seed", profile=profile, device=args.device,
                                              progress=not args.quiet, download=args.download,
                                              budget_s=args.budget, archive=args.archive)) as results:
            for result in results:
                _print_table(result)
    except Interrupted as stop:
        kept = f"{out}" + (f" and packed into {args.archive}" if args.archive else "")
        stop.args = (f"{stop}: every part finished before it is kept in {kept}; run the same command again to add "
                     "the rest",)
        raise


def _ceilings(args: argparse.Namespace) -> None:
    from ..studies.limits import ceilings

    dtypes = args.dtypes.split(",") if args.dtypes else None
    table = ceilings.measure(args.device, dtypes, args.mib, args.min_run_time)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.drop(columns=ceilings.SWEEP_COLUMNS).to_string(index=False))
    print(ceilings.describe(table))
    if args.out is not None:
        print(f"kept in {ceilings.save(table, args.out)}")


def _tune_inputs(args: argparse.Namespace) -> dict:
    """What the model is given, from --input-shape, --input or --example-batch (exactly one)."""
    from ..studies.tune.examples import parse_input, parse_shape
    from ..studies.tune.inputs import example_from_spec

    given = [flag for flag, value in (("--input-shape", args.input_shape), ("--input", args.input),
                                      ("--example-batch", args.example_batch)) if value]
    if len(given) != 1:
        raise OptlabError(f"give one of --input-shape, --input or --example-batch (got "
                          f"{', '.join(given) or 'none'}), such as --input-shape 3,224,224 or --input "
                          "tokens:32000:128:mask")
    if args.input_shape:
        return {"input_shape": parse_shape(args.input_shape)}
    if args.input:
        return {"inputs": [parse_input(text) and text for text in args.input]}  # each checked here, at once
    inputs, targets = example_from_spec(args.example_batch, training=not args.inference)
    return {"inputs": inputs} | ({"targets": targets} if targets is not None else {})


def _tune(args: argparse.Namespace) -> None:
    from ..studies.tune import tune
    from ..studies.tune.examples import parse_shape
    from ..studies.tune.inputs import callable_from_spec, model_from_spec, parse_kwargs
    from ..studies.tune.recommendation import NothingRecommended

    model_fn = model_from_spec(args.model, parse_kwargs(args.kwargs))
    inputs = _tune_inputs(args)
    output_fn = args.output_fn and callable_from_spec(args.output_fn, "--output-fn", "picks the output tensor",
                                                      "mypackage.serving:logits")
    if args.shapes and not args.compile:
        raise OptlabError("--shapes goes with --compile (the recompiles over your shapes)")
    compile_only = {"compile": True, "shapes": [parse_shape(text) for text in args.shapes] if args.shapes else None} \
        if args.compile else {}
    options = {"inference": args.inference, "output_fn": output_fn, "max_batch": args.max_batch,
               "amp_dtype": args.dtype, "sweep_compile": args.sweep_compile, "optimizer": args.optimizer,
               "request_seconds": args.request_seconds, "request_batches": args.request_batches}
    try:
        result = tune(model_fn, num_classes=args.num_classes, batch_size=args.batch_size, device=args.device,
                      profile=_sized_profile(args), steps=args.steps, name=args.model, out=args.out,
                      progress=not args.quiet, memory=args.memory, **inputs, **options, **compile_only)
    except NothingRecommended as failed:  # its table shows what failed; then the one line
        _print_tune_tables(failed.result, False)
        raise
    except Interrupted as stop:
        stop.args = (f"{stop}: the tune ended before its recommendation, and wrote nothing",)
        raise
    if args.memory or args.compile:
        print(result.report())
        return
    _print_tune_tables(result, args.inference)
    print(result.describe())


def _print_tune_tables(result: "TuneResult | InferenceResult", inference: bool) -> None:
    """The steps' table and, for ``--inference``, the batch sizes' throughput and the request latency."""
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 70):
        print(result.table().to_string(index=False))
        print(TIMES_BESIDE)
        if inference:
            print(result.sweep_table().to_string(index=False))
            print(result.latency_table().to_string(index=False))


def _interruptible(command: "Callable[[], None]") -> "Callable[[], None]":
    """``command`` with SIGTERM, SIGINT and SIGHUP raising :class:`Interrupted` from its first line to its last (the
    reference run's own handling nests inside, and packs before the signal reaches here)."""
    def run() -> None:
        with signals_interrupt():
            command()
    return run


def _stopped(stop: Interrupted, bar_shown: bool) -> int:
    """The one last line of a run a signal ended, on a line of its own (a progress bar may have been mid-line), and
    the shell's exit status for it; a further signal does not cut the line short."""
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in ENDING_SIGNALS}
    try:
        print(f"{chr(10) if bar_shown else ''}optlab: stopped by {stop}", file=sys.stderr, flush=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return stop.exit_code


def _parallel_plan(args: argparse.Namespace) -> None:
    from ..studies.parallel.planner import parallel_plan, plan_header

    plan = parallel_plan(args.model, args.gpus, args.gpu_memory, args.intra_node, args.micro_batch,
                         args.micro_batches, args.inter_node, args.gpus_per_node, args.bytes_per_parameter,
                         args.margin, args.recompute, args.vocab_parallel)
    print(plan_header(plan))
    with pd.option_context("display.width", 250, "display.max_columns", None, "display.max_rows", None):
        print((plan.head(args.top) if args.top else plan).to_string())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"list": _list, "run": _interruptible(lambda: _run(args)),
                "reference": _interruptible(lambda: _reference(args)), "tune": _interruptible(lambda: _tune(args)),
                "serve": _interruptible(lambda: serve.run(args)), "ceilings": lambda: _ceilings(args),
                "parallel-plan": lambda: _parallel_plan(args)}
    try:
        commands[args.command]()
    except OptlabError as error:
        print(f"optlab: error: {error}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        return _stopped(stop, not getattr(args, "quiet", True))
    except KeyboardInterrupt:  # Ctrl-C before the handler was installed
        return _stopped(Interrupted(signal.SIGINT), not getattr(args, "quiet", True))
    return 0
