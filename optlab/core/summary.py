"""From tidy samples to the summary table: median, spread, speed-up with its interval, verdict, memory."""
from __future__ import annotations

import pandas as pd

from .timing import speed_up, summarize

SUMMARY_COLUMNS = [
    "model", "phase", "variant", "n", "epoch_s", "epoch_iqr_s", "epoch_min_s", "step_ms", "startup_s",
    "images_per_s", "peak_mem_mb", "first_peak_mem_mb", "tflops", "reference", "speedup", "ci_low", "ci_high", "verdict",
    "role",
]
CLAIM, CONTROL = "claim", "A/A control"


def paired_epoch_times(reference: pd.DataFrame, variant: pd.DataFrame) -> tuple[list[float], list[float], list | None]:
    """The two variants' epoch-equivalent times on the repeats both finished, in repeat order, and how many slots
    later the variant ran than its reference in each (None for samples that do not record their slot)."""
    base, other = reference.set_index("repeat"), variant.set_index("repeat")
    repeats = sorted(set(base.index) & set(other.index))
    shifts = None
    if "slot" in base and "slot" in other and not (base["slot"].isna().any() or other["slot"].isna().any()):
        shifts = (other.loc[repeats, "slot"] - base.loc[repeats, "slot"]).tolist()
    return base.loc[repeats, "epoch_equiv_s"].tolist(), other.loc[repeats, "epoch_equiv_s"].tolist(), shifts


def summarize_runs(samples: pd.DataFrame, baseline: str, controls: "tuple[str, ...] | list[str]" = (),
                   references: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per model, phase and variant; each speed-up is against the variant's reference (``references``, else
    the ``baseline``) of the same model and phase, paired by repeat, and ``n`` is the number of pairs it used.
    Phases in ``controls`` are ones the technique cannot change: their rows say so in ``role`` ("A/A control"), and
    their verdicts measure the noise, not the technique."""
    references = references or {}
    if samples.empty or "epoch_equiv_s" not in samples:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    ok = samples[samples["status"] == "ok"]
    rows = []
    for (model, phase), group in ok.groupby(["model", "phase"], sort=False):
        by_variant = dict(tuple(group.groupby("variant", sort=False)))
        role = CONTROL if phase in controls else CLAIM
        for variant, runs in by_variant.items():
            epoch = summarize(runs["epoch_equiv_s"])
            first = runs["repeat"] == runs["repeat"].min()  # one-off costs: cuDNN's trials, a first workspace
            row = {
                "model": model, "phase": phase, "variant": variant, "n": epoch.n,
                "epoch_s": epoch.median, "epoch_iqr_s": epoch.iqr, "epoch_min_s": epoch.min,
                "step_ms": 1e3 * runs["step_median_s"].median(), "startup_s": runs["startup_s"].median(),
                "images_per_s": runs["images_per_s"].median(),
                "peak_mem_mb": runs.loc[~first if (~first).any() else first, "peak_mem_mb"].max(),
                "first_peak_mem_mb": runs.loc[first, "peak_mem_mb"].max(),
                "tflops": runs["tflops"].median(), "role": role,
            }
            if variant == baseline:
                row.update(speedup=1.0, ci_low=1.0, ci_high=1.0, verdict="baseline")
            elif (reference := references.get(variant, baseline)) in by_variant:
                base, other, shifts = paired_epoch_times(by_variant[reference], runs)
                result = speed_up(base, other, shifts)
                row.update(reference=reference, n=len(base), speedup=result.ratio, ci_low=result.low,
                           ci_high=result.high, verdict=result.verdict)
            rows.append(row)
    failed = samples[samples["status"] != "ok"].drop_duplicates(["model", "phase", "variant"])
    for _, run in failed.iterrows():
        rows.append({"model": run["model"], "phase": run["phase"], "variant": run["variant"], "n": 0,
                     "verdict": run["status"], "role": CONTROL if run["phase"] in controls else CLAIM})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def step_by_step(samples: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """A cumulative stack (each variant adds one technique to the one before): every step's speed-up over the step
    before it, with its interval and verdict, next to its speed-up over the first variant."""
    rows = []
    overall = summarize_runs(samples, labels[0]).set_index(["model", "phase", "variant"])
    previous = summarize_runs(samples, labels[0], references=dict(zip(labels[1:], labels)))
    for after in labels[1:]:
        for row in previous[previous["variant"] == after].itertuples():
            total = overall.loc[(row.model, row.phase, after)]
            rows.append({"model": row.model, "phase": row.phase, "step": after, "epoch_s": row.epoch_s,
                         "vs previous": row.speedup, "ci_low": row.ci_low, "ci_high": row.ci_high,
                         "verdict": row.verdict, "vs baseline": total["speedup"], "peak_mem_mb": row.peak_mem_mb})
    return pd.DataFrame(rows)
