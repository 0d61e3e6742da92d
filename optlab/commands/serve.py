"""``python -m optlab serve STUDY``: the serving chapters' studies from the command line, with their tables.

``decode`` times greedy decoding with no cache, a growing cache, a static cache and a compiled static cache (chapter
30); ``quantized`` the int8 and int4 weight-only copies against the model (chapter 31); ``speculative`` a draft model
and prompt lookup against greedy decoding (chapter 32); ``stream`` static and continuous batching serving a Poisson
stream of requests at given rates (chapter 33). Each runs on the book's trained GPT for the device, or on the reader's
``--model PACKAGE.MODULE:CALLABLE``, which must build the book's ``GPT`` (the caches write into its attention blocks).
"""
from __future__ import annotations

import argparse
from typing import Callable

import pandas as pd
import torch

from ..core.errors import OptlabError
from ..core.gpt.transformer import GPT
from ..core.knobs.limits import check_count
from ..core.machine.device import resolve_device

STUDIES = ("decode", "quantized", "speculative", "stream")
CACHE_VARIANTS = {"none": "no cache", "dynamic": "dynamic cache", "static": "static cache",
                  "compiled": "static cache, compiled"}
MAX_ROUNDS = 64
MAX_RATES = 8
MAX_OBJECTIVE_MS = 3_600_000.0  # an hour: past that, no request misses


