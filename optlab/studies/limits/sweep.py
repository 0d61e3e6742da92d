"""Timing a sweep of figures in rounds across the run, each figure's runs per block chosen once.

A figure is a statement, the globals it needs (built at each visit, so that one figure's tensors are held at a time,
unless its build keeps them: a CPU's bandwidth buffers, ``ceilings.bandwidth_figures``) and a switch it runs under. The
sweep first calibrates every figure once (:func:`runs_per_block`: a block grown 10x from one run until it lasts a tenth
of ``block_s``), and its runs per block are fixed at what fills ``block_s`` (at least one). Then each of ``rounds``
rounds visits every figure, in a seeded order shuffled anew each round, warms it with one run and times one block of
those runs with ``timeit`` on a clock that synchronizes a GPU (:func:`block_timer`). A figure's blocks are thus spread
over the whole sweep: the interval of their median covers what changed between the first round and the last (other work
starting or stopping, clocks, temperature), not one moment's blocks.

No block-size search is repeated (``blocked_autorange`` runs one on every call: 10x steps until the timer's overhead
is under 1e-4 of a block, seconds a call on a GPU), so the sweep's time is known once calibrated: per figure, its
calibration (a warm-up run and a few blocks, at least four runs) and ``rounds`` blocks of ``block_s`` or one run,
whichever is longer, each after one warm-up run.
"""
from __future__ import annotations

import contextlib
import random
import time
import timeit
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence

import torch

from ...core.machine import machine_load

CALIBRATION_SHARE = 10  # the calibration block lasts at least 1/10 of a block
CALIBRATION_TRIES = 3  # tries at each calibration size, the fastest kept
MAX_RUNS = 10**7  # runs per block at the most
BlockTimer = Callable[[str, dict, int], float]  # statement, globals, runs per block -> seconds per run of one block


@dataclass(frozen=True)
class Figure:
    """One figure of a sweep: what it is, its work per run (FLOPs, bytes or operations) and how to time it."""

    name: str
    dtype: str
    detail: str
    work: float
    build: Callable[[], tuple[str, dict]]  # the statement and fresh globals for one visit
    switch: Callable[[], ContextManager] = field(default=contextlib.nullcontext)  # e.g. TF32 on for "tf32"


@dataclass(frozen=True)
class Timed:
    """A figure's seconds per run, one per round's block, and the runs in each block."""

    figure: Figure
    seconds: list[float]
    runs: int


@dataclass(frozen=True)
class Sweep:
    """A sweep's timed figures, its rounds, its wall seconds and the machine's load over it."""

    timed: list[Timed]
    rounds: int
    seconds: float
    load: dict


def device_clock(device: torch.device) -> Callable[[], float]:
    """The block clock for ``device``: on a GPU it waits for the queued work before it reads the time (else a block
    would time the launches, not the work), on a CPU it reads the time."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


def block_timer(clock: Callable[[], float]) -> BlockTimer:
    """One block of ``runs`` runs on ``clock`` by Python's ``timeit`` (the loop ``torch.utils.benchmark.Timer.timeit``
    runs, without the warm-up of two runs or more it adds before every block: the sweep warms each visit once, and a
    slow figure's one-run block would cost three): seconds per run."""
    def timer(stmt: str, globals_: dict, runs: int) -> float:
        return timeit.Timer(stmt, globals=globals_, timer=clock).timeit(runs) / runs
    return timer


def runs_per_block(stmt: str, globals_: dict, block_s: float, timer: BlockTimer) -> int:
    """The runs that fill ``block_s`` seconds (the nearest count, at least one), from a calibration block that grows
    10x from one run until it lasts a tenth of ``block_s``, the fastest of ``CALIBRATION_TRIES`` at each size: once
    per figure, a few blocks' time, and steady on a busy machine, where one try that lost a time slice to other work
    would make every block a single run at the scheduler's mercy."""
    runs = 1
    while True:
        one_run_s = min(timer(stmt, globals_, runs) for _ in range(CALIBRATION_TRIES))
        if one_run_s * runs >= block_s / CALIBRATION_SHARE or runs >= MAX_RUNS:
            return max(1, min(MAX_RUNS, round(block_s / one_run_s))) if one_run_s > 0 else MAX_RUNS
        runs *= 10


def run(figures: Sequence[Figure], rounds: int, block_s: float, timer: BlockTimer, seed: int = 0) -> Sweep:
    """Calibrate each figure once, then time ``rounds`` rounds of one block per figure (see the module's text)."""
    start, began = machine_load.snapshot(), time.perf_counter()
    runs = []
    for figure in figures:
        with figure.switch():
            stmt, globals_ = figure.build()
            timer(stmt, globals_, 1)  # the warm-up: a visit's fresh operands, a first call's set-up
            runs.append(runs_per_block(stmt, globals_, block_s, timer))
    seconds: list[list[float]] = [[] for _ in figures]
    order = list(range(len(figures)))
    shuffle = random.Random(seed)
    for _ in range(rounds):
        shuffle.shuffle(order)
        for index in order:
            with figures[index].switch():
                stmt, globals_ = figures[index].build()
                timer(stmt, globals_, 1)  # the warm-up
                seconds[index].append(timer(stmt, globals_, runs[index]))
    load = machine_load.between(start, machine_load.snapshot())
    return Sweep([Timed(f, s, n) for f, s, n in zip(figures, seconds, runs)], rounds, time.perf_counter() - began,
                 load)
