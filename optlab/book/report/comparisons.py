"""Our speed-ups beside others': the tidy speed-ups of a live run and the stored reference machines, and the seed's
V100 figures side by side with ours.
"""
from __future__ import annotations

import pandas as pd

from ...core.results import store
from ...core.techniques.registry import Experiment, get_experiment
from ...core.results.seed import SEED_MACHINE, seed_speedups
from ...core.stats.summary import CLAIM
from ...core.techniques.cnn import SET_NAMES, technique_set
from ...core.measuring.timing import INTERVAL
from .text import ratio, significant, speedup_text, verdict_text
from .tables import KEYS, in_order

SEED, LIVE = "seed V100", "live"


TIDY = ["model", "phase", "variant", "source", "speedup", "ci_low", "ci_high", "verdict", "role", "versus"]




def speedups(experiment: "str | Experiment", live: pd.DataFrame | None = None, stored: bool = True) -> pd.DataFrame:
    """Tidy speed-ups of every variant but the baseline, one row per source: the ``live`` summary, and with ``stored``
    each stored reference machine's and the seed's V100 speed-up where one of ours has the same model, phase and
    variant."""
    experiment = get_experiment(experiment)
    frames = [] if live is None or live.empty else [live.assign(source=LIVE)]
    reference = reference_summary(experiment.name) if stored else None
    if reference is not None:
        frames += [rows.assign(source=machine) for machine, rows in reference.groupby("machine")]
    if not frames:
        return pd.DataFrame(columns=TIDY)
    ours = pd.concat([frame.reindex(columns=TIDY) for frame in frames], ignore_index=True)
    ours = ours[ours["variant"] != experiment.baseline_label].assign(role=lambda d: d["role"].fillna(CLAIM))
    ours["versus"] = [versus(experiment, variant) for variant in ours["variant"]]
    seed = seed_speedups(experiment.name).merge(ours[KEYS].drop_duplicates(), on=KEYS) if stored else pd.DataFrame()
    if not seed.empty:
        ours = pd.concat([seed.assign(source=SEED, role=CLAIM).reindex(columns=TIDY), ours], ignore_index=True)
    return in_order(ours, experiment.labels).reset_index(drop=True)


def versus(experiment: Experiment, variant: str) -> str:
    """The reference a variant is compared with when it is not the baseline (the figure says so); else ""."""
    reference = experiment.reference_of(variant)
    return "" if reference == experiment.baseline_label else reference


def seed_comparison(technique: str, live: pd.DataFrame | None = None,
                    reference: pd.DataFrame | None = None) -> pd.DataFrame:
    """The seed's V100 seconds and speed-ups beside ours: the ``live`` summary and each machine of ``reference`` (stored
    summaries with a ``machine`` column), one row per model, phase and variant in the registry's variant order."""
    seed = seed_speedups(technique)
    table = pd.DataFrame({**{key: seed[key] for key in KEYS}, "V100 s": seed["seconds"].map(significant),
                          "V100 speed-up": seed["speedup"].map(ratio)})
    for name, rows in _sources(live, reference):
        table = table.merge(_ours(name, rows), on=KEYS, how="outer")
    table.attrs["seed_machine"] = SEED_MACHINE
    return in_order(table, get_experiment(technique).labels).reset_index(drop=True)


def reference_comparison(technique: str, live: pd.DataFrame | None = None) -> pd.DataFrame:
    """A technique beyond the seed: the live speed-ups beside every stored reference machine's, one row per variant."""
    table = pd.DataFrame(columns=KEYS)
    for name, rows in _sources(live, reference_summary(technique)):
        ours = _ours(name, rows, memory=True)
        table = ours if table.empty else table.merge(ours, on=KEYS, how="outer")
    return in_order(table, get_experiment(technique).labels).reset_index(drop=True)


def _sources(live: pd.DataFrame | None, reference: pd.DataFrame | None) -> list[tuple[str, pd.DataFrame]]:
    found = [(LIVE, live)] + (list(reference.groupby("machine")) if reference is not None else [])
    return [(name, rows) for name, rows in found if rows is not None and not rows.empty]


def _ours(name: str, rows: pd.DataFrame, memory: bool = False) -> pd.DataFrame:
    """One source's columns: median epoch seconds, speed-up with its interval, verdict (and peak memory)."""
    roles = rows["role"] if "role" in rows else pd.Series(CLAIM, index=rows.index)
    columns = {key: rows[key] for key in KEYS} | {
        f"{name} s": rows["epoch_s"].map(significant),
        f"{name} speed-up ({INTERVAL})": [speedup_text(*values)
                                          for values in zip(rows["speedup"], rows["ci_low"], rows["ci_high"])],
        f"{name} verdict": [verdict_text(v, r) for v, r in zip(rows["verdict"], roles)],
    }
    if memory:
        columns[f"{name} peak MiB"] = rows["peak_mem_mb"].map(significant)
    return pd.DataFrame(columns).drop_duplicates(KEYS, keep="last")


def reference_summary(technique: str) -> pd.DataFrame | None:
    """Stored reference summaries of ``technique`` from every machine under ``results/reference``, or None."""
    paths = [p for machine in store.reference_machines() for p in (store.REFERENCE_DIR / machine).glob(f"{technique}.json")]
    if not paths:
        return None
    return pd.concat([store.load_summaries(p) for p in paths], ignore_index=True)


def reference_command(technique: str) -> str:
    """The command that makes a stored GPU reference of ``technique`` (the reference set that measures it)."""
    set_name = next((name for name in SET_NAMES if name != "all" and technique in technique_set(name)), "all")
    return f"`python -m optlab reference --set {set_name}`"


def reference_note(technique: str) -> str:
    """One line: which machines have a stored reference of ``technique``, or how to make one."""
    reference = reference_summary(technique)
    if reference is None:
        return (f"no stored GPU reference of {technique} yet: {reference_command(technique)} on a GPU machine writes "
                "one under results/reference/<machine>/")
    machines = ", ".join(f"{m} ({', '.join(sorted(set(g['profile'])))} profile)" for m, g in reference.groupby("machine"))
    return f"stored GPU reference of {technique}: {machines}"
