"""Two ways to serve a stream of requests with a fixed number of batch slots: static and continuous batching.

The server runs on a simulated clock driven by real measured compute: every prefill and every decode step is run
and timed (the book's timer), and its measured duration advances the clock; requests arrive on that clock. The server
never sleeps while it waits for work: the clock jumps to the next arrival. So a CPU that computes for a few seconds
serves a stream of a hundred requests whose arrivals span as long as the compute does, and every latency is made of
measured compute and queueing, nothing else.

Both schedulers prefill each request alone (its prompt through the model into one row of the cache) and decode every
slot in each step (a fixed-shape batch, as CUDA graphs need): they differ only in when a slot is refilled.

- **static batching**: when the server is idle, the requests already waiting (up to the number of slots) form a
  batch; it decodes until its longest request is done, finished rows computing on with the rest, then the next batch
  forms. A request that arrives meanwhile waits for the whole batch.
- **continuous batching** (Orca's iteration-level scheduling, vLLM's default): between two decode steps, finished
  requests leave their slot and waiting requests are prefilled into the free ones, so a slot never idles while a
  request waits.

The engine is what runs the model: ``GPTEngine`` runs the book's GPT on a ``StaticKVCache`` with a row per
slot; tests drive the schedulers with a stand-in engine.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import pandas as pd
import torch

from ...core.errors import OptlabError, choice_error
from ...core.knobs.limits import check_count
from ...core.process.quiet import fix_threads
from ...core.stats.sequential import visit_order
from ...core.measuring.timing import StepTimer, speed_up
from ...core.gpt.transformer import GPT
from . import generation
from .requests import Objective, Request, Served, latency_frame, round_percentiles, throughput

SCHEDULERS = ("static", "continuous")
MAX_ROUNDS = 100
WARMUP_REQUESTS = 8  # served once by each scheduler before the timed rounds
T = TypeVar("T")
Timer = Callable[[Callable[[], Any]], "tuple[Any, float]"]  # runs a function: its result and its seconds


class Engine(Protocol):
    """What a scheduler needs from a model: ``slots`` rows of a cache ``max_len`` tokens long."""

    slots: int
    max_len: int
    device: torch.device

    def prefill(self, slot: int, prompt: tuple[int, ...]) -> int:
        """Run ``prompt`` alone, put its keys and values into row ``slot`` and return its first output token."""

    def decode(self, tokens: list[int], occupied: list[bool]) -> list[int]:
        """One decode step of every row on its last token; rows not ``occupied`` are computed and rolled back (the
        step leaves them as they were)."""

    def release(self, slots: list[int]) -> None:
        """Empty rows ``slots`` (their lengths back to 0) for the next requests."""


def measured(device: torch.device) -> "Callable[[Callable[[], Any]], tuple[Any, float]]":
    """A timer that runs a function and returns its result and its seconds on ``device`` (synchronized on CUDA)."""
    def timer(function: Callable[[], T]) -> tuple[T, float]:
        clock = StepTimer(device)
        clock.start()
        result = function()
        clock.mark()
        return result, clock.finish()[0][0]
    return timer


@dataclass
class ServeRun:
    """A served stream: every request with its tokens and their times, and what each decode step held."""

    scheduler: str
    slots: int
    served: list[Served]
    occupancy: list[int]  # requests still generating in each decode step
    compute_s: float  # the clock's time spent computing (the rest waited for arrivals)

    @property
    def mean_occupancy(self) -> float:
        return sum(self.occupancy) / len(self.occupancy) if self.occupancy else 0.0


class _Server:
    """The clock and the bookkeeping both schedulers share."""

    def __init__(self, engine: Engine, requests: list[Request], timer: Timer) -> None:
        self.engine, self.timer = engine, timer
        self.pending = deque(sorted(requests, key=lambda request: request.arrival_s))
        self.clock = self.compute_s = 0.0
        self.finished: list[Served] = []
        self.occupancy: list[int] = []

    def run(self, function: Callable[[], T]) -> T:
        result, seconds = self.timer(function)
        self.clock += seconds
        self.compute_s += seconds
        return result

    def wait_for_arrival(self) -> None:
        if self.pending and self.pending[0].arrival_s > self.clock:
            self.clock = self.pending[0].arrival_s

    def arrived(self) -> bool:
        return bool(self.pending) and self.pending[0].arrival_s <= self.clock

    def prefill(self, slot: int, request: Request) -> Served:
        item = Served(request)
        item.emit(self.run(lambda: self.engine.prefill(slot, request.prompt)), self.clock)
        return item

    def decode(self, rows: dict[int, Served]) -> None:
        """One step of every slot; each request in ``rows`` (those still generating) receives its next token; the
        other rows are computed too (the batch has a fixed shape) and left as they were."""
        slots = self.engine.slots
        tokens = [rows[slot].tokens[-1] if slot in rows else 0 for slot in range(slots)]
        outputs = self.run(lambda: self.engine.decode(tokens, [slot in rows for slot in range(slots)]))
        self.occupancy.append(len(rows))
        for slot, item in rows.items():
            item.emit(outputs[slot], self.clock)


def _generating(rows: dict[int, Served]) -> dict[int, Served]:
    return {slot: item for slot, item in rows.items() if not item.done}


def _static(server: _Server) -> None:
    slots = server.engine.slots
    while server.pending:
        server.wait_for_arrival()
        batch: dict[int, Served] = {}
        while len(batch) < slots and server.arrived():
            slot = len(batch)
            batch[slot] = server.prefill(slot, server.pending.popleft())
        while _generating(batch):
            server.decode(_generating(batch))
        server.finished.extend(batch.values())
        server.engine.release(list(batch))


def _continuous(server: _Server) -> None:
    slots = server.engine.slots
    active: dict[int, Served] = {}
    while server.pending or active:
        if not active:
            server.wait_for_arrival()
        free = [slot for slot in range(slots) if slot not in active]
        while free and server.arrived():
            slot = free.pop(0)
            active[slot] = server.prefill(slot, server.pending.popleft())
        if _generating(active):
            server.decode(_generating(active))
        done = [slot for slot, item in active.items() if item.done]
        server.finished.extend(active.pop(slot) for slot in done)
        if done:
            server.engine.release(done)


def serve(requests: list[Request], engine: Engine, scheduler: str,
          timer: "Callable[[Callable[[], Any]], tuple[Any, float]] | None" = None) -> ServeRun:
    """Serve ``requests`` on ``engine`` by the ``scheduler`` named ("static" or "continuous"); ``timer`` measures
    each prefill and decode step (the book's timer on the engine's device unless given)."""
    if scheduler not in SCHEDULERS:
        raise choice_error("scheduler", scheduler, SCHEDULERS)
    if not requests:
        raise OptlabError("serve needs at least one request")
    longest = max(len(request.prompt) + request.output_len for request in requests)
    if longest > engine.max_len:
        raise OptlabError(f"a request needs {longest} positions (prompt and output), more than the engine's cache "
                          f"holds ({engine.max_len}): shorten the stream's lengths or build a longer cache")
    server = _Server(engine, requests, timer or measured(engine.device))
    (_static if scheduler == "static" else _continuous)(server)
    served = sorted(server.finished, key=lambda item: item.request.index)
    return ServeRun(scheduler, engine.slots, served, server.occupancy, server.compute_s)


class GPTEngine:
    """The book's GPT serving ``slots`` requests at once from one ``StaticKVCache`` (a row per slot).

    A prefill runs the prompt alone through a one-row cache and copies the row into its slot (``load_row``); a decode
    step runs every row on its last token, greedy, and rolls back the rows no request holds (``truncate``); a request
    that leaves empties its row (``reset_rows``).
    ``compiled`` runs the decode step through ``generation.compiled_decode`` (CUDA graphs on a GPU)."""

    def __init__(self, model: GPT, slots: int, max_len: int, compiled: bool = False) -> None:
        self.model, self.slots, self.max_len, self.compiled = model, slots, max_len, compiled
        self.device = model.token_embedding.weight.device
        self.cache = generation.StaticKVCache(model, slots, max_len)
        self.row = generation.StaticKVCache(model, 1, max_len)
        self.step = generation.compiled_decode(self.device) if compiled else None

    @torch.no_grad()
    def prefill(self, slot: int, prompt: tuple[int, ...]) -> int:
        self.row.reset_rows(0)
        tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
        logits = generation.forward_cached(self.model, tokens, self.row)
        self.cache.load_row(slot, self.row)
        return int(logits[0, -1].argmax())

    @torch.no_grad()
    def decode(self, tokens: list[int], occupied: list[bool]) -> list[int]:
        last = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        before = self.cache.lengths.clone()
        if self.step is None:
            logits = generation.forward_cached(self.model, last, self.cache)[:, -1]
        else:
            torch.compiler.cudagraph_mark_step_begin()
            logits = self.step(self.model, last, self.cache)
            self.cache.longest += 1
        held = torch.tensor(occupied, device=self.device)
        self.cache.truncate(torch.where(held, self.cache.lengths, before))
        return logits.argmax(dim=-1).tolist()

    def release(self, slots: list[int]) -> None:
        if slots:
            self.cache.reset_rows(slots)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the slots' keys and values (the one-row prefill cache aside)."""
        return self.cache.nbytes


