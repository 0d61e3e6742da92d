"""The signals' values where one signal cannot tell: two signals before a check (the run ends for the first), and a
process forked inside a run (it counts as inside, so its own loaders still get the worker hook)."""
import os
import signal
import sys
import time

import pytest

from optlab.core.process import shutdown
from optlab.core.process.shutdown import Interrupted, signals_interrupt


def test_a_check_after_two_held_signals_raises_the_first_and_keeps_both_in_order():
    with signals_interrupt() as received:
        with pytest.raises(Interrupted) as stop:
            with shutdown.held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGHUP)
                time.sleep(0.05)
        assert stop.value.signum == signal.SIGTERM and stop.value.exit_code == 128 + signal.SIGTERM
        assert received == shutdown.received() == [signal.SIGTERM, signal.SIGHUP]
        with pytest.raises(Interrupted) as again:  # each later check says the same
            shutdown.check()
        assert again.value.signum == signal.SIGTERM


def test_a_signal_after_a_swallowed_one_raises_the_first():
    with signals_interrupt():
        with shutdown.held(then_raise=False):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        with pytest.raises(Interrupted) as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)
        assert stop.value.signum == signal.SIGINT


def _in_child(check) -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0 if check() else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_process_forked_inside_a_run_is_inside_the_run_and_one_forked_outside_is_not():
    """A child of the run (a variant's process, a loader's parent) counts as inside: its loaders then give their
    workers the hook that leaves clean-up to the run. Outside a run nothing does."""
    assert not shutdown.active() and _in_child(shutdown.active) == 1
    with signals_interrupt():
        assert shutdown.active()
        assert _in_child(shutdown.active) == 0
        assert _in_child(lambda: not shutdown.received()) == 0  # the run's record stays the run's
    assert not shutdown.active() and _in_child(shutdown.active) == 1


def _pending_child_exit_meets_the_run_s_end() -> bool:
    seen, errors = [], []
    sys.unraisablehook = lambda unraisable: errors.append(unraisable.exc_value)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGCHLD})
    signal.signal(signal.SIGCHLD, lambda signum, frame: seen.append(signum))  # as torch's loader does
    with signals_interrupt() as received, shutdown.held(then_raise=False):
        os.kill(os.getpid(), signal.SIGCHLD)
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGCHLD})  # both handled now, in order
        time.sleep(0.05)
    print("received", received, "torch's handler saw", seen, "errors", errors, file=sys.stderr)
    return received == [signal.SIGTERM] and seen == [] and errors == []  # torch's no longer runs


def test_a_child_s_exit_already_pending_when_the_run_ends_raises_no_error():
    """A loader worker's exit (SIGCHLD, with torch's handler installed) arrives in the same instant as the ending
    signal: Python runs the SIGTERM handler first, which stops watching the children; the pending SIGCHLD must still
    find a handler (Python raises "Signal 17 ignored due to race condition" where it finds none). Checked in a forked
    process, which has one thread and no children: in the suite's process another thread takes a signal the main
    thread blocks, and another test's child can end at any moment."""
    assert _in_child(_pending_child_exit_meets_the_run_s_end) == 0
