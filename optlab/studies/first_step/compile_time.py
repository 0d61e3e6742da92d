"""Compile time, cold and warm: many starts of one training run, each in a fresh process, and what they add up to.

A round is one start of each kind (``STARTS``), each a new process with its own cache folder:

- ``eager``: no compile, the reference;
- ``whole, cold caches``: ``model.compile()`` with an empty folder (it saves the portable artifacts after its first
  step);
- ``whole, warm caches``: the same, in the folder the cold start filled (Inductor's FX graphs and AOTAutograd's
  graphs are found on disk);
- ``portable artifacts``: an empty folder, filled first by ``torch.compiler.load_cache_artifacts`` from the cold
  start's saved bytes, as a fresh machine would be from a file shipped with the model;
- ``regional, cold caches``: each repeated block compiled on its own, from an empty folder.

Each start's compile cost is its first step minus eager's first step in the same round; its saving per step is
eager's steady step minus its own (the paired speed-up over the rounds); the break-even is the cost over the saving.
"""
from __future__ import annotations

import math
import os
import queue
import tempfile
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ...core.errors import OptlabError, choice_error
from ...core.knobs.limits import check_count
from ...core.results import store
from ...core.measuring.timing import CONFIDENCE, INTERVAL, interval_text, speed_up, t_quantile, too_wide_to_tell
from . import fresh
from .starts import MODELS, PHASES, SIZES

EAGER, COLD, WARM, PORTABLE, REGIONAL = ("eager", "whole, cold caches", "whole, warm caches", "portable artifacts",
                                         "regional, cold caches")
# label: (how the process compiles, the round's cache folder it uses, whether that folder must start empty)
STARTS = {EAGER: ("eager", "eager", True), COLD: ("whole", "whole", True), WARM: ("whole", "whole", False),
          PORTABLE: ("portable", "portable", True), REGIONAL: ("regional", "regional", True)}
MAX_ROUNDS, MAX_STEPS = 20, 1000  # every round starts five processes, two of which compile from cold
START_MODULE = "optlab.studies.first_step.starts"  # what each start runs, and what its fork server imports
CLAIMS = ((WARM, COLD), (PORTABLE, COLD), (REGIONAL, COLD))  # (faster start?, than this one): first-step times


@dataclass(frozen=True)
class StartPlan:
    """What chapter 34 runs on a machine: the models' ``size`` and ``phase`` (``starts.build``, ``starts.PHASES``),
    the ``rounds``, how many run side by side, and whether ResNet18's starts run too."""

    size: str
    rounds: int
    phase: str
    at_once: int
    cnn: bool
    deadline_s: "float | None" = None  # the rounds still running then are ended; the finished ones are kept

    def describe(self) -> str:
        """One line: rounds, starts, steps, sizes and the deadline."""
        return (f"{self.rounds} rounds ({self.at_once} at once) of {len(STARTS)} fresh processes, {self.phase} steps, "
                f"{self.size} sizes (starts.build){'' if self.cnn else ', the GPT only'}"
                + ("" if self.deadline_s is None else f", within {self.deadline_s:.0f} s (a model's starts)"))


REFERENCE_DEADLINE_S = 200  # the reference run's part: inside its 240 s limit, with time to write the tables


GPU_DEADLINE_S = 240  # a reader's GPU: the chapter's starts end within four minutes, whatever the GPU's compile speed


def chapter_plan(cuda: bool, profile: str) -> StartPlan:
    """A GPU: the small (4-block) GPT's training step, up to five rounds one at a time within
    :data:`GPU_DEADLINE_S` (GPT-2 small's cold compiles take about a minute a start, 50 starts with ResNet18's: the
    reference run measures it in parts of their own); in the ``smoke`` profile (a check of the GPU's code path, not a
    measurement) two rounds. A CPU: the tiny 2-block GPT's forward pass (half the kernels to build), four rounds, two
    side by side (a round's starts still run one after another)."""
    if cuda and profile == "smoke":
        return StartPlan("small", 2, "train", 1, cnn=False, deadline_s=GPU_DEADLINE_S)
    if cuda:
        return StartPlan("small", 5, "train", 1, cnn=False, deadline_s=GPU_DEADLINE_S)
    return StartPlan("tiny", 4, "forward", min(2, os.cpu_count() or 1), cnn=False)


