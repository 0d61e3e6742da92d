"""A results folder as one compressed file, and back.

:func:`pack` writes every result file of a folder (records, tables, the parts list, the log) into one ``.tar.gz``,
atomically: a machine or batch job that hands back only a few files loses nothing. :func:`unpack` reads it back into a
folder, merging with what is there, after checking every member first: plain files of known kinds only, no path that
leaves the folder, records of this schema version, and one machine, the folder's own. A refused archive writes nothing.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

import pandas as pd

from . import store
from .errors import OptlabError

SUFFIXES = (".json", ".csv", ".log")  # what a results folder holds
MANIFEST_NAME = "reference-parts.csv"  # the parts list: its rows are merged, not replaced
MAX_MEMBER_BYTES = 256 * 2**20  # a results file is KiB to a few MiB; anything larger is not one


def result_files(folder: Path) -> list[Path]:
    """The result files of ``folder`` (no hidden or temporary files, no subfolders), sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SUFFIXES and not p.name.startswith("."))


def pack(folder: Path, path: str | Path, extra: dict[str, bytes] | None = None) -> tuple[Path, list[str]]:
    """Write ``folder``'s result files (and ``extra`` name: bytes, which win over a file of the same name) into the
    tar.gz ``path`` under ``<folder name>/``, atomically. Returns the path and the member names."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = extra or {}
    members = {p.name: p.read_bytes() for p in result_files(folder) if p.name not in extra} | extra
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            with tarfile.open(fileobj=handle, mode="w:gz") as tar:
                for name in sorted(members):
                    info = tarfile.TarInfo(f"{folder.name}/{name}")
                    info.size, info.mode = len(members[name]), 0o644
                    tar.addfile(info, io.BytesIO(members[name]))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, 0o644)  # a file to hand over, not a private temporary one
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path, [f"{folder.name}/{name}" for name in sorted(members)]


def _refuse(archive: Path, why: str) -> OptlabError:
    return OptlabError(f"refused {str(archive)!r}: {why}; nothing was written")


def read_members(archive: str | Path) -> tuple[str, dict[str, bytes]]:
    """The folder name and the files of an archive :func:`pack` wrote, after checking that every member is a plain
    result file directly under one folder (no links, devices, absolute paths or ``..``)."""
    archive = Path(archive)
    try:
        tar = tarfile.open(archive, mode="r:gz")
    except (OSError, tarfile.TarError) as error:
        raise OptlabError(f"cannot read {str(archive)!r} as a .tar.gz archive: {error}") from error
    folders, files = set(), {}
    with tar:
        for member in tar.getmembers():
            path = PurePosixPath(member.name)
            if member.isdir() and len(path.parts) == 1 and path.parts[0] not in ("..", "."):
                continue
            if not member.isfile() or path.is_absolute() or len(path.parts) != 2 or ".." in path.parts \
                    or path.suffix not in SUFFIXES or path.name.startswith("."):
                raise _refuse(archive, f"unsafe or unexpected member {member.name!r} (only result files "
                                       f"({', '.join(SUFFIXES)}) directly under one folder are unpacked)")
            if member.size > MAX_MEMBER_BYTES:
                raise _refuse(archive, f"member {member.name!r} is {member.size:,} bytes, more than a results file")
            folders.add(path.parts[0])
            files[path.name] = tar.extractfile(member).read()
    if len(folders) != 1:
        raise _refuse(archive, f"expected the files of one folder, found {len(folders)} ({', '.join(sorted(folders))})")
    return folders.pop(), files


def _machines(files: dict[str, bytes], archive: Path, what: str) -> set[str]:
    """The machines the records and the parts list among ``files`` were made on; a record of another schema, or one
    that does not read, is refused."""
    machines = set()
    for name, content in files.items():
        if name.endswith(".json"):
            try:
                record = json.loads(content)
            except ValueError as error:
                raise _refuse(archive, f"{what} {name} is not valid JSON ({error})") from error
            version = record.get("schema_version") if isinstance(record, dict) else None
            if version != store.SCHEMA_VERSION:
                raise _refuse(archive, f"{what} {name} is a record of schema version {version}, and this optlab "
                                       f"reads version {store.SCHEMA_VERSION}")
            machines.add(str(record.get("environment", {}).get("device_name")))
        elif name == MANIFEST_NAME:
            parts = pd.read_csv(io.BytesIO(content), dtype=str)
            if "device_name" in parts:
                machines.update(parts["device_name"].dropna())
    return machines


def _merged_manifest(old: bytes | None, new: bytes) -> bytes:
    """The parts list with every part of both, the archive's row winning for a part in both."""
    if old is None:
        return new
    rows = pd.concat([pd.read_csv(io.BytesIO(old), dtype=str), pd.read_csv(io.BytesIO(new), dtype=str)],
                     ignore_index=True)
    return rows.drop_duplicates("part", keep="last").to_csv(index=False).encode()


def _merged_log(old: bytes | None, new: bytes) -> bytes:
    """The log: the archive's, after the folder's own unless the archive's already starts with it."""
    return new if old is None or new.startswith(old) else old + new


def unpack(archive: str | Path, destination: str | Path | None = None) -> tuple[Path, list[str]]:
    """Merge the archive into ``destination`` (default: ``results/reference/<the archive's folder name>``): every
    file is checked first, then written atomically; records and tables replace those of the same name, the parts list
    and the log are merged. Refuses (an OptlabError, nothing written) a member that is unsafe, a record of another
    schema, or files from another machine than the archive's other files or the folder's own records."""
    archive = Path(archive)
    name, files = read_members(archive)
    folder = Path(destination) if destination is not None else store.REFERENCE_DIR / name
    machines = _machines(files, archive, "archived")
    if len(machines) > 1:
        raise _refuse(archive, f"its files come from more than one machine ({', '.join(sorted(machines))})")
    present = {p.name: p.read_bytes() for p in result_files(folder)} if folder.is_dir() else {}
    here = _machines({n: c for n, c in present.items() if n.endswith(".json") or n == MANIFEST_NAME}, archive,
                     f"{store.display_path(folder)}'s")
    if machines and here and machines != here:
        raise _refuse(archive, f"its results are from {', '.join(sorted(machines))}, and "
                               f"{store.display_path(folder)} holds results from {', '.join(sorted(here))}: "
                               "unpack it into a folder of its own (--out)")
    folder = store.writable_dir(folder)
    for member, content in files.items():
        if member == MANIFEST_NAME:
            content = _merged_manifest(present.get(member), content)
        elif member.endswith(".log"):
            content = _merged_log(present.get(member), content)
        store.atomic_write_bytes(folder / member, content)
    return folder, sorted(files)
