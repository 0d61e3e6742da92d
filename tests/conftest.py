"""The table of contents, and the chapters' runs and one build of the book per session (tests/chapter_runs.py).

``make test`` runs on every core with pytest-xdist. Each chapter's run is a test of its own, so the workers take the
chapters and the other tests from one queue and none waits while another has work left; the tests run in an order
that gives the book's build time to finish beside them (``run_order``), and the tests that read the book go last.
"""
import gc
import os
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

import chapter_runs
import slowest

# One torch thread per process (set before any test imports torch; subprocesses inherit it): the workers, the builder
# and the tests' own processes share the cores, and oversubscribed threads spin (training steps ten times slower).
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
# pytest-xdist's own variables stay out: a chapter's nbval run is a pytest session of its own, not a worker.
SMOKE_ENV = {**{name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")},
             "OPTLAB_PROFILE": "smoke", "OPTLAB_BOOK": "1"}
RUN_ID = pytest.StashKey[str]()  # one id for the session, shared by its xdist workers
CHAPTERS_FOR_BUILDER = pytest.StashKey[list]()  # the chapters this session does not run itself
NEEDS_BOOK = pytest.StashKey[bool]()
CHAPTER_TEST = "test_notebook_runs_under_nbval"
BESIDE_BUILD = "beside_the_book_build"  # the marker of slow tests in processes of their own, run while the book builds
SLOW = "slow"  # the full tier's own tests, left out of `make check` (`-m "not slow"`)
NEEDS_RUNS = "needs_the_chapters_runs"  # a chapter's run or a test that reads the book built from the runs
CPU_AT_START = pytest.StashKey[float]()
CPU_PROPERTY = "cpu_s"  # a test's CPU seconds, carried on its teardown report (tests/slowest.py)


def test_file(item) -> str:
    return item.nodeid.split("::", 1)[0]


def run_order(items: list) -> tuple[list, list, list]:
    """The tests in the order they run, and the chapters' and the book's among them: the chapters first, each a
    test of its own, so that the book can build while the rest run; then the test files holding a slow test (marked
    ``slow`` or ``beside_the_book_build``: processes of their own, minutes together; long work goes early so that
    the workers end together), then the other tests, and last every test of a file that holds a test reading the
    book, which waits for the build."""
    chapters = [item for item in items if getattr(item, "originalname", "") == CHAPTER_TEST]
    needs_book = [item for item in items if "book" in item.fixturenames]
    book_files = {test_file(item) for item in needs_book}
    slow_files = {test_file(item) for item in items if item not in chapters and is_slow(item)} - book_files

    def rank(item) -> int:
        if item in chapters:
            return 0
        return 3 if test_file(item) in book_files else 1 if test_file(item) in slow_files else 2
    return sorted(items, key=rank), chapters, needs_book


def is_slow(item) -> bool:
    """A test of the full tier only: a chapter's run, a test that reads the book (the browser's among them), one
    marked ``beside_the_book_build`` (processes of its own) or one marked ``slow``. Every other test is fast."""
    return needs_the_runs(item) or any(item.get_closest_marker(name) for name in (BESIDE_BUILD, SLOW))


def pytest_configure(config):
    """The session's run id: xdist's workers are given the controller's, so they start the chapters' runs once."""
    if hasattr(config, "workerinput"):
        config.stash[RUN_ID] = config.workerinput["testrunuid"]
        return
    config.stash[RUN_ID] = getattr(config.option, "testrunuid", None) or uuid.uuid4().hex
    if hasattr(config.option, "testrunuid"):  # pytest-xdist's: the id its workers get
        config.option.testrunuid = config.stash[RUN_ID]


def pytest_itemcollected(item):
    """Mark the full tier's tests ``slow`` as they are collected, before ``-m`` selects: a new test is fast unless it
    runs a chapter, needs the book or is marked, so ``make check`` (``-m "not slow"``) never starts the chapters. A
    chapter's run and a test that reads the book are marked ``needs_the_chapters_runs`` too (``make repeat`` leaves
    them out)."""
    if is_slow(item):
        item.add_marker(SLOW)
    if needs_the_runs(item):
        item.add_marker(NEEDS_RUNS)


def needs_the_runs(item) -> bool:
    """A chapter's run, or a test that reads the book built from the chapters' runs."""
    return getattr(item, "originalname", "") == CHAPTER_TEST or "book" in item.fixturenames


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    items[:], chapters, needs_book = run_order(items)
    chosen = {item.callspec.id for item in chapters}
    config.stash[CHAPTERS_FOR_BUILDER] = [stem for stem in chapter_runs.all_chapters() if stem not in chosen]
    config.stash[NEEDS_BOOK] = bool(needs_book)


def pytest_collection_finish(session):
    """What the collection built (every test module, and torch's and the other packages' modules they import) lives
    as long as the session: it is moved out of the garbage collector's reach, so that a full collection walks only what
    the tests make. A collection otherwise walks half a million objects, a quarter of a second, and the studies under
    test collect between comparisons and tries (``gc.collect()``), hundreds of times in a worker."""
    gc.freeze()


CPU_QUOTA = Path("/sys/fs/cgroup/cpu.max")  # a container's CPU limit (cgroup v2): "max 100000", or "200000 100000"


def cores_in_quota(cores: int, quota: str | None) -> int:
    """``cores``, capped at the whole cores a cgroup ``cpu.max`` line allows (at least one)."""
    limit, _, period = (quota or "max").strip().partition(" ")
    return cores if limit == "max" else max(1, min(cores, int(limit) // int(period)))


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: pytest-xdist's count (one worker a core), capped by a container's CPU quota, which the CPU count
    does not see: two cores' quota on a large host would otherwise start a worker for each of the host's cores."""
    from xdist.plugin import pytest_xdist_auto_num_workers as counted

    return cores_in_quota(counted(config), CPU_QUOTA.read_text() if CPU_QUOTA.exists() else None)


def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadfile``, each test file goes to one worker as a whole (its module fixtures are built once),
    but each chapter's run goes on its own, and in the order ``run_order`` gives, not by the files' sizes."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ChaptersApart(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if CHAPTER_TEST in nodeid else super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return ChaptersApart(config, log)


@pytest.fixture(scope="session")
def chapter_session(request, smoke_env) -> None:
    """This session's chapter runs, started afresh by whichever of its processes comes first; in a session that reads
    the book, the builder too (tests/chapter_runs.py)."""
    config = request.config
    chapter_runs.begin(config.stash[RUN_ID])
    if config.stash.get(NEEDS_BOOK, False):
        session = os.getppid() if hasattr(config, "workerinput") else os.getpid()  # xdist's controller, or this
        chapter_runs.start_builder(config.stash[CHAPTERS_FOR_BUILDER], smoke_env, session)


def pytest_runtest_setup(item):
    """A test marked ``cuda`` skips where there is no CUDA device: the one place that condition is written, so that
    ``make gpu-check`` selects CUDA-only tests by their marker, whatever else may skip them."""
    import torch

    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (marked cuda: make gpu-check runs it on a GPU)")


def pytest_sessionfinish(session):
    """Stop the builder if it still runs when the session ends (its chapters with it): in the session's controller
    or single process, after every worker has ended."""
    config = session.config
    if not hasattr(config, "workerinput") and chapter_runs.began(config.stash[RUN_ID]):
        chapter_runs.stop_builder()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Note where each test's CPU seconds start (setup, call and teardown, and the children it waited for)."""
    item.stash[CPU_AT_START] = chapter_runs.cpu_seconds_without_builder()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """The teardown report carries the test's CPU seconds to the end of the run (from an xdist worker too)."""
    report = yield
    if call.when == "teardown" and CPU_AT_START in item.stash:
        spent = chapter_runs.cpu_seconds_without_builder() - item.stash[CPU_AT_START]
        report.user_properties.append((CPU_PROPERTY, spent))
    return report


def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, at its end: the ten slowest chapters under nbval and the builder's steps after them
    (the book's build, the browser), and the ten slowest other tests, each with its seconds."""
    reports = [report for reports in terminalreporter.stats.values() for report in reports]
    if chapter_runs.began(terminalreporter.config.stash[RUN_ID]):
        terminalreporter.write_sep("=", f"the {slowest.COUNT} slowest chapters under nbval")
        for line in slowest.lines(slowest.slowest_chapters(chapter_runs.finished_runs())):
            terminalreporter.write_line(line)
        for line in slowest.lines(list(chapter_runs.step_seconds().items())):
            terminalreporter.write_line(line)
    terminalreporter.write_sep("=", f"the {slowest.COUNT} slowest tests (setup, call and teardown; wall clock and CPU)")
    cpu = {report.nodeid: value for report in reports for name, value in getattr(report, "user_properties", ())
           if name == CPU_PROPERTY}
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
def book(chapter_session) -> Build:
    """The finished build, once the builder has made it: its HTML folder and its log without colour codes."""
    status = chapter_runs.wait_for_build()
    assert chapter_runs.BUILD_LOG.exists(), f"the builder ended early:\n{chapter_runs.RUNNER_LOG.read_text()}"
    log = re.sub(r"\x1b\[[0-9;]*m", "", chapter_runs.BUILD_LOG.read_text())
    assert status == 0, f"the book build failed (log: {chapter_runs.BUILD_LOG}):\n{log[-8000:]}"
    return Build(BUILD / "html", log)


@pytest.fixture(autouse=True)
def no_figure_left_open():
    """Every figure a test leaves open is closed after it: a later test's axes-level plot (seaborn's, pyplot's)
    would draw on the current one, so what a test draws would depend on which tests ran before it in its worker."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as if it had no CUDA device, so CPU-only behaviour is tested on GPU machines too."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
