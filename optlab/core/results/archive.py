"""A results folder as one compressed file, and back.

:func:`pack` writes every result file of a folder (records, tables, the parts list, the log) into one ``.tar.gz``,
atomically: a machine or batch job that hands back only a few files loses nothing. :func:`unpack` reads it back into a
folder, merging with what is there, after checking every member first: plain files of known kinds only, under safe
names, no path that leaves the folder, each file well formed (:mod:`optlab.core.results.checks`: records of this schema
the book can read, tables that parse, a parts list the reference run can use), and one machine, the folder's own. A
refused archive writes nothing.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

import pandas as pd

from . import store
from ..errors import OptlabError
from .checks import PARTS_LIST, file_problem, name_problem

SUFFIXES = (".json", ".csv", ".log")  # what a results folder holds
MANIFEST_NAME = PARTS_LIST  # the parts list: its rows are merged, not replaced
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
    result file directly under one folder, once, under a printable name (no links, devices, absolute paths or ``..``),
    and that the archive reads to its end."""
    archive = Path(archive)
    try:
        tar = tarfile.open(archive, mode="r:gz")
    except (OSError, tarfile.TarError) as error:
        raise OptlabError(f"cannot read {str(archive)!r} as a .tar.gz archive: {error}") from error
    folders, files = set(), {}
    try:
        with tar:
            for member in tar:
                _check_member(archive, member, files)
                if member.isfile():
                    folders.add(PurePosixPath(member.name).parts[0])
                    files[PurePosixPath(member.name).name] = tar.extractfile(member).read()
    except (OSError, EOFError, zlib.error, tarfile.TarError) as error:
        raise _refuse(archive, f"it is damaged ({error}); a .tar.gz that --archive wrote reads to its end") from error
    if len(folders) != 1:
        raise _refuse(archive, f"expected the files of one folder, found {len(folders)} ({', '.join(sorted(folders))})")
    return folders.pop(), files


def _check_member(archive: Path, member: tarfile.TarInfo, files: dict[str, bytes]) -> None:
    """Refuse ``member`` unless it is the one folder, or a plain result file of a safe name directly under it that
    ``files`` does not hold yet."""
    path = PurePosixPath(member.name)
    problem = name_problem(member.name)
    if problem:
        raise _refuse(archive, f"member {member.name!r} {problem}")
    if member.isdir() and len(path.parts) == 1 and path.parts[0] not in ("..", "."):
        return
    if not member.isfile() or path.is_absolute() or len(path.parts) != 2 or ".." in path.parts \
            or path.suffix not in SUFFIXES or path.name.startswith("."):
        raise _refuse(archive, f"unsafe or unexpected member {member.name!r} (only result files "
                               f"({', '.join(SUFFIXES)}) directly under one folder are unpacked)")
    if member.size > MAX_MEMBER_BYTES:
        raise _refuse(archive, f"member {member.name!r} is {member.size:,} bytes, more than a results file")
    if path.name in files:
        raise _refuse(archive, f"member {member.name!r} appears twice (each file is archived once)")


def first_problem(files: dict[str, bytes]) -> tuple[str, str] | None:
    """The first of ``files`` (by name) that is not well formed, and what is wrong with it
    (:func:`optlab.core.results.checks.file_problem`); None when all are."""
    for name in sorted(files):
        problem = file_problem(name, files[name])
        if problem:
            return name, problem
    return None


def _machines(files: dict[str, bytes]) -> set[str]:
    """The machines the records and the parts list among ``files`` (checked by :func:`check_files`) were made on."""
    machines = set()
    for name, content in files.items():
        if name.endswith(".json"):
            machines.add(json.loads(content)["environment"]["device_name"])
        elif name == MANIFEST_NAME:
            machines.update(pd.read_csv(io.BytesIO(content), dtype=str)["device_name"])
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


def _merged(name: str, old: bytes | None, new: bytes) -> bytes:
    """What file ``name`` holds after the merge: the parts list and the log merged, any other file the archive's."""
    if name == MANIFEST_NAME:
        return _merged_manifest(old, new)
    return _merged_log(old, new) if name.endswith(".log") else new


def unpack(archive: str | Path, destination: str | Path | None = None) -> tuple[Path, list[str]]:
    """Merge the archive into ``destination`` (default: ``results/reference/<the archive's folder name>``): every
    file is checked first, then written atomically; records and tables replace those of the same name, the parts list
    and the log are merged. Refuses (an OptlabError, nothing written) a member that is unsafe or not well formed (a
    record of another schema or with malformed fields, a table that does not parse, a parts list with a missing
    column or a bad row), a record or parts list already in the folder that is not well formed, or files from another
    machine than the archive's other files or the folder's own records."""
    archive = Path(archive)
    name, files = read_members(archive)
    bad = first_problem(files)
    if bad:
        raise _refuse(archive, f"member {f'{name}/{bad[0]}'!r} {bad[1]}")
    folder = Path(destination) if destination is not None else store.REFERENCE_DIR / name
    machines = _machines(files)
    if len(machines) > 1:
        raise _refuse(archive, f"its files come from more than one machine ({', '.join(sorted(machines))})")
    present = {p.name: p.read_bytes() for p in result_files(folder)} if folder.is_dir() else {}
    read_here = {n: c for n, c in present.items() if n.endswith(".json") or n == MANIFEST_NAME}
    bad = first_problem(read_here)
    if bad:
        raise _refuse(archive, f"{store.display_path(folder / bad[0])}, already there, {bad[1]}: fix or move it, or "
                               "unpack into a folder of its own (--out)")
    here = _machines(read_here)
    if machines and here and machines != here:
        raise _refuse(archive, f"its results are from {', '.join(sorted(machines))}, and "
                               f"{store.display_path(folder)} holds results from {', '.join(sorted(here))}: "
                               "unpack it into a folder of its own (--out)")
    merged = {member: _merged(member, present.get(member), content) for member, content in files.items()}
    folder = store.writable_dir(folder)
    for member, content in merged.items():
        store.atomic_write_bytes(folder / member, content)
    return folder, sorted(files)
