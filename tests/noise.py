"""Simulated timing noise like a shared machine's: drift between repeats, a slot effect inside each repeat, jittery
steps with occasional outliers. Used to bound how often a comparison's verdict is wrong."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from optlab.core import timing
from optlab.core.sequential import all_clear, visit_order


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
    of repeats in which one of ``steps`` timed steps takes 2-5 times longer."""

    sd: float
    drift: float = 0.05
    slot_effect: float = 0.015
    outlier_rate: float = 0.05
    steps: int = 10


def simulated_round_times(rng: np.random.Generator, speed_ups: dict[str, float], rounds: int,
                          noise: Noise) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each variant's epoch time and slot in each of ``rounds`` rounds, visited in :func:`visit_order`."""
    labels, level = list(speed_ups), 1.0
    times = {label: np.empty(rounds) for label in labels}
    slots = {label: np.empty(rounds) for label in labels}
    for index in range(rounds):
        level *= float(np.exp(rng.normal(0, noise.drift)))
        for slot, label in enumerate(visit_order(labels, index)):
            time = level * (1 - noise.slot_effect) ** slot / speed_ups[label]
            time *= float(np.exp(rng.normal(0, noise.sd / np.sqrt(2))))
            if rng.random() < noise.outlier_rate:
                time *= 1 + (rng.uniform(2, 5) - 1) / noise.steps
            times[label][index], slots[label][index] = time, slot
    return times, slots


def sequential_outcome(rng: np.random.Generator, speed_up: float, rule, noise: Noise) -> tuple[str, int]:
    """One simulated comparison run under ``rule`` (a :class:`StoppingRule` without a time budget): the verdict at
    the look where it stopped, and how many repeats that took."""
    times, slots = simulated_round_times(rng, {"A": 1.0, "B": speed_up}, rule.max_repeats, noise)
    shifts = slots["B"] - slots["A"]
    for repeats in range(1, rule.max_repeats + 1):
        result = timing.speed_up(times["A"][:repeats], times["B"][:repeats], shifts[:repeats]) if repeats > 1 else None
        if rule.stop_on(repeats, lambda: all_clear([result.verdict])):
            return result.verdict, repeats
    raise AssertionError("the rule never stopped")
