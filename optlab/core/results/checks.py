"""What a results folder may hold, file by file: safe names, records the book can read, tables that parse, and a parts
list whose rows the reference run can use. Each check returns what is wrong and what is allowed, or None.

The parts list (``reference-parts.csv``) must have the columns the reference run's readers index: ``part`` (a
non-empty name, once per list), ``status`` (``ok``, ``interrupted``, ``failed: <why>`` or ``stopped: <why>``, a part
ended at its deadline), ``seconds`` (a number from 0), the machine, torch version and commit a part is skipped by
(``device_name``, ``torch``, ``git_commit``), ``profile`` and ``finished`` (an ISO time). Other columns (``set``,
``estimate_s``, ``repeats``, the GPU's state) are optional; ``repeats``, where a row has it, is a number from 0.
"""
from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

from . import store
from ..errors import OptlabError

PARTS_LIST = "reference-parts.csv"
PARTS_COLUMNS = ("part", "status", "seconds", "device_name", "torch", "git_commit", "profile", "finished")
STATUS = re.compile(r"ok|interrupted|failed: .+|stopped: .+")
STATUSES = "ok, interrupted, failed: <why> or stopped: <why>"
RECORD_FIELDS = {"technique": str, "profile": dict, "environment": dict, "samples": list, "summary": list}
OPTIONAL_FIELDS = {"title": str, "section": str, "baseline": str, "variants": dict, "references": dict, "phases": list,
                   "configs": dict, "effective_configs": dict, "notes": list, "memory_kind": str, "rounds": dict}
ROW_KEYS = ("model", "variant", "phase")  # what the book groups a record's samples and summary rows by
JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "true or false", int: "a number",
              float: "a number", type(None): "null"}


def name_problem(name: str) -> str | None:
    """What is wrong with a member's name: a control or other unprintable character, or a backslash."""
    if not name.isprintable() or "\\" in name:
        return "has a control character or a backslash in its name (allowed: printable characters but a backslash)"
    return None


def file_problem(name: str, content: bytes) -> str | None:
    """What is wrong with the result file ``name`` holding ``content``, by its kind."""
    if name == PARTS_LIST:
        return parts_list_problem(content)
    if name.endswith(".json"):
        return record_problem(content)
    if name.endswith(".csv"):
        return _table(content)[1]
    try:
        content.decode()
    except UnicodeDecodeError as error:
        return f"is not UTF-8 text ({error}); a log is the text a run printed"
    return None


def _kind(value: Any) -> str:
    return JSON_TYPES.get(type(value), type(value).__name__)


def _refuse_constant(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON value (a record holds null for a missing number)")


def record_problem(content: bytes) -> str | None:
    """What is wrong with a record: JSON that does not parse, another schema, or a field the book reads missing or of
    the wrong type (see :func:`optlab.core.results.store.make_record`)."""
    try:
        record = json.loads(content, parse_constant=_refuse_constant)
    except ValueError as error:
        return f"is not valid JSON ({' '.join(str(error).split())}); a record is a JSON object"
    if not isinstance(record, dict):
        return f"is {_kind(record)}, and a record is a JSON object"
    if record.get("schema_version") != store.SCHEMA_VERSION:
        return (f"is a record of schema version {record.get('schema_version')}, and this optlab reads version "
                f"{store.SCHEMA_VERSION}")
    for key, kind in {**RECORD_FIELDS, **OPTIONAL_FIELDS}.items():
        if (key in RECORD_FIELDS or key in record) and not isinstance(record.get(key), kind):
            given = f"is {_kind(record[key])}" if key in record else "is missing"
            return f"field {key!r} {given}, and a record's {key} is {JSON_TYPES[kind]}"
    if not isinstance(record["profile"].get("name"), str):
        return "field 'profile' has no string 'name', and a record's profile names itself"
    if not isinstance(record["environment"].get("device_name"), str) or not record["environment"]["device_name"]:
        return "field 'environment' has no device_name string, and a record's environment names its machine"
    return _rows_problem(record, "samples") or _rows_problem(record, "summary")


def _rows_problem(record: dict[str, Any], key: str) -> str | None:
    for index, row in enumerate(record[key]):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ROW_KEYS):
            return (f"{key} row {index} is {_kind(row)} without string {', '.join(ROW_KEYS)}, and each {key} row is "
                    "an object with them")
    return None


