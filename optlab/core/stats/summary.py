"""From tidy samples to the summary table: median, spread, speed-up with its interval, verdict, round-level noise,
memory."""
from __future__ import annotations

import pandas as pd

from ..measuring.timing import VERDICTS, speed_up, summarize

SUMMARY_COLUMNS = [
    "model", "phase", "variant", "n", "epoch_s", "epoch_iqr_s", "epoch_min_s", "step_ms", "startup_s",
    "images_per_s", "items_per_s", "unit", "peak_mem_mb", "first_peak_mem_mb", "tflops", "reference", "speedup",
    "ci_low", "ci_high", "verdict", "noise", "role", "autocorrelation",
]
CLAIM, CONTROL = "claim", "A/A control"
LOOK_CONFIDENCE = "look_confidence"  # samples' column: the level of the look their comparison is read at
LOOK_ROUNDS = "look_rounds"  # samples' column: the rounds of the look that answered their comparison (None: all)
EARLIER_RULE_CONFIDENCE = 0.999  # samples without it came from the earlier rule: 5 looks at most, each at 99.9 %


def failed_variants(samples: pd.DataFrame) -> dict[tuple[str, str], str]:
    """``{(model, variant): status}`` of every variant that failed in any phase (the first failure's status)."""
    if samples.empty or "status" not in samples:
        return {}
    failed = samples[samples["status"] != "ok"].drop_duplicates(["model", "variant"])
    return {(row.model, row.variant): row.status for row in failed.itertuples()}


def read_at(samples: pd.DataFrame) -> tuple[float, int | None]:
    """The look a variant's samples (one model and phase) are read at: its level (else the earlier rule's per-look
    level) and the rounds that look had (None: every round, as in records from before comparisons were answered
    one by one)."""
    level = EARLIER_RULE_CONFIDENCE
    if LOOK_CONFIDENCE in samples and samples[LOOK_CONFIDENCE].notna().any():
        level = float(samples[LOOK_CONFIDENCE].dropna().iloc[-1])
    rounds = None
    if LOOK_ROUNDS in samples and samples[LOOK_ROUNDS].notna().any():
        rounds = int(samples[LOOK_ROUNDS].dropna().iloc[-1])
    return level, rounds


def paired_epoch_times(reference: pd.DataFrame, variant: pd.DataFrame, rounds: int | None = None
                       ) -> tuple[list[float], list[float], list | None]:
    """The two variants' epoch-equivalent times on the repeats both finished (the first ``rounds`` of them, where
    given), in repeat order, and how many slots later the variant ran than its reference in each (None for samples
    that do not record their slot)."""
    base, other = reference.set_index("repeat"), variant.set_index("repeat")
    repeats = sorted(set(base.index) & set(other.index))[:rounds]
    shifts = None
    if "slot" in base and "slot" in other and not (base["slot"].isna().any() or other["slot"].isna().any()):
        shifts = (other.loc[repeats, "slot"] - base.loc[repeats, "slot"]).tolist()
    return base.loc[repeats, "epoch_equiv_s"].tolist(), other.loc[repeats, "epoch_equiv_s"].tolist(), shifts


