"""`make noise`: the round-level noise of an A/A comparison as optlab times it, and without each jitter guard.

The noise of one run is the standard deviation of the per-round log ratio of two copies of one configuration
(smoke profile, ResNet18 or, with ``--workload gpt``, the tiny GPT; a fixed number of rounds): the quantity the
verdict rule's interval is built from. The settings take turns, run after run, so that a drift of the machine hits
each alike:

- ``as set``: optlab's defaults (``OPTLAB_THREADS``, else one thread on a CPU);
- ``a thread per core``: one intra-op thread per core of the machine;
- ``collector paused``: garbage collected before each timed pass and the collector off during it.

Each line gives the median noise over the runs (and its interquartile range), with every round and without each
run's first round (what a discarded warm-up round would remove). Run it on a quiet machine:
``PYTHONPATH=. python benchmarks/noise.py --runs 12 --rounds 12`` (``--settings`` picks some of them).

``--shapes`` times other round shapes, written ``W+S``: W untimed warm-up steps and S timed steps per variant and
round (lockstep rounds take their warm-up steps in a model's first round only) (the smoke profile's is 1+3: its in-process copies run in lockstep). Each line then also gives the seconds a round took and what the rule gets per
second, rounds / noise^2 / seconds (the interval's half-width falls as noise / sqrt(rounds)): the shape with the most
tells the most in a fixed time budget.
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import replace
import gc
import io
import os
import sys
import time
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from optlab.core.measuring import loops
from optlab.core.process import quiet
from optlab.core.run.experiments import run_experiment
from optlab.core.knobs.limits import MAX_STEPS, cpu_cores
from optlab.core.knobs.profiles import get_profile
from optlab.core.techniques.registry import Experiment
from optlab.core.workload import WORKLOADS

A_A_VARIANTS = (("A", {}), ("A again", {}))
MAX_RUNS, MAX_ROUNDS = 100, 100


@contextlib.contextmanager
def as_set() -> Iterator[None]:
    yield


@contextlib.contextmanager
def every_core() -> Iterator[None]:
    before = os.environ.get(quiet.THREADS_ENV)
    os.environ[quiet.THREADS_ENV] = str(cpu_cores())
    try:
        yield
    finally:
        os.environ.pop(quiet.THREADS_ENV) if before is None else os.environ.update({quiet.THREADS_ENV: before})


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The timed loop with garbage collected before each pass and the collector off while any pass runs (lockstep
    passes overlap), a candidate that did not lower the noise when measured, so optlab's loop does not do it."""
    timed, running = loops.timed_pass, [0]

    def paused(*args, **kwargs):
        gc.collect()
        gc.disable()
        running[0] += 1
        try:
            return (yield from timed(*args, **kwargs))
        finally:
            running[0] -= 1
            if not running[0]:
                gc.enable()

    loops.timed_pass = paused
    try:
        yield
    finally:
        loops.timed_pass = timed


SETTINGS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "as set": as_set, "a thread per core": every_core, "collector paused": collector_paused}


def round_noise(samples: pd.DataFrame, skip_first: bool = False) -> dict[str, float]:
    """Per phase: the standard deviation of the per-round log ratio of the two copies (``skip_first``: without the
    first round)."""
    noise = {}
    for phase, rows in samples[samples["status"] == "ok"].groupby("phase"):
        times = rows.pivot(index="repeat", columns="variant", values="epoch_equiv_s").sort_index()
        if skip_first:
            times = times.iloc[1:]
        noise[phase] = float(np.log(times["A"] / times["A again"]).std(ddof=1))
    return noise