def _table(content: bytes) -> tuple[pd.DataFrame | None, str | None]:
    """The table in ``content`` (every value a string), or what stops it from parsing: not UTF-8, no header, a row
    with another number of fields than the header, or anything else pandas stops at."""
    allowed = "a table is UTF-8 CSV with a header and as many fields in each row"
    try:
        reader = csv.reader(io.StringIO(content.decode(), newline=""), strict=True)
        header = next(reader, None)
        for row in reader:
            if row and len(row) != len(header):
                return None, (f"has {len(row)} fields on line {reader.line_num} and {len(header)} in its header; "
                              f"{allowed}")
        return pd.read_csv(io.BytesIO(content), dtype=str), None
    except (ValueError, csv.Error) as error:  # not UTF-8, no header, pandas' parser errors
        return None, f"does not parse as a CSV table ({' '.join(str(error).split())}); {allowed}"


def _number(value: Any) -> float | None:
    """``value`` as a finite number from 0, or None."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _time(value: Any) -> bool:
    try:
        dt.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return False
    return True


def _row_problem(row: dict[str, Any]) -> str | None:
    if pd.isna(row["part"]) or not row["part"].strip():
        return "has an empty part (each row names its part)"
    if not row["part"].isprintable():
        return f"has part {row['part']!r} (allowed: a name of printable characters)"
    if pd.isna(row["status"]) or not STATUS.fullmatch(row["status"]):
        given = "no status" if pd.isna(row["status"]) else f"status {row['status']!r}"
        return f"has {given} (allowed: {STATUSES})"
    if _number(row["seconds"]) is None:
        return f"has seconds {row['seconds']!r} (allowed: a number from 0)"
    empty = [key for key in ("device_name", "torch", "git_commit", "profile") if pd.isna(row[key])]
    if empty:
        return f"has no {', '.join(empty)} (each row names the machine, torch, commit and profile it ran with)"
    if not _time(row["finished"]):
        return f"has finished {row['finished']!r} (allowed: an ISO time, 2026-01-31T12:00:00+00:00)"
    if not pd.isna(row.get("repeats")) and _number(row["repeats"]) is None:
        return f"has repeats {row['repeats']!r} (allowed: a number from 0, or empty)"
    return None


def parts_list_problem(content: bytes) -> str | None:
    """What is wrong with a parts list: it does not parse, lacks a required column or has a row the reference run
    cannot use (the module's docstring says what is allowed)."""
    return _parts_list(content)[1]


def _parts_list(content: bytes) -> tuple[pd.DataFrame | None, str | None]:
    parts, problem = _table(content)
    if problem:
        return None, problem
    missing = [column for column in PARTS_COLUMNS if column not in parts]
    if missing:
        return None, f"lacks the column(s) {', '.join(missing)}; a parts list has {', '.join(PARTS_COLUMNS)}"
    for line, row in enumerate(parts.to_dict(orient="records"), start=2):
        problem = _row_problem(row)
        if problem:
            return None, f"line {line} {problem}"
    twice = parts["part"][parts["part"].duplicated()]
    if not twice.empty:
        return None, f"lists part {twice.iloc[0]!r} twice, and each part has one row"
    return parts, None


def read_parts_list(path: Path) -> pd.DataFrame:
    """The parts list at ``path``, every value a string; one that :func:`parts_list_problem` refuses is an
    OptlabError naming it."""
    parts, problem = _parts_list(path.read_bytes())
    if problem:
        raise OptlabError(f"{store.display_path(path)} {problem}: fix it, or move it away and run again")
    return parts
