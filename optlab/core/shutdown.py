"""How a long run ends on time or on a signal: a deadline counted from the process start, and the signals that a job's
time limit sends (SIGTERM, SIGINT, SIGHUP) turned into one exception the run can clean up after.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator

ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _process_age_s() -> float:
    """Seconds since this process started (the kernel's start time, so the interpreter's start and every import
    count); 0 where /proc cannot say."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, counted from field 3 after the command name
        uptime = float(open("/proc/uptime").read().split()[0])
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


@contextlib.contextmanager
def signals_interrupt() -> Iterator[list[int]]:
    """Within the block, SIGTERM, SIGINT and SIGHUP raise :class:`Interrupted` once (later ones are ignored, so that
    the clean-up is not cut short); the previous handlers come back after it. Yields the list of signals received
    (the one that raised, where it was raised outside the block's own code). Outside the main thread, where Python
    cannot install handlers, the block runs as it is."""
    raised: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield raised
        return

    def handler(signum: int, frame: object) -> None:
        if not raised:
            raised.append(signum)
            raise Interrupted(signum)

    previous = {signum: signal.signal(signum, handler) for signum in ENDING_SIGNALS}
    try:
        yield raised
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