def capacity(engine: Engine, requests: list[Request],
             timer: "Callable[[Callable[[], Any]], tuple[Any, float]] | None" = None) -> float:
    """Requests a second the engine serves by continuous batching when every request of ``requests`` is waiting at
    once: the most it can take, which sets the arrival rates worth trying."""
    fix_threads(engine.device.type == "cuda")
    waiting = [Request(request.index, 0.0, request.prompt, request.output_len) for request in requests]
    run = serve(waiting, engine, "continuous", timer)
    return len(waiting) / run.compute_s


@dataclass
class ServingStudy:
    """Both schedulers serving the same stream at each rate, in paired rounds (the same requests every round), and
    the capacity measured in each round between the streams."""

    rates: list[float]
    runs: dict[tuple[float, str], list[ServeRun]]  # per (rate, scheduler): one run per round
    slot_shifts: dict[float, list[int]]  # per rate: continuous's slot minus static's in each round
    objective: Objective
    cache_bytes: int
    capacities: list[float] = field(default_factory=list)  # requests/s, one per round, measured between the streams

    def round_latencies(self, rate: float, scheduler: str) -> list[pd.DataFrame]:
        """Each round's requests, one row per request (``latency_frame``)."""
        return [latency_frame(run.served) for run in self.runs[(rate, scheduler)]]

    def latency_table(self) -> pd.DataFrame:
        """TTFT, TPOT, end-to-end latency and ITL at p50/p90/p99 for every rate and scheduler: each percentile over
        each round's requests, its median over the rounds with the rounds' range, and the pooled percentile over all
        rounds' requests (``requests.round_percentiles``)."""
        parts = [round_percentiles([run.served for run in self.runs[(rate, name)]]).assign(rate=rate, scheduler=name)
                 for rate in self.rates for name in SCHEDULERS]
        return pd.concat(parts).set_index(["rate", "scheduler", "metric"])

    def met_share(self, rate: float, scheduler: str) -> float:
        """The share of requests that met the objective at ``rate``, over all its rounds."""
        return float(pd.concat([self.objective.met(frame) for frame in self.round_latencies(rate, scheduler)]).mean())

    def throughput_table(self) -> pd.DataFrame:
        """Per rate and scheduler, medians over the rounds: output tokens a second, requests a second, goodput under
        the objective and the share of requests that met it, the mean batch a decode step held, and the KV cache."""
        rows = []
        for rate in self.rates:
            for name in SCHEDULERS:
                runs = self.runs[(rate, name)]
                results = pd.DataFrame([throughput(latency_frame(run.served), self.objective) for run in runs])
                rows.append({"rate": rate, "scheduler": name, **results.median().to_dict(),
                             "mean batch": float(np.median([run.mean_occupancy for run in runs])),
                             "KV cache MiB": self.cache_bytes / 2**20})
        return pd.DataFrame(rows).set_index(["rate", "scheduler"])

    def verdicts(self) -> pd.DataFrame:
        """Per rate: the mean end-to-end latency of each scheduler (median over rounds) and static's over
        continuous's with the book's interval and verdict ("faster": continuous batching serves sooner)."""
        rows = []
        for rate in self.rates:
            means = {name: [float(latency_frame(run.served)["e2e_s"].mean()) for run in self.runs[(rate, name)]]
                     for name in SCHEDULERS}
            result = speed_up(means["static"], means["continuous"], self.slot_shifts[rate])
            rows.append({"rate": rate, "rounds": len(means["static"]),
                         "static mean E2E ms": 1e3 * float(np.median(means["static"])),
                         "continuous mean E2E ms": 1e3 * float(np.median(means["continuous"])),
                         "speed-up": result.ratio, "low": result.low, "high": result.high, "verdict": result.verdict})
        return pd.DataFrame(rows).set_index("rate")