def summarize_runs(samples: pd.DataFrame, baseline: str, controls: "tuple[str, ...] | list[str]" = (),
                   references: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per model, phase and variant; each speed-up is against the variant's reference (``references``, else
    the ``baseline``) of the same model and phase, paired by repeat, and ``n`` is the number of pairs it used.
    Phases in ``controls`` are ones the technique cannot change: their rows say so in ``role`` ("A/A control"), and
    their verdicts measure the noise, not the technique.

    Each interval is read at the look that answered its comparison, on the rounds that look had, else at the level of
    the look where its model's run stopped, on every round (the variant's samples' ``look_confidence`` and
    ``look_rounds``); ``noise`` is the standard deviation of one round's log ratio. A variant that failed in any phase
    is shown once per phase, with the rounds it finished there (``n``) and its status as the verdict, and no speed-up:
    its comparison left the rule when it failed, so it was never read at a look. A comparison against a failed reference
    says so."""
    references = references or {}
    if samples.empty or "epoch_equiv_s" not in samples:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    failed = failed_variants(samples)
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
                # throughput in the workload's unit (tokens for a GPT); records from before it was kept lack it
                "items_per_s": runs["items_per_s"].median() if "items_per_s" in runs else float("nan"),
                "unit": runs["unit"].iloc[0] if "unit" in runs else None,
                "peak_mem_mb": runs.loc[~first if (~first).any() else first, "peak_mem_mb"].max(),
                "first_peak_mem_mb": runs.loc[first, "peak_mem_mb"].max(),
                "tflops": runs["tflops"].median(), "role": role,
            }
            reference = references.get(variant, baseline)
            if (model, variant) in failed:  # left the rule when it failed: shown once below, not read here
                continue
            if variant == baseline:
                row.update(speedup=1.0, ci_low=1.0, ci_high=1.0, verdict="baseline")
            elif (model, reference) in failed:
                row.update(reference=reference, verdict=f"not compared: {reference} {failed[(model, reference)]}")
            elif reference in by_variant:
                level, rounds = read_at(runs)
                base, other, shifts = paired_epoch_times(by_variant[reference], runs, rounds)
                result = speed_up(base, other, shifts, confidence=level)
                row.update(reference=reference, n=len(base), speedup=result.ratio, ci_low=result.low,
                           ci_high=result.high, verdict=result.verdict, noise=result.noise,
                           autocorrelation=result.autocorrelation)
            rows.append(row)
    for (model, variant), status in failed.items():  # once per phase, with the rounds it had
        for phase in samples.loc[samples["model"] == model, "phase"].unique():
            had = ok[(ok["model"] == model) & (ok["variant"] == variant) & (ok["phase"] == phase)]
            rows.append({"model": model, "phase": phase, "variant": variant, "n": len(had), "verdict": status,
                         "reference": None if variant == baseline else references.get(variant, baseline),
                         "role": CONTROL if phase in controls else CLAIM})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


NOT_WAITED = "not waited for"  # a stack's verdict that the rule did not wait for: shown as an estimate only
STEP_COLUMNS = ["model", "phase", "step", "n", "epoch_s", "vs previous", "ci_low", "ci_high", "verdict", "waited for",
                "vs baseline", "baseline_n", "baseline_low", "baseline_high", "baseline_verdict", "baseline_epoch_s",
                "peak_mem_mb"]


def step_by_step(samples: pd.DataFrame, labels: list[str], waited: dict[str, str]) -> pd.DataFrame:
    """A cumulative stack (each variant adds one technique to the one before): every step's speed-up over the step
    before it and over the first variant (the baseline), each with its interval, both read at the look that closed the
    step's comparison, on the rounds of that look that both sides ran (:func:`read_at`).

    ``waited`` maps each step to the variant its run's rule waited for (the experiment's ``comparisons``, or a stored
    record's ``references``), and a verdict is read only where the rule waited for it: ``verdict`` against the step
    before, ``baseline_verdict`` against the baseline, and :data:`NOT_WAITED` for the other. A chained stack
    (``registry.chained``) has every verdict against the step before (and the first step's against the baseline, the
    same comparison); a record made before stacks were chained waited for each step against the baseline, so there the
    verdicts are against the baseline and each step-before speed-up is an estimate. ``waited for`` names the
    reference; ``baseline_epoch_s`` is the baseline's median, where the waterfall starts. A step that failed, or was
    compared with one that did, keeps its status as the verdict."""
    rows = []
    overall = summarize_runs(samples, labels[0]).set_index(["model", "phase", "variant"])
    previous = summarize_runs(samples, labels[0], references=dict(zip(labels[1:], labels)))
    for before, after in zip(labels, labels[1:]):
        for row in previous[previous["variant"] == after].itertuples():
            total = overall.loc[(row.model, row.phase, after)]
            start = overall["epoch_s"].get((row.model, row.phase, labels[0]), float("nan"))
            reference = waited.get(after, labels[0])
            rows.append({"model": row.model, "phase": row.phase, "step": after, "n": row.n, "epoch_s": row.epoch_s,
                         "vs previous": row.speedup, "ci_low": row.ci_low, "ci_high": row.ci_high,
                         "verdict": _waited_verdict(row.verdict, reference == before), "waited for": reference,
                         "vs baseline": total["speedup"], "baseline_n": total["n"], "baseline_low": total["ci_low"],
                         "baseline_high": total["ci_high"],
                         "baseline_verdict": _waited_verdict(total["verdict"], reference == labels[0]),
                         "baseline_epoch_s": start, "peak_mem_mb": row.peak_mem_mb})
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


def _waited_verdict(verdict: object, waited: bool) -> object:
    """A read verdict where the rule waited for its comparison, else :data:`NOT_WAITED`; a status (a failure, "not
    compared") as it is."""
    return verdict if waited or verdict not in VERDICTS else NOT_WAITED
