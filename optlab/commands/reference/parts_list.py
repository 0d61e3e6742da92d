"""The parts list of a results folder (``reference-parts.csv``): what ran, with its key, status and seconds, and what
an earlier run already recorded.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ...core.results import checks as results_check, store
from ...core.machine.device import DeviceInfo
from ...core.machine.environment import git_commit
from ...core.run.experiments import ExperimentResult
from ...core.knobs.profiles import Profile


@dataclass(frozen=True)
class Part:
    """One unit of the reference run: a technique on one model, or one study's tables."""

    set_name: str
    name: str
    steps: int  # training and evaluation steps, warm-up included (0 for tables)
    estimate_s: float  # estimated seconds on one H200
    technique: str | None = None
    model: str | None = None
    module: str | None = None  # a study whose run_reference writes tables
    needs_cuda: bool = False
    estimate_from: str = "table"  # "table", or "measured (<machine folder>)" where an earlier run timed the part


MANIFEST = "reference-parts"  # <out>/reference-parts.csv: every part that ran, with its key, status and seconds


def run_key(info: DeviceInfo) -> dict[str, str]:
    """What a recorded part must share with this run to be skipped: the machine, torch version and commit."""
    return {"device_name": info.name, "torch": torch.__version__, "git_commit": git_commit()}


def read_manifest(folder: Path) -> pd.DataFrame:
    """The parts list of ``folder`` (empty if none); one with a missing column or a bad row is an OptlabError."""
    path = folder / f"{MANIFEST}.csv"
    return results_check.read_parts_list(path) if path.is_file() else pd.DataFrame(columns=["part"])


def recorded(parts: list[Part], folder: Path, key: dict[str, str], profile: Profile) -> set[str]:
    """The names of ``parts`` already recorded under ``folder`` for ``key``: a technique's model in its record (made
    with ``profile``), a study's tables in the manifest with status ok (tables have sizes of their own)."""
    done = set()
    manifest = read_manifest(folder)
    records = {part.technique: store.resumable(folder / f"{part.technique}.json", key, profile)
               for part in parts if part.technique}
    for part in parts:
        if part.technique:
            record = records[part.technique]
            if record and part.model in {row["model"] for row in record["samples"]}:
                done.add(part.name)
        elif not manifest.empty:
            rows = manifest[(manifest["part"] == part.name) & (manifest["status"] == "ok")]
            if any(all(row[k] == v for k, v in key.items()) for _, row in rows.iterrows()):
                done.add(part.name)
    return done


def note_part(folder: Path, part: Part, key: dict[str, str], profile: Profile, status: str, seconds: float,
               gpu: dict[str, Any], repeats: int | None) -> None:
    row = {"part": part.name, "set": part.set_name, "status": status, "seconds": round(seconds, 1),
           "estimate_s": round(part.estimate_s, 1), "estimate_from": part.estimate_from, **key,
           "profile": profile.name, "repeats": repeats, **gpu,
           "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    manifest = read_manifest(folder)
    manifest = manifest[manifest["part"] != part.name] if not manifest.empty else None
    store.save_table(pd.concat([manifest, pd.DataFrame([row])], ignore_index=True), folder, MANIFEST)


def repeats_run(result: ExperimentResult | None, part: Part, profile: Profile) -> int | None:
    """How many times ``part`` ran each variant: its discarded repeats and the timed ones it took (None for tables
    and for a part that has no result)."""
    if result is None or part.model is None:
        return None
    rounds = result.record.get("rounds", {}).get(part.model)
    return profile.warmup_repeats + rounds["repeats"] if rounds else None
