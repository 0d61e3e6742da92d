"""Where a reference run writes: the trial writes before the first part, the disk or permission problems that stop a
run, and the log that keeps every part's lines.
"""
from __future__ import annotations

import contextlib
import errno
import io
import tempfile
from pathlib import Path

from ...core.results import archive as archives, store
from ...core.errors import OptlabError
from ...core.process import shutdown
from .parts_list import Part


LOG = "reference.log"  # <out>/reference.log: what every run printed, one run after the other


FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk (or the quota) is full


UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # read-only, or not ours to write


def folder_writable(folder: Path) -> bool:
    try:
        store.writable_dir(folder)
    except OptlabError:
        return False
    return True


def output_problem(error: BaseException, folder: Path) -> OSError | None:
    """The OSError behind ``error`` that means no more results can be written to ``folder``: a full disk or quota
    anywhere, or a permission or read-only error while ``folder`` itself cannot be written any more. None when the
    error is the part's own."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and (seen.errno in FULL or (seen.errno in UNWRITABLE
                                                                 and not folder_writable(folder))):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def stop_line(problem: OSError, folder: Path, part: Part, kept: int) -> str:
    """The one line a run ends with when ``folder`` can no longer be written."""
    where = f" ({problem.filename})" if problem.filename else ""
    return (f"cannot write results to {store.display_path(folder)}: {problem.strerror or problem}{where}; stopped "
            f"at part {part.name}, and the {kept} part(s) this run finished are kept there. Free some space (or pass "
            "--out with a folder you can write to) and run the same command again: it skips every part already "
            "recorded")


class PackFailed(OptlabError):
    """The archive could not be written: the run stops at once, since nothing it measures from now on would be kept."""


class RunLog:
    """What this run printed, saved to ``<out>/reference.log`` after the earlier runs' lines, and the folder packed
    into ``archive``: after every part, and when the run ends."""

    def __init__(self, folder: Path, archive: str | Path | None) -> None:
        self.folder, self.archive, self.buffer = folder, archive, io.StringIO()
        try:
            self.before = (folder / LOG).read_text() if (folder / LOG).is_file() else ""
        except OSError:
            self.before = ""

    def save(self, final: bool = False) -> None:
        """Write the log and, with an archive, pack the folder into it (the log included even where the folder
        could not take it); ``final``: say where the archive is. A signal meanwhile waits for the pack to end. Raises
        :class:`PackFailed`, in one line, where the archive cannot be written."""
        text = self.before + self.buffer.getvalue()
        with shutdown.held(then_raise=not final):
            with contextlib.suppress(OSError):  # a folder that cannot take the log has already stopped the run
                store.atomic_write_text(self.folder / LOG, text)
            if self.archive is None:
                return
            try:
                written, members = archives.pack(self.folder, self.archive, extra={LOG: text.encode()})
            except OSError as error:
                raise PackFailed(f"the archive {str(self.archive)!r} could not be written ({error.strerror or error}); "
                                 f"the results are in {store.display_path(self.folder)}") from error
        if final:
            print(f"archive: {written} ({len(members)} files, {written.stat().st_size / 1024:.0f} KiB); unpack it "
                  f"with python -m optlab reference --unpack {written}")


def nearest_existing(path: Path) -> Path:
    """``path`` itself or the closest folder above it that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def trial_write(folder: Path, what: str) -> None:
    """Write and remove a temporary file in ``folder`` (or in the closest folder above it that exists, which a run
    would create it in), so that a folder the run cannot write is refused before anything is written."""
    where = nearest_existing(folder)
    try:
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(where))
        with tempfile.NamedTemporaryFile(dir=where, prefix=".write-check-"):
            pass
    except OSError as error:
        raise OptlabError(f"{what} {str(folder)!r} cannot be written ({error.strerror or error}"
                          f"{'' if where == folder.absolute() else f' in {str(where)!r}'}); pass a path you can "
                          "write to") from error


def check_outputs(out: str | Path, archive: str | Path | None) -> None:
    """Refuse, before the first part and writing nothing, an output folder or an archive path that cannot be
    written."""
    trial_write(Path(out), "output folder")
    if archive is not None:
        archive = Path(archive)
        if archive.is_dir():
            raise OptlabError(f"--archive {str(archive)!r} is a folder; give a file name, such as run.tar.gz")
        trial_write(archive.parent, "the folder of --archive")