def compare_schedulers(engine: Engine, streams: dict[float, list[Request]], objective: Objective, rounds: int = 4,
                       timer: "Callable[[Callable[[], Any]], tuple[Any, float]] | None" = None,
                       capacity_requests: "list[Request] | None" = None) -> ServingStudy:
    """Serve each rate's stream by both schedulers in ``rounds`` rounds, after a warm-up run of each on the first
    stream's first ``WARMUP_REQUESTS`` requests (not kept). Each round visits every rate, the two schedulers in the
    book's mirrored order, and (with ``capacity_requests``) first measures the capacity on them, so that the capacity
    and the streams share the machine's moments. ``objective`` is fixed before the first stream."""
    rounds = check_count("rounds", rounds, 2, MAX_ROUNDS, "an interval needs two rounds; a dozen are plenty")
    if not streams:
        raise OptlabError("compare_schedulers needs at least one rate's stream")
    fix_threads(engine.device.type == "cuda")
    first = next(iter(streams.values()))[:WARMUP_REQUESTS]
    for name in SCHEDULERS:
        serve(first, engine, name, timer)
    runs: dict[tuple[float, str], list[ServeRun]] = {(rate, name): [] for rate in streams for name in SCHEDULERS}
    shifts: dict[float, list[int]] = {rate: [] for rate in streams}
    capacities: list[float] = []
    for round_index in range(rounds):
        if capacity_requests:
            capacities.append(capacity(engine, capacity_requests, timer))
        order = visit_order(list(SCHEDULERS), round_index)
        for rate, stream in streams.items():
            for name in order:
                runs[(rate, name)].append(serve(stream, engine, name, timer))
            shifts[rate].append(order.index("continuous") - order.index("static"))
    cache_bytes = getattr(engine, "cache_bytes", 0)
    return ServingStudy(list(streams), runs, shifts, objective, cache_bytes, capacities)