def _numbers(kind: Callable[[str], float | int]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    return parse


def add_parser(commands: "argparse._SubParsersAction") -> None:
    """The ``serve`` subcommand and its options."""
    serve = commands.add_parser(
        "serve", help="serve a GPT: decoding with each cache, quantized, speculative, or a stream of requests",
        description="The serving chapters' studies (30-33), printed as their tables with verdicts.")
    serve.add_argument("study", choices=STUDIES, help="decode, quantized, speculative or stream")
    serve.add_argument("--model", metavar="PACKAGE.MODULE:CALLABLE",
                       help="builds the GPT to serve (optlab.core.gpt.transformer.GPT, trained as you like); default: "
                            "the book's trained GPT for the device")
    serve.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword arguments for --model, as JSON")
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    serve.add_argument("--rounds", type=int, help="paired rounds (default: the chapter's)")
    serve.add_argument("--prompt-len", type=int, help="prompt tokens (decode, quantized, speculative)")
    serve.add_argument("--new-tokens", type=int, help="tokens to generate (decode, quantized, speculative)")
    serve.add_argument("--batch", type=int, help="rows decoded at once (decode, quantized; default 1)")
    serve.add_argument("--caches", default="none,dynamic,static,compiled",
                       help="decode: the variants, from none (always run: the reference), dynamic, static, compiled")
    serve.add_argument("--draft", metavar="PACKAGE.MODULE:CALLABLE",
                       help="speculative: builds the draft GPT (default: the book's draft with the book's GPT; "
                            "prompt lookup only with your --model)")
    serve.add_argument("--ks", type=_numbers(int), metavar="K1,K2,...", help="speculative: draft lengths")
    serve.add_argument("--rates", type=_numbers(float), metavar="R1,R2,...",
                       help="stream: arrival rates in requests/s (default: the chapter's shares of the capacity)")
    serve.add_argument("--requests", type=int, help="stream: requests in each rate's stream")
    serve.add_argument("--slots", type=int, help="stream: the server's batch slots")
    serve.add_argument("--ttft-ms", type=float, help="stream: goodput's objective on the time to first token")
    serve.add_argument("--tpot-ms", type=float, help="stream: goodput's objective on the time per output token")


def _gpt(spec: "str | None", kwargs: str, device: torch.device, book: Callable[[], GPT], flag: str) -> GPT:
    """The reader's GPT from ``spec`` on ``device``, in eval mode, or the book's when no spec is given."""
    if spec is None:
        return book()
    from ..studies.tune.inputs import callable_from_spec, parse_kwargs

    built = callable_from_spec(spec, flag, "builds a GPT", "mypackage.models:my_gpt")(**parse_kwargs(kwargs))
    if not isinstance(built, GPT):
        raise OptlabError(f"{flag} {spec!r} built a {type(built).__name__}; serve needs the book's GPT "
                          "(optlab.core.gpt.transformer.GPT, any size, your weights): its caches write into its blocks")
    return built.to(device).eval()


def _prompt(model: GPT, length: int, batch: int = 1) -> torch.Tensor:
    """``batch`` copies of a prompt of ``length`` tokens cut from the corpus's validation text (random tokens where
    the GPT's vocabulary is not the corpus's)."""
    length = check_count("--prompt-len", length, 1, model.config.block_size - 1,
                         f"the GPT's block of {model.config.block_size} holds the prompt and the new tokens")
    from ..studies.serving.decoding import chapter_prompt

    if model.config.vocab_size == 65:
        prompt = chapter_prompt(model, length)
    else:
        prompt = torch.randint(model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    return prompt.to(model.token_embedding.weight.device).expand(batch, -1).contiguous()


def _print(*tables: pd.DataFrame) -> None:
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 60):
        for table in tables:
            print(table.round(3).to_string())


def _decode(args: argparse.Namespace, device: torch.device) -> None:
    from ..studies.serving import decoding

    size = decoding.decode_size(device)
    model = _gpt(args.model, args.kwargs, device, lambda: decoding.chapter_model(device), "--model")
    unknown = [name for name in args.caches.split(",") if name not in CACHE_VARIANTS]
    if unknown:
        raise OptlabError(f"--caches takes names of {', '.join(CACHE_VARIANTS)}; got {', '.join(unknown)}")
    variants = ["no cache"] + [CACHE_VARIANTS[name] for name in args.caches.split(",") if name != "none"]
    batch = check_count("--batch", args.batch or 1, 1, 64, "rows of one decode on this command")
    new_tokens = args.new_tokens or size.new_tokens
    prompt = _prompt(model, args.prompt_len or max(1, min(size.prompt_len, model.config.block_size - new_tokens)),
                     batch)
    study = decoding.decode_study(model, prompt, new_tokens, args.rounds or size.rounds,
                                  tuple(dict.fromkeys(variants)))
    print(study.describe())
    _print(study.table())
    for reason in sorted({study.mbu_reason(label) for label in study.tpot_s} - {None}):
        print(reason)


def _quantized(args: argparse.Namespace, device: torch.device) -> None:
    from ..studies.serving import quantization, trained

    plan = quantization.chapter_plan(device.type == "cuda")
    model = _gpt(args.model, args.kwargs, device,
                 lambda: trained.trained_gpt(plan.size, plan.steps, device).to(plan.dtype).eval(), "--model")
    models, skipped = quantization.variants(model, plan.group_size)
    for line in skipped:
        print(f"not run: {line}")
    prompt_len = check_count("--prompt-len", args.prompt_len or plan.prompt_len, 1, model.config.block_size - 2,
                             "the GPT's block holds the prompt and the new tokens")
    times = quantization.decode_times(models, args.batch or plan.batches[0], prompt_len,
                                      args.new_tokens or plan.new_tokens, args.rounds or plan.rounds)
    _print(quantization.layers_table(models), times.table())


def _speculative(args: argparse.Namespace, device: torch.device) -> None:
    from ..studies.serving import speculative, trained

    plan = speculative.chapter_plan(device.type == "cuda")

    def book(size: str, steps: int) -> GPT:
        return trained.trained_gpt(size, steps, device).to(plan.dtype).eval()

    target = _gpt(args.model, args.kwargs, device, lambda: book(plan.target, plan.target_steps), "--model")
    draft = None
    if args.draft or args.model is None:
        draft = _gpt(args.draft, args.kwargs, device, lambda: book(plan.draft, plan.draft_steps), "--draft")
    drafters = speculative.DRAFTERS if draft is not None else ("prompt lookup",)
    prompt = _prompt(target, args.prompt_len or plan.prompt_len)
    comparison = speculative.decode_comparison(target, draft, prompt, args.new_tokens or plan.new_tokens,
                                               tuple(args.ks or speculative.DRAFT_LENGTHS), drafters,
                                               args.rounds or plan.rounds, compiled=plan.compiled)
    _print(comparison.table().set_index("variant"))
    if comparison.caveat():
        print(comparison.caveat())


def _stream(args: argparse.Namespace, device: torch.device) -> None:
    from dataclasses import replace

    from ..core.gpt import text_data
    from ..studies.serving import batching, trained
    from ..studies.serving.requests import Objective

    setup = batching.setup_for(device)
    model = _gpt(args.model, args.kwargs, device,
                 lambda: trained.trained_gpt(setup.model, setup.train_steps, device).to(setup.dtype).eval(), "--model")
    for flag, value in (("--ttft-ms", args.ttft_ms), ("--tpot-ms", args.tpot_ms)):
        if value is not None and not 0 < value <= MAX_OBJECTIVE_MS:
            raise OptlabError(f"{flag} must be a positive number of milliseconds up to {MAX_OBJECTIVE_MS:g}, "
                              f"got {value:g}")
    objective = Objective(args.ttft_ms / 1e3 if args.ttft_ms is not None else setup.objective.ttft_s,
                          args.tpot_ms / 1e3 if args.tpot_ms is not None else setup.objective.tpot_s)
    setup = replace(setup, requests=args.requests or setup.requests, slots=args.slots or setup.slots,
                    rounds=args.rounds or setup.rounds, objective=objective)
    if setup.max_len > model.config.block_size:
        raise OptlabError(f"a request of the stream needs {setup.max_len} positions, more than the GPT's block of "
                          f"{model.config.block_size}")
    if args.rates is not None and not 1 <= len(args.rates) <= MAX_RATES:
        raise OptlabError(f"--rates takes 1 to {MAX_RATES} rates, got {len(args.rates)}")
    text = None
    if model.config.vocab_size == 65:
        text = text_data.text_datasets(block_size=1, vocab_size=model.config.vocab_size)[1].tokens
    streams = batching.stream_study(model, setup, text, rates=args.rates)
    print(streams.describe())
    if streams.warning():
        print(streams.warning())
    columns = ["values", "p50 ms", "p90 ms", "p99 ms", "p99 low", "p99 high", "pooled p99 ms"]
    _print(streams.served.latency_table()[columns], streams.served.throughput_table(), streams.served.verdicts())


def run(args: argparse.Namespace) -> None:
    """Run the study ``args.study`` names and print its tables."""
    if args.rounds is not None:
        check_count("--rounds", args.rounds, 2, MAX_ROUNDS, "paired rounds; an interval needs at least two")
    device = resolve_device(args.device).device
    studies = {"decode": _decode, "quantized": _quantized, "speculative": _speculative, "stream": _stream}
    studies[args.study](args, device)
