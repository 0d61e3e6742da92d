"""The decode batch-size sweep: tokens a second against time per output token, as the batch grows.

A decode step reads every weight once whatever the batch, so while a step is bound by reading weights (or, for a small
model, by launching its kernels) a batch of ``B`` rows costs little more than one row: throughput grows nearly ``B``
times and each request's time per output token (TPOT, one step) barely moves. Once the step is bound by compute, a
larger batch only makes each step longer. Every batch size gets its own ``StaticKVCache`` of ``B`` rows, filled by a
prefill of ``context`` tokens a row; then in each round every size, in the book's mirrored visiting order, times
``steps`` decode steps (the book's timer) from that same context. Each size's throughput is compared with batch 1's
round by round (the book's interval and verdict), and so is its TPOT.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ...core.results import store
from ...core.gpt import text_data
from ...core.machine.device import resolve_device
from ...core.knobs.limits import check_count
from ...core.process.quiet import fix_threads
from ...core.stats.sequential import visit_order
from ...core.measuring.timing import StepTimer, speed_up
from ...core.gpt.transformer import GPT
from . import generation
from .requests import Objective, Request, poisson_stream
from .scheduler import GPTEngine, ServingStudy, capacity, compare_schedulers
from .trained import trained_gpt

MAX_BATCH = 1024
MAX_STEPS = 1000
MAX_ROUNDS = 100
OBJECTIVE_STEPS = (20, 2)  # goodput's objective: TTFT and TPOT within this many full-batch decode steps


@dataclass(frozen=True)
class Setup:
    """The sizes of the serving chapter on one kind of device: the model, the sweep and the stream."""

    model: str  # a size of ``trained.SERVING_SIZES``
    train_steps: int
    dtype: torch.dtype
    compiled: bool  # decode through CUDA graphs (``generation.compiled_decode``)
    batch_sizes: tuple[int, ...]  # the decode sweep's
    context: int  # tokens each row holds when the sweep's steps start
    sweep_steps: int
    sweep_rounds: int
    slots: int  # the server's batch
    requests: int  # in each rate's stream
    prompt_lengths: tuple[int, int]
    output_lengths: tuple[int, int]
    load: tuple[float, ...]  # arrival rates as fractions of the measured capacity
    rounds: int  # paired rounds of the two schedulers at each rate

    @property
    def max_len(self) -> int:
        return self.prompt_lengths[1] + self.output_lengths[1]


SETUPS = {
    "cpu": Setup("gpt_tiny", 200, torch.float32, False, (1, 2, 4, 8, 16), 32, 16, 10, 8, 30, (8, 24), (2, 16),
                 (0.3, 0.8, 1.5), 4),
    "cuda": Setup("gpt2_small", 300, torch.bfloat16, True, (1, 2, 4, 8, 16, 32, 64), 128, 16, 10, 32, 120,
                  (32, 256), (16, 96), (0.3, 0.8, 1.5), 6),
}


def setup_for(device: torch.device) -> Setup:
    """The chapter's sizes on ``device``: the tiny GPT in fp32 on a CPU, GPT-2 small in bf16 with CUDA graphs on a
    GPU."""
    return SETUPS["cuda" if device.type == "cuda" else "cpu"]


def label(batch: int) -> str:
    return f"batch {batch}"


@dataclass
class DecodeSweep:
    """Each batch size's mean decode step in each round, where it ran in the round, and its KV cache's bytes."""

    context: int
    round_times_s: dict[int, list[float]]
    slot_shifts: dict[int, list[int]]  # how many slots after batch 1 each size ran in each round
    cache_bytes: dict[int, int]

    def step_s(self, batch: int) -> float:
        """The median over the rounds of the mean decode step (the TPOT a request sees at this batch)."""
        return float(np.median(self.round_times_s[batch]))

    def table(self) -> pd.DataFrame:
        """Per batch size: TPOT, tokens a second, KV cache MiB, throughput and TPOT against batch 1 with intervals
        and verdicts (a TPOT "speed-up" below 1 means each request's tokens come slower)."""
        rows = []
        single = self.round_times_s[1]
        for batch, times in self.round_times_s.items():
            row = {"batch": batch, "rounds": len(times), "TPOT ms": 1e3 * self.step_s(batch),
                   "tokens/s": batch / self.step_s(batch), "KV cache MiB": self.cache_bytes[batch] / 2**20}
            if batch == 1:
                rows.append(row | {"throughput x": 1.0, "verdict": "reference", "TPOT x": 1.0,
                                   "TPOT verdict": "reference"})
                continue
            shifts = self.slot_shifts[batch]
            gain = speed_up(np.asarray(single), np.asarray(times) / batch, shifts)
            tpot = speed_up(single, times, shifts)
            rows.append(row | {"throughput x": gain.ratio, "low": gain.low, "high": gain.high, "verdict": gain.verdict,
                               "TPOT x": tpot.ratio, "TPOT low": tpot.low, "TPOT high": tpot.high,
                               "TPOT verdict": tpot.verdict})
        return pd.DataFrame(rows).set_index("batch")

    def speedups(self) -> pd.DataFrame:
        """Throughput against batch 1 as tidy rows in the columns ``optlab.book.report.plot_speedups`` reads."""
        table = self.table().drop(index=1)
        return pd.DataFrame({"model": "GPT", "phase": "decode", "variant": [label(b) for b in table.index],
                             "source": "live", "speedup": table["throughput x"].to_numpy(),
                             "ci_low": table["low"].to_numpy(), "ci_high": table["high"].to_numpy(),
                             "verdict": table["verdict"].to_numpy(), "role": None, "versus": label(1)})


def _filled_engine(model: GPT, batch: int, context: int, steps: int, generator: torch.Generator,
                   compiled: bool) -> GPTEngine:
    """An engine of ``batch`` rows, each holding ``context`` tokens of its own (random) prompt."""
    engine = GPTEngine(model, batch, context + steps + 1, compiled)
    prompt = torch.randint(0, model.config.vocab_size, (batch, context), generator=generator).to(engine.device)
    with torch.no_grad():
        generation.forward_cached(model, prompt, engine.cache)
    return engine


def _time_steps(engine: GPTEngine, context: int, steps: int) -> float:
    """The mean of ``steps`` decode steps of every row from ``context`` tokens (the rows rolled back after)."""
    tokens, occupied = [0] * engine.slots, [True] * engine.slots
    timer = StepTimer(engine.device)
    timer.start()
    for _ in range(steps):
        tokens = engine.decode(tokens, occupied)
        timer.mark()
    seconds, _ = timer.finish()
    engine.cache.truncate(context)
    return float(np.mean(seconds))


def decode_sweep(model: GPT, batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16), context: int = 32, steps: int = 8,
                 rounds: int = 6, compiled: bool = False, seed: int = 0) -> DecodeSweep:
    """Time ``steps`` greedy decode steps at each batch size (batch 1 always included) after ``context`` cached
    tokens a row, in ``rounds`` rounds after one warm-up round (not kept); ``compiled`` decodes through
    ``generation.compiled_decode`` (CUDA graphs on a GPU)."""
    sizes = sorted({1, *(check_count("batch size", b, 1, MAX_BATCH, "rows of one KV cache") for b in batch_sizes)})
    steps = check_count("steps", steps, 1, MAX_STEPS, "decode steps a round")
    rounds = check_count("rounds", rounds, 2, MAX_ROUNDS, "an interval needs two rounds; a few dozen are plenty")
    context = check_count("context", context, 1, model.config.block_size - steps - 1,
                          f"the GPT's block of {model.config.block_size} holds the context and {steps} steps")
    fix_threads(next(model.parameters()).device.type == "cuda")
    generator = torch.Generator().manual_seed(seed)
    engines = {label(b): _filled_engine(model, b, context, steps, generator, compiled) for b in sizes}
    times: dict[int, list[float]] = {b: [] for b in sizes}
    shifts: dict[int, list[int]] = {b: [] for b in sizes}
    for round_index in range(rounds + 1):  # round 0 warms every size up (and compiles it) and is not kept
        order = visit_order(list(engines), round_index)
        for name in order:
            seconds = _time_steps(engines[name], context, steps)
            if round_index:
                batch = int(name.split()[-1])
                times[batch].append(seconds)
                shifts[batch].append(order.index(name) - order.index(label(1)))
    return DecodeSweep(context, times, shifts, {b: engines[label(b)].cache_bytes for b in sizes})