def run_starts(model: str, rounds: int = 3, size: str = "small", steps: int = 10, phase: str = "train",
               root: "Path | None" = None, compile_threads: "int | None" = None,
               rounds_at_once: int = 1, deadline_s: "float | None" = None) -> pd.DataFrame:
    """Every start of ``STARTS`` in each of ``rounds`` rounds of ``model``'s ``phase`` (``starts.PHASES``): one row
    per process, with its first-step seconds, median steady step, graphs compiled, cache hits and misses and its
    cache folder's files before and after. ``root`` holds the rounds' cache folders; if not given, a new temporary
    folder, removed with all it holds when the study ends (the chapter's CPU starts leave 160 MB of compiled code).
    Inductor's precompiled headers are built first, once, by a process of their own (``headers_s``), and shared by
    every start.
    ``compile_threads``: Inductor's compile workers in every start (torch's default, one a core up to 32, if None).
    ``rounds_at_once``: rounds run side by side, each in its own sequence of processes (at most one a core): a round's
    five starts still run one after another, so every comparison is between starts of one round, which share
    whatever the other rounds were doing. Where ``fresh.forks_possible``, each sequence forks its processes from a
    ``fresh.ForkServer`` (column ``forked``), which probes the CPU's vector instructions once for its children
    (``probe_s``): the first server probes, and the others, started once it has, find its answer in the machine
    folder they share; a start in a process of its own probes inside its first step where it compiles from cold.
    ``deadline_s``: seconds from the call after which the starts in flight are killed and no round starts; the rounds
    that finished come back (``rows.attrs["stopped"]`` says why the others did not), and fewer than two is an
    OptlabError. A signal, or a round's error, ends every start at once the same way, queued rounds included."""
    if model not in MODELS:
        raise choice_error("model", model, MODELS)
    check_count("rounds", rounds, 2, MAX_ROUNDS, "each round compiles the model from cold twice")
    check_count("steps", steps, 1, MAX_STEPS, "steady steps per start")
    check_count("rounds_at_once", rounds_at_once, 1, min(rounds, os.cpu_count() or 1),
                "rounds side by side: at most one a core, and no more than the rounds")
    if phase not in PHASES:
        raise choice_error("phase", phase, PHASES)
    if size not in SIZES:
        raise choice_error("size", size, SIZES)
    if deadline_s is not None and not deadline_s > 0:
        raise OptlabError(f"deadline_s must be a positive number of seconds (or None: no deadline), got {deadline_s}")
    temporary = None if root else tempfile.TemporaryDirectory(prefix="optlab-first-step-",
                                                              ignore_cleanup_errors=True)
    root = Path(root or temporary.name)
    settings = {} if compile_threads is None else {"TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads)}
    headers = root / "precompiled-headers"  # the machine's, built once: see ``fresh``
    stop = fresh.Stop(None if deadline_s is None else time.monotonic() + deadline_s)
    lanes: queue.SimpleQueue = queue.SimpleQueue()  # each side-by-side sequence of rounds and its fork server
    machine, servers = fresh.CacheFolder(root / "machine", headers), []

    def one_round(round_: int) -> list[dict[str, Any]]:
        artifacts, rows, server = root / f"round{round_}-artifacts.bin", [], lanes.get()
        try:
            for label, (how, folder, cold) in STARTS.items():
                kwargs = {"model": model, "how": how, "size": size, "steps": steps, "phase": phase,
                          "save_to": str(artifacts) if label == COLD else None,
                          "artifacts": str(artifacts) if how == "portable" else None}
                cache = fresh.CacheFolder(root / f"round{round_}" / folder, headers)
                answer = fresh.run_fresh(f"{START_MODULE}:start", kwargs, cache, cold, settings, forks=server,
                                         stop=stop)
                rows.append({"round": round_, "start": label, "cache_folder": str(cache.path),
                             "step_s": float(np.median(answer["step_times_s"])), "headers_s": built["headers_s"],
                             "probe_s": server.probe_s if server else math.nan, "forked": server is not None,
                             **answer})
        finally:
            lanes.put(server)
        return rows

    try:
        for _ in range(rounds_at_once if fresh.forks_possible() else 0):
            if servers:  # the first has probed the CPU: the others find its answer in the machine folder they share
                servers[0].ready()
            servers.append(fresh.ForkServer(START_MODULE, settings, machine, stop))
        for server in servers or [None] * rounds_at_once:
            lanes.put(server)
        built = fresh.run_fresh(f"{START_MODULE}:build_headers", {}, fresh.CacheFolder(root / "headers-build", headers),
                                cold=True, settings=settings, forks=servers[0] if servers else None, stop=stop)
        rows = _rounds_until(stop, rounds_at_once, [lambda r=r: one_round(r) for r in range(rounds)])
        for server in filter(None, servers):
            if not server.machine_untouched():
                raise OptlabError(f"a start wrote into the fork server's machine folder {server.machine.path}: the "
                                  "starts shared a cache, so none was cold")
    finally:
        stop.stop(stop.why or "the study ended")  # nothing it started outlives it
        for server in filter(None, servers):
            server.close()
        if temporary is not None:
            temporary.cleanup()
    finished = len({row["round"] for row in rows})
    if finished < 2:
        raise OptlabError(f"{finished} of {rounds} rounds of {model}'s starts finished before {stop.why} "
                          f"(deadline_s {deadline_s}): the tables need two; give a longer deadline_s or a smaller size")
    frame = pd.DataFrame(rows)
    if finished < rounds:
        frame.attrs["stopped"] = f"{finished} of {rounds} rounds: stopped at {stop.why}"
    return frame


def _rounds_until(stop: "fresh.Stop", at_once: int, rounds: list) -> list[dict[str, Any]]:
    """The rows of the ``rounds`` (each a call that returns its rows) run ``at_once`` side by side, in order, until
    ``stop``'s deadline: the rounds that finished. A round's own error, or a signal here, stops the others first
    (queued rounds never start, the starts in flight are killed) and is raised."""
    pool = ThreadPoolExecutor(max_workers=at_once)
    futures = [pool.submit(one) for one in rounds]
    try:
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=stop.remaining(), return_when=FIRST_EXCEPTION)
            if not done:  # the deadline
                stop.check()
            for future in done:
                if future.exception() is not None and not isinstance(future.exception(), fresh.StartsStopped):
                    raise future.exception()
    except fresh.StartsStopped:
        pass  # the deadline: keep the rounds that finished
    finally:
        stop.stop(stop.why or "a round's error or a signal")
        pool.shutdown(wait=True, cancel_futures=True)
    return [row for future in futures if future.done() and not future.cancelled() and future.exception() is None
            for row in future.result()]