def round_shape(text: str) -> tuple[int, int]:
    """``"W+S"`` as (warm-up steps, timed steps): W from 0, S from 1, each at most ``MAX_STEPS``."""
    try:
        warmup, steps = (int(part) for part in text.split("+"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a round shape is W+S (warm-up + timed steps, e.g. 1+1), got {text!r}")
    if not (0 <= warmup <= MAX_STEPS and 1 <= steps <= MAX_STEPS):
        raise argparse.ArgumentTypeError(f"a round shape needs 0-{MAX_STEPS} warm-up and 1-{MAX_STEPS} timed steps, "
                                         f"got {text!r}")
    return warmup, steps


def a_a_experiment(workload: str) -> tuple[Experiment, str]:
    """Two copies of one configuration of ``workload``, and the model the smoke profile runs it on."""
    experiment = Experiment("a_a_noise", "the same configuration twice", "", variants=A_A_VARIANTS, workload=workload)
    return experiment, experiment.default_models(get_profile("smoke"))[0]


def measure(runs: int, rounds: int, settings: "list[str] | None" = None, seed: int = 0,
            shapes: "list[tuple[int, int]] | None" = None, workload: str = "cifar") -> pd.DataFrame:
    """Tidy noise: one row per run, setting, round shape (warm-up + timed steps), phase and whether the first round
    is kept, with the seconds a round took."""
    settings = settings or list(SETTINGS)
    smoke = get_profile("smoke")
    experiment, model = a_a_experiment(workload)
    shapes = shapes or [(smoke.warmup_steps, smoke.lockstep_steps or smoke.steps)]
    rows = []
    for run in range(runs):
        for warmup, steps in shapes:
            profile = replace(smoke.with_sizes(steps=steps, repeats=rounds, max_repeats=rounds), warmup_steps=warmup)
            for setting in settings:
                started = time.perf_counter()
                with SETTINGS[setting](), contextlib.redirect_stdout(io.StringIO()):
                    result = run_experiment(experiment, models=[model], profile=profile, device="cpu", seed=seed + run,
                                            progress=False)
                round_s = (time.perf_counter() - started) / rounds
                for skip_first in (False, True):
                    for phase, value in round_noise(result.samples, skip_first).items():
                        rows.append({"run": run, "setting": setting, "shape": f"{warmup}+{steps}", "phase": phase,
                                     "first round": not skip_first, "noise": value, "round s": round_s})
        print(f"run {run + 1} of {runs} done", file=sys.stderr)
    return pd.DataFrame(rows)


def report(noise: pd.DataFrame) -> pd.DataFrame:
    """Per setting, round shape, phase and first round kept or not: the median noise (%) and its interquartile
    range, the median seconds a round took (both phases), and rounds / noise^2 / seconds at those medians."""
    grouped = noise.groupby(["phase", "first round", "setting", "shape"], sort=False)
    median = grouped["noise"].median()
    seconds = grouped["round s"].median()
    table = pd.DataFrame({"median %": 100 * median,
                          "IQR %": 100 * (grouped["noise"].quantile(0.75) - grouped["noise"].quantile(0.25)),
                          "round s": seconds, "told per s": 1 / (median ** 2 * seconds), "runs": grouped.size()})
    return table.round(2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8, help=f"A/A runs per setting (1-{MAX_RUNS})")
    parser.add_argument("--rounds", type=int, default=12, help=f"rounds per run (3-{MAX_ROUNDS})")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), metavar="SETTING",
                        help=f"which settings to measure: {', '.join(repr(s) for s in SETTINGS)}")
    parser.add_argument("--shapes", nargs="+", type=round_shape, default=None, metavar="W+S",
                        help="round shapes to time: W warm-up + S timed steps per variant (default: the smoke "
                             "profile's)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cifar",
                        help="what the two copies train: cifar (ResNet18) or gpt (the tiny GPT); default cifar")
    args = parser.parse_args(argv)
    if not (1 <= args.runs <= MAX_RUNS and 3 <= args.rounds <= MAX_ROUNDS):
        parser.error(f"--runs must be 1-{MAX_RUNS} and --rounds 3-{MAX_ROUNDS}")
    model = a_a_experiment(args.workload)[1]
    print(f"A/A round-level noise: {args.runs} runs of {args.rounds} rounds per setting, smoke profile, {model}, "
          f"{cpu_cores()} cores")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(report(measure(args.runs, args.rounds, args.settings, shapes=args.shapes, workload=args.workload)))


if __name__ == "__main__":
    main()
