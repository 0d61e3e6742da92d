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
from .scheduler import SCHEDULERS, GPTEngine, ServingStudy, capacity, compare_schedulers
from .trained import trained_gpt

MAX_BATCH = 1024
MAX_STEPS = 1000
MAX_ROUNDS = 100
MET_WARNING = 0.9  # below this share of requests meeting the objective at the lowest rate, the page warns


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
    objective: Objective  # goodput's, in seconds: absolute, fixed before any stream, the same at every rate

    @property
    def max_len(self) -> int:
        return self.prompt_lengths[1] + self.output_lengths[1]


SETUPS = {
    "cpu": Setup("gpt_tiny", 200, torch.float32, False, (1, 2, 4, 8, 16), 32, 16, 10, 8, 30, (8, 24), (2, 16),
                 (0.3, 0.8, 1.5), 4, Objective(ttft_s=0.1, tpot_s=0.015)),
    "cuda": Setup("gpt2_small", 300, torch.bfloat16, True, (1, 2, 4, 8, 16, 32, 64), 128, 16, 10, 32, 120,
                  (32, 256), (16, 96), (0.3, 0.8, 1.5), 6, Objective(ttft_s=0.2, tpot_s=0.02)),
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
    """The served streams: the capacity that set the rates (measured before them), the rates, the objective and both
    schedulers' runs, with the capacity measured again in every round between the streams."""

    calibration: float  # requests a second continuous batching serves with every request waiting, before the streams
    rates: list[float]
    objective: Objective
    served: ServingStudy
    requests: list[Request]  # the stream's requests (the same at every rate)

    @property
    def capacity(self) -> float:
        """The capacity measured between the streams: the median over the rounds."""
        return float(np.median(self.served.capacities))

    def describe(self) -> str:
        """The objective, the rates and the capacities, in one line."""
        low, high = min(self.served.capacities), max(self.served.capacities)
        return (f"objective (fixed before the streams): TTFT <= {1e3 * self.objective.ttft_s:g} ms and TPOT <= "
                f"{1e3 * self.objective.tpot_s:g} ms; rates {self.rates} requests/s, set from a capacity of "
                f"{self.calibration:.1f} requests/s measured before the streams; measured between them, round by "
                f"round: {self.capacity:.1f} (from {low:.1f} to {high:.1f})")

    def warning(self) -> str | None:
        """A warning when fewer than ``MET_WARNING`` of the requests met the objective at the lowest rate (the
        objective, or the machine's load, then decides goodput more than the scheduler does); None otherwise."""
        lowest = min(self.rates)
        missed = {name: share for name in SCHEDULERS if (share := self.served.met_share(lowest, name)) < MET_WARNING}
        if not missed:
            return None
        shares = ", ".join(f"{name} {100 * share:.0f} %" for name, share in missed.items())
        return (f"Warning: at the lowest rate ({lowest} requests/s) fewer than {100 * MET_WARNING:.0f} % of the "
                f"requests met the objective ({shares}): the machine is slower or busier than the objective assumes, "
                "so goodput here measures the machine more than the schedulers.")


def stream_study(model: GPT, setup: Setup, text: "torch.Tensor | None", seed: int = 0,
                 rates: "list[float] | None" = None) -> StreamStudy:
    """Both schedulers on a stream of ``setup.requests`` requests (prompts cut from ``text``, random tokens without
    it) at ``rates`` (requests/s), by default the shares ``setup.load`` of the capacity measured first, under
    ``setup.objective``; the capacity is measured again at the start of every round, between the streams."""
    engine = GPTEngine(model, setup.slots, setup.max_len, compiled=setup.compiled)
    vocab = model.config.vocab_size

    def stream(rate: float) -> list[Request]:
        return poisson_stream(rate, setup.requests, setup.prompt_lengths, setup.output_lengths, vocab, seed, text)

    most = capacity(engine, stream(1.0))
    rates = list(rates) if rates else [round(share * most, 1) for share in setup.load]
    served = compare_schedulers(engine, {rate: stream(rate) for rate in rates}, setup.objective, setup.rounds,
                                capacity_requests=stream(1.0))
    return StreamStudy(most, rates, setup.objective, served, stream(1.0))


def run_reference(out: "str | Path", device: str = "cuda") -> list[Path]:
    """The chapter's GPU measurement (``setup_for`` the device): the decode sweep and both schedulers at three rates,
    saved under ``out`` as ``serving-*.csv``."""
    info = resolve_device(device)
    setup = setup_for(info.device)
    model = trained_gpt(setup.model, setup.train_steps, info.device).to(setup.dtype)
    text = text_data.text_datasets(block_size=1, vocab_size=model.config.vocab_size)[1].tokens
    sweep = decode_sweep(model, (*setup.batch_sizes, setup.slots), setup.context, setup.sweep_steps,
                         setup.sweep_rounds, compiled=setup.compiled)
    study = stream_study(model, setup, text)
    tables = {"decode-sweep": sweep.table(), "latency": study.served.latency_table(),
              "throughput": study.served.throughput_table(), "verdicts": study.served.verdicts()}
    folder, paths = store.writable_dir(out), []
    for name, table in tables.items():
        paths.append(folder / f"serving-{name}.csv")
        store.atomic_write_text(paths[-1], table.reset_index().to_csv(index=False))
    return paths


def stored_summary(reference_dir: "str | Path | None" = None) -> pd.DataFrame | None:
    """The serving figures of every stored GPU run (``run_reference``'s tables), compact, one row per machine and
    figure: decode tokens/s at batch 1 and at the sweep's largest batch, and continuous batching's TTFT and TPOT at
    p50 and p99 at the lowest rate. Columns: machine, figure, value, unit. None when no run is stored."""
    sweep = store.reference_tables("serving-decode-sweep", reference_dir)
    latency = store.reference_tables("serving-latency", reference_dir)
    if sweep is None and latency is None:
        return None
    rows = []
    for machine, table in ([] if sweep is None else sweep.groupby("machine")):
        for batch in sorted({int(table["batch"].min()), int(table["batch"].max())}):
            value = float(table.loc[table["batch"] == batch, "tokens/s"].iloc[0])
            rows.append({"machine": machine, "figure": f"decode tokens/s, batch {batch}", "value": value,
                         "unit": "tokens/s"})
    for machine, table in ([] if latency is None else latency.groupby("machine")):
        lowest = table[(table["rate"] == table["rate"].min()) & (table["scheduler"] == "continuous")]
        for metric in ("TTFT", "TPOT"):
            for q in ("p50", "p99"):
                value = lowest.loc[lowest["metric"] == metric, f"{q} ms"]
                if len(value):
                    rows.append({"machine": machine, "figure": f"{metric} {q}, continuous batching at "
                                 f"{lowest['rate'].iloc[0]:g} requests/s", "value": float(value.iloc[0]), "unit": "ms"})
    return pd.DataFrame(rows, columns=["machine", "figure", "value", "unit"])
