"""The table of contents, and the chapters' runs and one build of the book per session (tests/chapter_runs.py).

Running every chapter takes minutes, so a background process starts on them as soon as the tests are collected and
runs while the other tests run; the chapters' own tests go after the other tests and share what is left, and the
tests that read the book, built from those runs, go last.
"""
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import chapter_runs
import slowest

# One torch thread per process (set before any test imports torch; subprocesses inherit it): the background runs
# and the tests share the cores, and oversubscribed threads spin (training steps ten times slower, measured here).
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "_build"
# The tests never see a user's data folder: an empty one gives every run the stand-in, whatever the machine holds.
NO_DATA = BUILD / "test-data"
NO_DATA.mkdir(parents=True, exist_ok=True)
os.environ["OPTLAB_DATA"] = str(NO_DATA)
os.environ.pop("OPTLAB_LIVE_DIR", None)  # the chapters write their records where the book's summary page reads them
# The CI size, whatever the machine; the chapters' runs are the book's pages (tests/chapter_runs.py), so they run as
# the book's build runs them (book/_ext/book_pages.py): progress as text, links to the site's pages and records.
SMOKE_ENV = {**os.environ, "OPTLAB_PROFILE": "smoke", "OPTLAB_BOOK": "1"}
RUNNER = pytest.StashKey[subprocess.Popen]()
CPU_SECONDS = pytest.StashKey[dict]()  # each test's CPU seconds, its children's with it (tests/slowest.py)
CHAPTER_TEST = "test_notebook_runs_under_nbval"
BESIDE_BUILD = "beside_the_book_build"  # the marker of slow tests that fill the wait for the book's build
SLOW = "slow"  # the full tier's own tests, left out of `make check` (`-m "not slow"`)
BOOK_FIXTURES = {"book", "book_worker"}  # a test that reads the build, or the browser's visits to it


def start_runner(stems: list[str], book: bool) -> subprocess.Popen:
    """The background worker: it runs ``stems``' chapters and, with ``book``, builds the book from every chapter."""
    chapter_runs.start_afresh()
    command = [sys.executable, str(Path(chapter_runs.__file__)), *stems, *(["--book"] if book else [])]
    with chapter_runs.RUNNER_LOG.open("w") as log:  # where the worker's own failure, if any, is told
        return subprocess.Popen(command, cwd=ROOT, env=SMOKE_ENV, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_order(items: list) -> tuple[list, list, list]:
    """The tests in the order they run, and the chapters' and the book's among them: the other tests first, then the
    chapters' own, then (when the book is built) the tests marked ``beside_the_book_build``, which run while the
    background worker builds the book instead of leaving this process idle, and the tests that read the book last."""
    chapters = [item for item in items if getattr(item, "originalname", "") == CHAPTER_TEST]
    needs_book = [item for item in items if "book" in item.fixturenames]
    beside_build = [item for item in items if needs_book and item.get_closest_marker(BESIDE_BUILD)]
    moved = chapters + beside_build + needs_book
    return [item for item in items if item not in moved] + moved, chapters, needs_book


def is_slow(item) -> bool:
    """A test of the full tier only: a chapter's run, a test that reads the book (the browser's among them), one
    marked ``beside_the_book_build`` (processes of its own) or one marked ``slow``. Every other test is fast."""
    return (getattr(item, "originalname", "") == CHAPTER_TEST or bool(BOOK_FIXTURES & set(item.fixturenames))
            or any(item.get_closest_marker(name) for name in (BESIDE_BUILD, SLOW)))


def pytest_itemcollected(item):
    """Mark the full tier's tests ``slow`` as they are collected, before ``-m`` selects: a new test is fast unless it
    runs a chapter, needs the book or is marked, so ``make check`` (``-m "not slow"``) never starts the chapters."""
    if is_slow(item):
        item.add_marker(SLOW)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    ordered, chapters, needs_book = run_order(items)
    if (chapters or needs_book) and not config.option.collectonly:
        items[:] = ordered
        stems = chapter_runs.all_chapters() if needs_book else [item.callspec.id for item in chapters]
        config.stash[RUNNER] = start_runner(stems, book=bool(needs_book))


def pytest_runtest_setup(item):
    """A test marked ``cuda`` skips where there is no CUDA device: the one place that condition is written, so that
    ``make gpu-check`` selects CUDA-only tests by their marker, whatever else may skip them."""
    import torch

    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (marked cuda: make gpu-check runs it on a GPU)")


def pytest_sessionfinish(session):
    """Stop the background worker if it is still running when the session ends early (its chapters with it)."""
    runner = session.config.stash.get(RUNNER, None)
    if runner is not None and runner.poll() is None:
        runner.send_signal(signal.SIGTERM)
        runner.wait()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Note each test's CPU seconds (setup, call and teardown, and the children it waited for)."""
    started = slowest.cpu_seconds()
    try:
        return (yield)
    finally:
        item.config.stash.setdefault(CPU_SECONDS, {})[item.nodeid] = slowest.cpu_seconds() - started


def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, at its end: the ten slowest chapters under nbval and the worker's steps after them
    (the book's build, the browser), and the ten slowest other tests, each with its seconds."""
    if terminalreporter.config.stash.get(RUNNER, None):
        terminalreporter.write_sep("=", f"the {slowest.COUNT} slowest chapters under nbval")
        for line in slowest.lines(slowest.slowest_chapters(chapter_runs.finished_runs())):
            terminalreporter.write_line(line)
        for line in slowest.lines(list(chapter_runs.step_seconds().items())):
            terminalreporter.write_line(line)
    reports = [report for reports in terminalreporter.stats.values() for report in reports]
    terminalreporter.write_sep("=", f"the {slowest.COUNT} slowest tests (setup, call and teardown; wall clock and CPU)")
    cpu = terminalreporter.config.stash.get(CPU_SECONDS, {})
    for line in slowest.lines(slowest.slowest_tests(reports, leave_out=CHAPTER_TEST), cpu):
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def smoke_env() -> dict[str, str]:
    return SMOKE_ENV


@pytest.fixture(scope="session")
def toc_pages() -> list[str]:
    """Every page of ``_toc.yml`` (root first), as paths without suffix relative to the book root."""
    return chapter_runs.book_pages()


@dataclass(frozen=True)
class Build:
    html: Path
    log: str


@pytest.fixture(scope="session")
def book_worker(request) -> subprocess.Popen:
    """The background worker that runs the chapters, builds the book and then opens its pages in a browser."""
    if request.config.stash.get(RUNNER, None) is None:
        request.config.stash[RUNNER] = start_runner(chapter_runs.all_chapters(), book=True)
    return request.config.stash[RUNNER]


@pytest.fixture(scope="session")
def book(book_worker) -> Build:
    """The finished build: its HTML folder and its log without colour codes."""
    status = chapter_runs.wait_for_build(book_worker)
    assert chapter_runs.BUILD_LOG.exists(), f"the chapters' worker ended early:\n{chapter_runs.RUNNER_LOG.read_text()}"
    log = re.sub(r"\x1b\[[0-9;]*m", "", chapter_runs.BUILD_LOG.read_text())
    assert status == 0, f"the book build failed (log: {chapter_runs.BUILD_LOG}):\n{log[-8000:]}"
    return Build(BUILD / "html", log)


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as if it had no CUDA device, so CPU-only behaviour is tested on GPU machines too."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
