"""Simulated timing noise like a shared machine's: drift between repeats, a slot effect inside each repeat, jittery
steps with occasional outliers. Used to bound how often a comparison's verdict is wrong."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from optlab.core.measuring import timing
from optlab.core.stats.sequential import FUTILE_AFTER, visit_order


def simulated_samples(rng: np.random.Generator, speed_ups: dict[str, float], repeats: int = 5, steps: int = 2,
                      step_s: float = 0.05, drift: float = 0.05, slot_effect: float = 0.015,
                      jitter: float = 0.05, outlier_rate: float = 0.05, steps_per_epoch: int = 100) -> pd.DataFrame:
    """Tidy samples of one model and phase: ``speed_ups`` maps each variant (the first is the baseline, 1.0) to its
    true speed-up. The machine's speed drifts between repeats (a random walk of ``drift``), each later slot in a
    repeat runs ``slot_effect`` faster, steps jitter by ``jitter`` and ``outlier_rate`` of them take 2-5 times longer."""
    labels, rows, level = list(speed_ups), [], 1.0
    for repeat in range(repeats):
        level *= float(np.exp(rng.normal(0, drift)))
        for slot, label in enumerate(visit_order(labels, repeat)):
            base = step_s * level * (1 - slot_effect) ** slot / speed_ups[label] * np.exp(rng.normal(0, drift / 3))
            times = base * np.exp(rng.normal(0, jitter, steps))
            outliers = rng.random(steps) < outlier_rate
            times[outliers] *= rng.uniform(2, 5, int(outliers.sum()))
            startup = abs(rng.normal(0.001, 0.0005))
            rows.append({"model": "m", "phase": "train", "variant": label, "repeat": repeat, "status": "ok",
                         "epoch_equiv_s": startup + times.mean() * steps_per_epoch, "step_median_s": float(np.median(times)),
                         "startup_s": startup, "images_per_s": 16 / times.mean(), "peak_mem_mb": 1.0, "tflops": 0.0})
    return pd.DataFrame(rows)


def paired_epoch_times(rng: np.random.Generator, speed_up: float, **noise) -> tuple[np.ndarray, np.ndarray]:
    """The baseline's and the variant's epoch times, paired by repeat, from :func:`simulated_samples`."""
    frame = simulated_samples(rng, {"A": 1.0, "B": speed_up}, **noise).sort_values("repeat")
    return (frame.loc[frame["variant"] == "A", "epoch_equiv_s"].to_numpy(),
            frame.loc[frame["variant"] == "B", "epoch_equiv_s"].to_numpy())


@dataclass(frozen=True)
class Noise:
    """Per-repeat timing noise for a simulated run: ``sd`` of the log of each repeat's paired ratio (the "1 %, 2 %,
    5 % noise" of the power table), a random-walk ``drift`` of the machine's speed between rounds (shared by the
    variants of a round), a ``slot_effect`` (each later slot of a round runs that much faster), and ``outlier_rate``
    of repeats in which one of ``steps`` timed steps takes 2-5 times longer. Dependent rounds: ``rho``, each variant's
    own noise carried from round to round (AR(1), the same variance), and ``burst`` rounds in a row, at a random
    place, in which one variant (drawn per run) is slowed by 10-30 % by other work."""

    sd: float
    drift: float = 0.05
    slot_effect: float = 0.015
    outlier_rate: float = 0.05
    steps: int = 10
    rho: float = 0.0
    burst: int = 0


def simulated_round_times(rng: np.random.Generator, speed_ups: dict[str, float], rounds: int, noise: Noise,
                          draws: int = 1) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each variant's epoch time in each of ``rounds`` rounds of ``draws`` independent runs (arrays of draws x
    rounds), and its slot in each round (visited in :func:`visit_order`, the same in every run)."""
    labels = list(speed_ups)
    orders = [visit_order(labels, index) for index in range(rounds)]
    slots = {label: np.array([order.index(label) for order in orders], dtype=float) for label in labels}
    level = np.exp(np.cumsum(rng.normal(0, noise.drift, (draws, rounds)), axis=1))  # shared by a round's variants
    times = {}
    for label in labels:
        time = level * (1 - noise.slot_effect) ** slots[label] / speed_ups[label]
        time = time * np.exp(own_noise(rng, noise, draws, rounds))
        outlier = rng.random((draws, rounds)) < noise.outlier_rate
        times[label] = np.where(outlier, time * (1 + (rng.uniform(2, 5, (draws, rounds)) - 1) / noise.steps), time)
    if noise.burst:
        add_bursts(rng, times, noise.burst, draws, rounds)
    return times, slots


def own_noise(rng: np.random.Generator, noise: Noise, draws: int, rounds: int) -> np.ndarray:
    """One variant's log noise in each round (draws x rounds): independent, or AR(1) with ``noise.rho``, each of
    standard deviation ``noise.sd / sqrt(2)`` (so that a paired ratio's is ``noise.sd``)."""
    shocks = rng.normal(0, noise.sd / np.sqrt(2), (draws, rounds))
    if not noise.rho:
        return shocks
    carried = np.empty_like(shocks)
    carried[:, 0] = shocks[:, 0]
    for index in range(1, rounds):
        carried[:, index] = noise.rho * carried[:, index - 1] + np.sqrt(1 - noise.rho ** 2) * shocks[:, index]
    return carried


