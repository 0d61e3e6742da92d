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

The engine is what runs the model: :class:`GPTEngine` runs the book's GPT on a ``StaticKVCache`` with a row per
slot; tests drive the schedulers with a stand-in engine.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from ...core.errors import OptlabError, choice_error
from ...core.timing import StepTimer
from .requests import Request, Served

SCHEDULERS = ("static", "continuous")
T = TypeVar("T")
Timer = Callable[[Callable[[], object]], tuple[object, float]]  # runs a function: its result and its seconds


class Engine(Protocol):
    """What a scheduler needs from a model: ``slots`` rows of a cache ``max_len`` tokens long."""

    slots: int
    max_len: int
    device: torch.device

    def prefill(self, slot: int, prompt: tuple[int, ...]) -> int:
        """Run ``prompt`` alone, put its keys and values into row ``slot`` and return its first output token."""

    def decode(self, tokens: list[int], occupied: list[bool]) -> list[int]:
        """One decode step of every row on its last token; rows not ``occupied`` are computed and then emptied."""

    def release(self, slots: list[int]) -> None:
        """Empty rows ``slots`` (their lengths back to 0) for the next requests."""


def measured(device: torch.device) -> Timer:
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
        """One step of every slot; each request in ``rows`` (those still generating) receives its next token, and
        the other rows are emptied (a finished request's row computes on, as the fixed-shape batch does)."""
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


def serve(requests: list[Request], engine: Engine, scheduler: str, timer: Timer | None = None) -> ServeRun:
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
