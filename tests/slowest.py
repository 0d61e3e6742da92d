"""The slowest chapters and tests of a run, printed at its end (tests/conftest.py): where the wait for a run goes."""
import resource
from collections import defaultdict
from collections.abc import Iterable

COUNT = 10


def slowest_tests(reports: Iterable, leave_out: str, count: int = COUNT) -> list[tuple[str, float]]:
    """The ``count`` tests that took longest, setup, call and teardown together, slowest first; the tests whose name
    starts with ``leave_out`` (the chapters' own, timed by their runs) are left out. ``reports`` are pytest's test
    reports (anything with ``nodeid``, ``when`` and ``duration``); other objects among them are passed over."""
    seconds: dict[str, float] = defaultdict(float)
    for report in reports:
        if getattr(report, "when", None) in ("setup", "call", "teardown"):
            seconds[report.nodeid] += report.duration
    kept = [(nodeid, took) for nodeid, took in seconds.items() if not nodeid.split("::")[-1].startswith(leave_out)]
    return sorted(kept, key=lambda pair: -pair[1])[:count]


def slowest_chapters(runs: Iterable, count: int = COUNT) -> list[tuple[str, float]]:
    """The ``count`` chapters whose nbval run took longest, slowest first (``runs``: tests/chapter_runs.py's)."""
    return sorted(((run.stem, run.seconds) for run in runs), key=lambda pair: -pair[1])[:count]


def cpu_seconds() -> float:
    """The CPU seconds (user and system) of this process and of the children it has waited for, so far: on a machine
    shared with other work, what a test costs, where its wall-clock seconds also count the others' work."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def lines(pairs: list[tuple[str, float]], cpu: "dict[str, float] | None" = None) -> list[str]:
    """One line a chapter or test: its seconds, right-aligned, then (where ``cpu`` has it) its CPU seconds, then its
    name."""
    cpu = cpu or {}
    return [f"{took:8.1f} s" + (f" {cpu[name]:8.1f} s CPU" if name in cpu else "") + f"  {name}"
            for name, took in pairs]