def add_bursts(rng: np.random.Generator, times: dict[str, np.ndarray], length: int, draws: int, rounds: int) -> None:
    """Slow one variant of each run (drawn per run) by 10-30 % in ``length`` rounds in a row at a random place."""
    labels = list(times)
    victim = rng.integers(0, len(labels), draws)
    start = rng.integers(0, max(1, rounds - length + 1), draws)
    factor = rng.uniform(1.1, 1.3, draws)
    index = np.arange(rounds)
    hit = (index[None, :] >= start[:, None]) & (index[None, :] < start[:, None] + length)
    for position, label in enumerate(labels):
        times[label] = np.where(hit & (victim == position)[:, None], times[label] * factor[:, None], times[label])


def look_plan(rule, round_s: float = 1.0, possible: "list | None" = None) -> list:
    """The looks ``rule`` takes in a run whose rounds take ``round_s`` each on a simulated clock (a budget of B
    seconds then allows about B / ``round_s`` rounds); the looks and their levels do not depend on the data. With
    ``possible``, each look's :meth:`StoppingRule.rounds_possible` is appended to it."""
    now = [0.0]
    rule.clock = lambda: now[0]
    rule.start()
    looks = []
    for repeats in range(1, rule.max_repeats + 1):
        now[0] += round_s
        rule.round_done(round_s)
        look = rule.look(repeats)
        if look is not None:
            looks.append(look)
            if possible is not None:
                possible.append(rule.rounds_possible(repeats))
            if look.final:
                break
    return looks


def sequential_outcomes(rng: np.random.Generator, speed_ups: dict[str, float], rule, noise: Noise, draws: int,
                        round_s: float = 1.0) -> dict[str, np.ndarray]:
    """``draws`` simulated runs of every variant against the first (the baseline) under ``rule``, vectorised: each
    comparison is closed at the first look where its verdict is clear, or, before the last look and from
    ``FUTILE_AFTER`` rounds on, where it is out of reach of the rounds possible (on the scale the interval sees) while
    another open one is not (as the rule does: with one phase, closing a comparison always lets its variant leave;
    variants leaving, which makes the real rounds cheaper, is not simulated); the last look closes the
    rest, and a run stops once every comparison is closed. Returns the ``verdict``, ``ratio``, ``low`` and ``high``
    each comparison was closed with (draws x comparisons), whether it was closed out of reach (``given_up``), the
    lag-1 ``autocorrelation`` of its rounds and their number (``rounds``) there, and the ``repeats`` each run took
    (draws)."""
    labels = list(speed_ups)
    possible: list = []
    looks = look_plan(rule, round_s, possible)
    times, slots = simulated_round_times(rng, speed_ups, looks[-1].repeats, noise, draws)
    base, others = labels[0], labels[1:]
    shape = (draws, len(others))
    out = {"verdict": np.full(shape, timing.UNCLEAR, dtype=object), "ratio": np.full(shape, np.nan),
           "low": np.full(shape, np.nan), "high": np.full(shape, np.nan), "repeats": np.zeros(draws, dtype=int)}
    out["given_up"] = np.zeros(shape, dtype=bool)
    out["autocorrelation"], out["rounds"] = np.full(shape, np.nan), np.zeros(shape, dtype=int)
    logs = {label: np.log(seconds) for label, seconds in times.items()}  # once, not at every look
    running, open_ = np.ones(draws, dtype=bool), np.ones(shape, dtype=bool)
    for look, rounds_possible in zip(looks, possible):
        if not look.reads:
            continue
        n = look.repeats
        now = {"verdict": np.empty(shape, dtype=object), "ratio": np.empty(shape), "low": np.empty(shape),
               "high": np.empty(shape), "scale": np.empty(shape)}
        for column, label in enumerate(others):
            log_ratios = logs[base][:, :n] - logs[label][:, :n]
            centre, error, _, df = timing.log_ratio_fit(log_ratios, slots[label][:n] - slots[base][:n])
            ratio, low, high = timing.fit_interval(centre, error, df, look.confidence)
            now["ratio"][:, column], now["low"][:, column], now["high"][:, column] = ratio, low, high
            now["scale"][:, column], now["verdict"][:, column] = error * np.sqrt(n), timing.verdicts(ratio, low, high)
        answering = open_ & (np.isin(now["verdict"], timing.CLEAR) | look.final)
        still = open_ & ~answering
        given_up = np.zeros(shape, dtype=bool)
        if n >= FUTILE_AFTER and not look.final:
            beyond = still & timing.out_of_reach(now["ratio"], now["scale"], n, rounds_possible)
            given_up = beyond & (still & ~beyond).any(axis=1, keepdims=True)  # only while another is within reach
        answering |= given_up
        out["given_up"] |= given_up
        for key in ("verdict", "ratio", "low", "high"):
            out[key][answering] = now[key][answering]
        for column, label in enumerate(others):
            rows = answering[:, column]
            if rows.any():
                log_ratios = logs[base][rows, :n] - logs[label][rows, :n]
                out["autocorrelation"][rows, column] = timing.round_autocorrelation(log_ratios, slots[label][:n]
                                                                                    - slots[base][:n])
                out["rounds"][rows, column] = n
        open_ &= ~answering
        stop = running & ~open_.any(axis=1)
        out["repeats"][stop] = n
        running &= ~stop
    return out