def break_even(extra_s: np.ndarray, eager_step_s: np.ndarray, step_s: np.ndarray,
               confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """Steps after which a start that costs ``extra_s`` more up front (per round) and steps in ``step_s`` instead of
    ``eager_step_s`` has caught up with eager, and an interval: the cost's t interval over the rounds divided by the
    saving's, from the paired speed-up's interval (each at ``confidence``: the pair holds at least that level minus
    its complement). Infinite where it may never pay: a saving that can be zero or negative."""
    n = len(extra_s)
    rate = speed_up(eager_step_s, step_s, confidence=confidence)
    eager = float(np.median(eager_step_s))
    cost = float(np.median(extra_s))
    half = t_quantile((1 + confidence) / 2, n - 1) * float(np.std(extra_s, ddof=1)) / math.sqrt(n)
    cost_low, cost_high = max(0.0, float(np.mean(extra_s)) - half), float(np.mean(extra_s)) + half

    def steps_at(seconds: float, ratio: float) -> float:
        saving = eager * (1 - 1 / ratio) if ratio > 0 else -1.0
        return seconds / saving if saving > 0 and not math.isnan(saving) else math.inf

    return steps_at(cost, rate.ratio), steps_at(cost_low, rate.high), steps_at(cost_high, rate.low)


def start_table(rows: pd.DataFrame, confidence: float = CONFIDENCE) -> pd.DataFrame:
    """One row per start: median first step and steady step, the steady speed-up over eager with its interval and
    verdict, the compile cost (first step minus eager's) and the break-even in steps with its interval."""
    eager = rows[rows["start"] == EAGER].set_index("round")
    out = []
    for label, group in rows.groupby("start", sort=False):
        group = group.set_index("round").loc[eager.index]
        rate = speed_up(eager["step_s"], group["step_s"], confidence=confidence)
        extra = (group["first_step_s"] - eager["first_step_s"]).to_numpy()
        even, low, high = (math.nan,) * 3 if label == EAGER else break_even(
            extra, eager["step_s"].to_numpy(), group["step_s"].to_numpy(), confidence)
        out.append({"start": label, "rounds": len(group), "first step s": group["first_step_s"].median(),
                    "compile s": float(np.median(extra)), "step ms": 1e3 * group["step_s"].median(),
                    "speed-up": rate.ratio, "low": rate.low, "high": rate.high,
                    "verdict": "baseline" if label == EAGER else rate.verdict,
                    "break-even steps": even, "break-even low": low, "break-even high": high,
                    "graphs": int(group["graphs"].max()), "cache hits": int(group["cache_hits"].sum()),
                    "cache misses": int(group["cache_misses"].sum())})
    return pd.DataFrame(out).set_index("start")


def start_verdicts(rows: pd.DataFrame, confidence: float = CONFIDENCE) -> pd.DataFrame:
    """The page's claims about starts, paired by round: is each faster start's first step shorter than the other's
    (the ratio of their first-step seconds, its interval and verdict)?"""
    first = rows.pivot(index="round", columns="start", values="first_step_s")
    out = []
    for faster, slower in CLAIMS:
        rate = speed_up(first[slower], first[faster], confidence=confidence)
        out.append({"start": faster, "against": slower, "first step s": first[faster].median(),
                    "against s": first[slower].median(), "times shorter": rate.ratio, "low": rate.low,
                    "high": rate.high, "verdict": rate.verdict})
    return pd.DataFrame(out)


def steps_text(value: float) -> str:
    """A break-even for a table: "never" where it may not come, else whole steps."""
    return "never" if math.isinf(value) else "" if math.isnan(value) else f"{value:,.0f}"


def readable(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`start_table` or :func:`start_verdicts` for the page: each interval and break-even as text, the
    figures rounded."""
    shown = table.copy()
    rounds = int(shown["rounds"].iloc[0]) if "rounds" in shown else None
    shown.insert(shown.columns.get_loc("low"), INTERVAL,
                 [interval_text(low, high, rounds) for low, high in zip(shown["low"], shown["high"])])
    if "break-even steps" in shown:
        shown["break-even steps"] = [
            "" if math.isnan(even) else f"{steps_text(even)} [{steps_text(low)}, {steps_text(high)}]"
            for even, low, high in zip(table["break-even steps"], table["break-even low"], table["break-even high"])]
        shown = shown.drop(columns=["break-even low", "break-even high"])
    return shown.drop(columns=["low", "high"]).round(3)


FIRST_STEP, STEADY = "first step, against the whole model cold", "steady step, against eager"


def speedup_points(table: pd.DataFrame, claims: pd.DataFrame, model: str) -> pd.DataFrame:
    """The page's speed-ups in the form the book's speed-up figure reads: how many times shorter each start's first
    step is than the whole model's cold one, and each compiled start's steady step against eager's (an interval too
    wide to tell is left out, as the tables say)."""
    first = pd.DataFrame({"variant": claims["start"], "phase": FIRST_STEP, "speedup": claims["times shorter"],
                          "ci_low": claims["low"], "ci_high": claims["high"], "verdict": claims["verdict"]})
    compiled = table.drop(index=EAGER).reset_index()
    steady = pd.DataFrame({"variant": compiled["start"], "phase": STEADY, "speedup": compiled["speed-up"],
                           "ci_low": compiled["low"], "ci_high": compiled["high"], "verdict": compiled["verdict"]})
    points = pd.concat([first, steady], ignore_index=True)
    wide = [too_wide_to_tell(low, high) for low, high in zip(points["ci_low"], points["ci_high"])]
    points.loc[wide, ["ci_low", "ci_high"]] = np.nan  # "too wide to tell": no line across the whole axis
    return points.assign(model=model, source="live", role="claim", versus=None)


def run_reference(out: "str | Path", device: str = "cuda") -> list[Path]:
    """The chapter's GPU measurement: up to three rounds of every start of GPT-2 small within
    :data:`REFERENCE_DEADLINE_S` (the rounds that finished by then; ResNet18's would not fit one part of the reference
    run), saved under ``out`` as ``compile-time-gpt-*.csv`` (the starts, the table and the verdicts)."""
    folder, paths = store.writable_dir(out), []
    rows = run_starts("gpt", rounds=3, size="real", deadline_s=REFERENCE_DEADLINE_S)
    for name, table in (("starts", rows.drop(columns=["step_times_s"])), ("table", start_table(rows).reset_index()),
                        ("verdicts", start_verdicts(rows))):
        paths.append(folder / f"compile-time-gpt-{name}.csv")
        store.atomic_write_text(paths[-1], table.to_csv(index=False))
    return paths
