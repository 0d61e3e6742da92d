"""Results on disk: one JSON record per run, written atomically, loaded back into DataFrames."""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from ..errors import OptlabError

SCHEMA_VERSION = 2  # 2: four verdicts, a reference per variant, repeats until the answers are clear
REPO_ROOT = Path(__file__).resolve().parents[3]  # optlab/core/results/store.py: three folders below the repository
REFERENCE_DIR = REPO_ROOT / "results" / "reference"
DISTRIBUTED_DIR = REPO_ROOT / "results" / "distributed"  # the stored multi-process runs
LIVE_ENV = "OPTLAB_LIVE_DIR"
# the latest run of each chapter on this machine (not committed); the tests give each process its own folder
LIVE_DIR = Path(os.environ.get(LIVE_ENV) or REPO_ROOT / "results" / "live")


def make_record(*, experiment, profile, environment, configs, effective, notes, memory_kind, samples: pd.DataFrame,
                summary: pd.DataFrame, rounds: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything a run knows: the experiment, every knob, the environment, the raw samples and the summaries."""
    return {
        "schema_version": SCHEMA_VERSION,
        "technique": experiment.name,
        "title": experiment.title,
        "section": experiment.section,
        "baseline": experiment.baseline_label,
        "variants": {label: changes for label, changes in experiment.variants},
        "references": experiment.comparisons,
        "phases": list(experiment.phases),
        "profile": profile_record(profile),
        "environment": environment,
        "configs": configs,
        "effective_configs": effective,
        "notes": notes,
        "memory_kind": memory_kind,
        "rounds": rounds or {},  # per model: how many repeats ran and why they stopped
        "samples": _records(samples),
        "summary": _records(summary),
    }


def profile_record(profile) -> dict[str, Any]:
    """A profile as a record stores it."""
    return _clean(vars(profile) | {"models": list(profile.models)})


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: _clean(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]


def _clean(value: Any) -> Any:
    """JSON-safe, inside lists and dicts too: NaN and infinities become null, numpy values Python ones."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def writable_dir(path: str | Path) -> Path:
    """Create ``path`` if needed and check that a file can be written there, before any work is done."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as error:
        raise OptlabError(f"output folder {str(folder)!r} cannot be written ({error.strerror or error}); "
                          "pass --out with a folder you can write to") from error
    return folder


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file beside ``path``, flush it to disk, then rename it over ``path``."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, content: bytes) -> None:
    """:func:`atomic_write_text` for bytes."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def record_filename(technique: str) -> str:
    """The default file name of a record: the technique and a UTC timestamp."""
    return f"{technique}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S%fZ')}.json"


def display_path(path: str | Path) -> str:
    """``path`` as a message shows it: relative to the repository or the working folder where it lies in either, by
    its name alone in a temporary folder (a page must not show the machine's own), else whole, so that the reader can
    find it."""
    path = Path(path).resolve()
    for root in (REPO_ROOT, Path.cwd()):
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return path.name if path.is_relative_to(Path(tempfile.gettempdir()).resolve()) else str(path)


def save_record(record: dict[str, Any], folder: str | Path, filename: str | None = None) -> Path:
    """Save ``record`` as JSON in ``folder`` (replacing the file whole); the default name is :func:`record_filename`."""
    folder = writable_dir(folder)
    path = folder / (filename or record_filename(record["technique"]))
    atomic_write_text(path, json.dumps(_clean(record), indent=1, allow_nan=False) + "\n")
    return path


RUN_KEY = ("device_name", "torch", "git_commit")  # with the profile: what makes two records' numbers comparable


def same_run(record: dict[str, Any], environment: dict[str, Any], profile) -> bool:
    """Whether ``record`` was made on the machine, torch version and commit of ``environment``, with ``profile``'s
    sizes."""
    stored = record.get("environment", {})
    return record.get("profile") == profile_record(profile) and all(stored.get(k) == environment[k] for k in RUN_KEY)


def resumable(path: Path, environment: dict[str, Any], profile) -> dict[str, Any] | None:
    """The record at ``path`` if it exists, reads, and is :func:`same_run`; else None (it will be replaced)."""
    if not path.is_file():
        return None
    try:
        record = load_record(path)
    except OptlabError:
        return None
    return record if same_run(record, environment, profile) else None


def load_record(path: str | Path) -> dict[str, Any]:
    """Load one record, checking that it is an optlab record of a schema this version reads."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise OptlabError(f"cannot read results file {str(path)!r}: {error}") from error
    if not isinstance(record, dict) or record.get("schema_version") != SCHEMA_VERSION:
        raise OptlabError(f"{str(path)!r} is not an optlab record of schema version {SCHEMA_VERSION}")
    return record


def record_paths(location: str | Path) -> list[Path]:
    location = Path(location)
    return sorted(location.rglob("*.json")) if location.is_dir() else [location]


def _frame(records: Iterable[dict[str, Any]], table: str) -> pd.DataFrame:
    frames = []
    for record in records:
        frame = pd.DataFrame(record[table])
        env = record["environment"]
        if "technique" not in frame:
            frame.insert(0, "technique", record["technique"])
        frame["machine"] = env.get("gpu_name") or env.get("device_name")
        frame["profile"] = record["profile"]["name"]
        frame["data_source"] = env.get("data_source")
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def load_samples(location: str | Path) -> pd.DataFrame:
    """The tidy samples of every record in a file or folder, stamped with technique, machine and profile."""
    return _frame(map(load_record, record_paths(location)), "samples")


def load_summaries(location: str | Path) -> pd.DataFrame:
    """The summary rows of every record in a file or folder."""
    return _frame(map(load_record, record_paths(location)), "summary")


def reference_machines() -> list[str]:
    """The machines with stored reference results (one folder each under ``results/reference``)."""
    return sorted(p.name for p in REFERENCE_DIR.iterdir() if p.is_dir()) if REFERENCE_DIR.is_dir() else []


def save_table(frame: pd.DataFrame, folder: str | Path, name: str) -> Path:
    """Write a chapter's extra table (a sweep, a micro-benchmark) as ``folder/<name>.csv``, atomically."""
    path = writable_dir(folder) / f"{name}.csv"
    atomic_write_text(path, frame.to_csv(index=False))
    return path


def reference_tables(name: str, reference_dir: str | Path | None = None) -> pd.DataFrame | None:
    """Every stored ``<machine>/<name>.csv`` under the reference folder, with a ``machine`` column; None if none."""
    root = Path(reference_dir) if reference_dir is not None else REFERENCE_DIR
    paths = sorted(root.glob(f"*/{name}.csv"))
    if not paths:
        return None
    return pd.concat([pd.read_csv(p).assign(machine=p.parent.name) for p in paths], ignore_index=True)
