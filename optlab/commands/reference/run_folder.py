"""The one owner of a reference run's output folder: its parts list (``reference-parts.csv``), its log, its archive,
the line that stops the run when the folder can no longer be written, and each part's deadline.

The run asks this object, and nothing else, what the folder holds and when a part must end; the writes themselves
are :mod:`.outputs`' and :mod:`.parts_list`'s.
"""
from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any, Iterator

from ...core.knobs.profiles import Profile
from ...core.process import shutdown
from ...core.results import store
from .outputs import RunLog, check_outputs, output_problem, stop_line
from .parts_list import Part, note_part, read_manifest, recorded
from .planning import PACK_RESERVE_S, part_limit_s


class PartOverran(BaseException):
    """A part ran past its deadline: it is ended where it stands, recorded as stopped, and the run goes on. A
    BaseException, as :class:`~optlab.core.process.shutdown.Interrupted` is, so that a study's own ``except
    Exception`` cannot keep it running."""


class RunFolder:
    """A reference run's output folder ``out``, packed into ``archive`` (if given) after every part, for the run
    keyed by ``key`` (the machine, torch and commit) in ``profile``, whose ``deadline`` (on
    :func:`~optlab.core.process.shutdown.now`'s clock; None: no budget) every part's deadline stays inside."""

    def __init__(self, out: str | Path, archive: str | Path | None, key: dict[str, str], profile: Profile,
                 deadline: float | None = None) -> None:
        self.out, self.archive, self.key, self.profile, self.deadline = Path(out), archive, key, profile, deadline
        self.path: Path | None = None
        self.log: RunLog | None = None

    def check(self) -> None:
        """Before anything is written: refuse a folder or archive that cannot be written, and a parts list edited
        by hand, each in one line."""
        check_outputs(self.out, self.archive)
        if self.out.is_dir():
            read_manifest(self.out)

    def open(self) -> "RunFolder":
        """Create the folder and start the run's log; the folder itself."""
        self.path = store.writable_dir(self.out)
        self.log = RunLog(self.path, self.archive)
        return self

    @property
    def name(self) -> str:
        """The folder as the run prints it."""
        return store.display_path(self.path or self.out)

    def recorded(self, parts: list[Part]) -> set[str]:
        """The names of ``parts`` already recorded here for this run's key and profile (none before the folder
        exists)."""
        return recorded(parts, self.out, self.key, self.profile) if self.out.is_dir() else set()

    def note(self, part: Part, status: str, seconds: float, gpu: dict[str, Any], repeats: int | None) -> None:
        """The part's row in the parts list, written whole (a signal meanwhile is raised after it)."""
        note_part(self.path, part, self.key, self.profile, status, seconds, gpu, repeats)

    def problem(self, error: BaseException) -> OSError | None:
        """The OSError behind ``error`` that means nothing more can be written here (None: the part's own error)."""
        return output_problem(error, self.path)

    def stop_line(self, problem: OSError, part: Part, kept: int) -> str:
        """The one line a run ends with when this folder can no longer be written."""
        return stop_line(problem, self.path, part, kept)

    def save(self, final: bool = False) -> None:
        """The log written and the archive packed (see :meth:`RunLog.save`)."""
        self.log.save(final)

    def part_deadlines(self, part: Part, start: float) -> tuple[float, float]:
        """When ``part``, started at ``start``, stops at the end of a repeat, and when it is ended where it stands:
        :func:`~.planning.part_limit_s` after its start, the hard one later by the grace a repeat needs to end (a
        study's tables have no repeats: both are the same), and neither past the run's deadline less the reserve to
        pack."""
        soft, hard = part_limit_s(part)
        last = None if self.deadline is None else self.deadline - PACK_RESERVE_S
        return tuple(start + limit if last is None else min(start + limit, last) for limit in (soft, hard))

    @contextlib.contextmanager
    def within(self, part: Part, start: float) -> Iterator[float]:
        """Run ``part`` under its deadlines: yields the soft one (a technique's run stops at a repeat's end past
        it), and raises :class:`PartOverran` in this thread at the hard one."""
        soft, hard = self.part_deadlines(part, start)

        def overran(_signum: int, _frame: Any) -> None:
            raise PartOverran(f"past its deadline of {hard - start:.0f} s")

        before = signal.signal(signal.SIGALRM, overran)
        signal.setitimer(signal.ITIMER_REAL, max(hard - shutdown.now(), 0.01))
        try:
            yield soft
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
