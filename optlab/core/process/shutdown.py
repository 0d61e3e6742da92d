"""How a long run ends on time or on a signal: a deadline counted from the process start, and the signals that a job's
time limit or a terminal sends (SIGTERM, SIGINT, SIGHUP), to the run's process or to its whole process group, turned
into one exception the run can clean up after.

A signal is never lost. The handler records it, then raises :class:`Interrupted` at once (the fast path); where that
raise lands in code that swallows exceptions (an at-fork hook, a ``__del__``: Python would print it as "Exception
ignored", which the run keeps quiet), the record stays, and :func:`check`, called at every round, part and pack,
raises it again, as does every later signal. Clean-up code runs inside
:func:`held`, where signals are recorded but raise nothing, so a second signal cannot cut a pack short.

Children leave the clean-up to the run: a process forked while the handler is installed ignores the ending signals
from its first instruction; :func:`ignore_in_child` is the initializer that does the same in a spawned child, and
:func:`leave_to_the_run` the loader workers' ``worker_init_fn`` (torch sets their SIGTERM handler after the fork).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _process_age_s() -> float:
    """Seconds since this process started (the kernel's start time, so the interpreter's start and every import
    count); 0 where /proc cannot say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, counted from field 3 after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


PROCESS_START = time.monotonic() - _process_age_s()  # on time.monotonic()'s clock


def now() -> float:
    """The clock every deadline is on: time.monotonic() (tests replace it)."""
    return time.monotonic()


class Interrupted(BaseException):
    """A signal asked the run to end. A BaseException, as KeyboardInterrupt is, so that code which records a failed
    part and goes on lets it pass."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal: 128 + its number."""
        return 128 + self.signum


class _State:
    """The one handler's state in this process: the signals received, the process that installed it (a forked child
    inherits the handler, but not the run), how deep the installs and the held blocks are."""

    received: list[int] = []
    owner: int | None = None
    installs = 0
    holding = 0
    ignoring = False  # a child of a run, ignoring the ending signals


def _children_may_end(signum: int, frame: object) -> None:
    """SIGCHLD once the run is ending: children a group signal ended exit now, as expected, and nothing is raised
    (torch's loader raises an error for a worker that a signal ended). A handler, not ``SIG_DFL``, so that a SIGCHLD
    already pending when it is set still finds one: Python raises "Signal 17 ignored due to race condition" where it
    finds none."""


def _handler(signum: int, frame: object) -> None:
    if os.getpid() != _State.owner:  # a child forked before it could ignore the signal: the run cleans up
        return
    if not _State.received:  # from now to the process's end, children's exits are expected: a late one too
        signal.signal(signal.SIGCHLD, _children_may_end)
    _State.received.append(signum)
    if not _State.holding:
        raise Interrupted(_State.received[0])


def received() -> list[int]:
    """The ending signals received since the outermost :func:`signals_interrupt` began, first first (none outside
    one)."""
    return list(_State.received) if _State.owner == os.getpid() else []


def check() -> None:
    """Raise :class:`Interrupted` for a signal received earlier whose raise was swallowed (outside :func:`held`)."""
    if _State.received and not _State.holding and _State.owner == os.getpid():
        raise Interrupted(_State.received[0])


@contextlib.contextmanager
def held(then_raise: bool = True) -> Iterator[None]:
    """Within the block a signal is recorded and raises nothing (a pack, a clean-up). With ``then_raise``, a block
    that ends normally raises it afterwards (:func:`check`); without, the run is ending anyway (its last clean-up)."""
    _State.holding += 1
    try:
        yield
    finally:
        _State.holding -= 1
    if then_raise:
        check()


def ignore_in_child(*_: object) -> None:
    """In a child process of the run: ignore the ending signals, so that a signal to the process group leaves the
    clean-up to the run. Takes and ignores any arguments, to serve as a DataLoader's ``worker_init_fn``."""
    _State.ignoring = True
    for signum in ENDING_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _exit_quietly(signum: int, frame: object) -> None:
    os._exit(0)


def leave_to_the_run(*_: object) -> None:
    """In a loader worker of the run: ignore Ctrl-C and hang-ups, and exit at once, quietly, on SIGTERM, the way its
    parent ends it (a process-group SIGTERM reaches it too, and the run cleans up; a worker that exits 0 raises no error
    in the parent, where one killed by the signal would); a connection the ending run closed prints nothing. Takes and ignores any arguments: a DataLoader's
    ``worker_init_fn``."""
    ignore_in_child()
    signal.signal(signal.SIGTERM, _exit_quietly)
    sys.excepthook = _quiet_when_the_run_left


def _quiet_when_the_run_left(kind: type, error: BaseException, trace: object) -> None:
    """A worker's thread that lost its connection to the run (the run ended while it handed over a batch: EOFError,
    a reset connection) prints nothing; anything else is reported as Python would."""
    if not isinstance(error, (EOFError, ConnectionError)):
        sys.__excepthook__(kind, error, trace)


def _after_fork_in_child() -> None:
    if _State.owner is not None and _State.installs:
        ignore_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def active() -> bool:
    """Whether this process runs inside :func:`signals_interrupt`, or is a child of such a run: its own children
    should then ignore the ending signals."""
    return (_State.installs > 0 and _State.owner == os.getpid()) or _State.ignoring


@contextlib.contextmanager
def signals_interrupt() -> Iterator[list[int]]:
    """Within the block, SIGTERM, SIGINT and SIGHUP raise :class:`Interrupted` (see the module's docstring); the
    previous handlers come back after the outermost block. Blocks nest: an inner one shares the outer's record.
    Yields the live list of signals received. Outside the main thread, where Python cannot install handlers, the block
    runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    if _State.installs and _State.owner == os.getpid():
        _State.installs += 1
        try:
            yield _State.received
        finally:
            _State.installs -= 1
        return
    _State.received, _State.owner, _State.installs, _State.holding = [], os.getpid(), 1, 0
    previous = {signum: signal.signal(signum, _handler) for signum in ENDING_SIGNALS}
    previous_hook = sys.unraisablehook

    def quiet_swallowed_signal(unraisable: "sys.UnraisableHookArgs") -> None:
        """A raise that Python could not pass on (an at-fork hook, a ``__del__``) prints nothing: it is on record,
        and :func:`check` raises it again."""
        if not isinstance(unraisable.exc_value, Interrupted):
            previous_hook(unraisable)

    sys.unraisablehook = quiet_swallowed_signal
    try:
        yield _State.received
    finally:
        _State.installs, _State.owner, _State.received = 0, None, []  # what the caller was given stays as it was
        sys.unraisablehook = previous_hook
        for signum, old in previous.items():
            signal.signal(signum, old)

