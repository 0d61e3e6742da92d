"""A pytest plugin (``-p tests.process_audit``) that notes which tests start a process or a thread, fork, send or
handle a signal, or sleep, and writes them as JSON (test id -> what it did) to the file named by
``OPTLAB_PROCESS_AUDIT``: the tests ``tools/repeat_tests.py`` runs twenty times in a row. What a fixture shared
beyond one test (module, class, package or session scope) did while it was set up is noted with :data:`SHARED`: a
repeat inside one session would not set it up again, so such a test is repeated as whole sessions."""
import json
import multiprocessing.process
import os
import signal
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

DID: dict[str, set[str]] = defaultdict(set)
CURRENT: list[str] = []  # the test running now, if any
SETTING_UP: list[str] = []  # the scopes of the fixtures being set up now, the innermost last
SHARED = "in a fixture shared beyond the test"
WATCHED = [  # (owner, attribute, what a call does)
    (subprocess.Popen, "_execute_child", "starts a process"),
    (multiprocessing.process.BaseProcess, "start", "starts a process"),
    (os, "fork", "forks"),
    (os, "posix_spawn", "starts a process"),
    (os, "kill", "sends a signal"),
    (os, "killpg", "sends a signal"),
    (signal, "pthread_kill", "sends a signal"),
    (signal, "raise_signal", "sends a signal"),
    (signal, "alarm", "sends a signal"),
    (signal, "setitimer", "sends a signal"),
    (signal, "signal", "handles a signal"),
    (threading.Thread, "start", "starts a thread"),
    (time, "sleep", "sleeps"),
]


def noting(original, what: str):
    def call(*args, **kwargs):
        if CURRENT:
            shared = any(scope != "function" for scope in SETTING_UP)
            DID[CURRENT[0]].add(f"{what} {SHARED}" if shared else what)
        return original(*args, **kwargs)
    return call


def pytest_configure(config):
    for owner, name, what in WATCHED:
        if hasattr(owner, name):
            setattr(owner, name, noting(getattr(owner, name), what))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    CURRENT[:] = [item.nodeid]
    try:
        return (yield)
    finally:
        CURRENT.clear()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    SETTING_UP.append(fixturedef.scope)
    try:
        return (yield)
    finally:
        SETTING_UP.pop()


def pytest_sessionfinish(session):
    record = {nodeid: sorted(did) for nodeid, did in sorted(DID.items())}
    Path(os.environ["OPTLAB_PROCESS_AUDIT"]).write_text(json.dumps(record, indent=1))