@dataclass
class StreamStudy:
    """The served streams: the capacity that set the rates, the rates, the objective and both schedulers' runs."""

    capacity: float  # requests a second continuous batching serves with every request waiting
    rates: list[float]
    objective: Objective
    served: ServingStudy
    requests: list[Request]  # the stream's requests (the same at every rate)


def stream_study(model: GPT, setup: Setup, sweep: DecodeSweep, text: torch.Tensor, seed: int = 0) -> StreamStudy:
    """Both schedulers on a stream of ``setup.requests`` requests (prompts cut from ``text``) at the rates
    ``setup.load`` of the measured capacity, the objective ``OBJECTIVE_STEPS`` full-batch steps of ``sweep``."""
    engine = GPTEngine(model, setup.slots, setup.max_len, compiled=setup.compiled)
    vocab = model.config.vocab_size

    def stream(rate: float) -> list[Request]:
        return poisson_stream(rate, setup.requests, setup.prompt_lengths, setup.output_lengths, vocab, seed, text)

    most = capacity(engine, stream(1.0))
    rates = [round(share * most, 1) for share in setup.load]
    step = sweep.step_s(setup.slots)
    objective = Objective(ttft_s=OBJECTIVE_STEPS[0] * step, tpot_s=OBJECTIVE_STEPS[1] * step)
    served = compare_schedulers(engine, {rate: stream(rate) for rate in rates}, objective, setup.rounds)
    return StreamStudy(most, rates, objective, served, stream(1.0))


def run_reference(out: "str | Path", device: str = "cuda") -> list[Path]:
    """The chapter's GPU measurement (``setup_for`` the device): the decode sweep and both schedulers at three rates,
    saved under ``out`` as ``serving-*.csv``."""
    info = resolve_device(device)
    setup = setup_for(info.device)
    model = trained_gpt(setup.model, setup.train_steps, info.device).to(setup.dtype)
    text = text_data.text_datasets(block_size=1, vocab_size=model.config.vocab_size)[1].tokens
    sweep = decode_sweep(model, (*setup.batch_sizes, setup.slots), setup.context, setup.sweep_steps,
                         setup.sweep_rounds, compiled=setup.compiled)
    study = stream_study(model, setup, sweep, text)
    tables = {"decode-sweep": sweep.table(), "latency": study.served.latency_table(),
              "throughput": study.served.throughput_table(), "verdicts": study.served.verdicts()}
    folder, paths = store.writable_dir(out), []
    for name, table in tables.items():
        paths.append(folder / f"serving-{name}.csv")
        store.atomic_write_text(paths[-1], table.reset_index().to_csv(index=False))
    return paths
