"""Every chapter runs once under nbval, and the test book is built from those runs.

Each chapter is a test of its own (tests/test_notebooks.py), which pytest-xdist's workers take like any other; a
session that reads the book also starts one background process, the builder (``python tests/chapter_runs.py --book
STEM ...``). A chapter goes to the process that claims it first (a file created only where none exists), so none runs
twice; any other waits for its result. The builder runs only the chapters the session did not select, waits for
the others, stores every executed notebook (nbval writes each back: ``tests/nbval_outputs.py``) in a jupyter-cache
and builds the book from it, so the build executes only the summary page, which reads the records the chapters
wrote. It then opens every page of the build in a browser (``tests/site_visits.py``) while the workers run the other
tests; the tests that read the build come last.
"""
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import yaml

import slowest
import warm_kernels

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "_build"
RUNS = BUILD / "chapter-runs"
EXECUTED = RUNS / "executed"
CACHE = RUNS / "jupyter-cache"
BUILD_LOG = BUILD / "test-build.log"
BUILD_STATUS = RUNS / "build-status"  # the build's exit status, written when it ends
VISITS = RUNS / "site-visits.json"  # what the browser found on every page of the build (tests/site_visits.py)
VISITS_LOG = RUNS / "site-visits.log"
RUNNER_LOG = RUNS / "builder.log"
BUILDER_PID = RUNS / "builder.pid"
BUILDER_EXIT = RUNS / "builder-exit"  # the builder's exit status, written as it ends
RUN_ID = BUILD / "chapter-runs.id"  # the session whose runs RUNS holds
RUN_LOCK = BUILD / "chapter-runs.lock"
KERNELSPECS = RUNS / "jupyter"  # JUPYTER_PATH of the chapters' nbval runs: the kernelspec of warm kernels
WARM_LOG = RUNS / "warm-kernels.log"
STEP_SECONDS = RUNS / "step-seconds.json"  # the seconds of the book's build and of the browser's visits
BUILD_CONFIG = RUNS / "book-config.yml"
BOOK_LIVE = ROOT / "results" / "live"  # the chapters write their records here and the summary page reads them
NOTEBOOKS = ROOT / "notebooks"
TIMEOUT_S = 900  # a chapter's whole nbval run; the target is a minute, so only a hang gets near this
POLL_S = 0.5
RUNNING: set[int] = set()  # the process groups of the chapters running now, stopped with this process
REAPING = threading.Lock()  # held while this process reaps the builder it started and counts its CPU seconds
BUILDER: list[subprocess.Popen] = []  # the builder, where this process started it (its reaper thread waits for it)
BUILDER_CPU_S = [0.0]  # the CPU seconds of that builder and all it waited for, once reaped


@dataclass(frozen=True)
class ChapterRun:
    """How one chapter's nbval run ended."""
    stem: str
    returncode: int | None  # None: stopped at the timeout
    seconds: float
    cells_reported: int  # the cells nbval reported on (each code cell, if it collected them all)
    output: str  # the end of nbval's output

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def result_path(stem: str) -> Path:
    return RUNS / f"{stem}.json"


def start_afresh() -> None:
    """Forget earlier runs and the records they wrote: the summary page shows only this session's."""
    for stale in (RUNS, BOOK_LIVE, BUILD / ".doctrees", BUILD / "html", BUILD / "jupyter_execute"):
        shutil.rmtree(stale, ignore_errors=True)
    BUILD_LOG.unlink(missing_ok=True)
    EXECUTED.mkdir(parents=True)


def begin(run: str) -> None:
    """Start the session ``run``'s chapter runs afresh, once, whichever of its processes asks first (pytest-xdist's
    workers share one run id)."""
    BUILD.mkdir(exist_ok=True)
    with RUN_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not began(run):
            start_afresh()
            warm_kernels.kernelspec(KERNELSPECS, warm_kernels.socket_name(run))
            RUN_ID.write_text(run)


def began(run: str) -> bool:
    """True once the session ``run`` has started its chapter runs."""
    return RUN_ID.exists() and RUN_ID.read_text() == run


def start_builder(run_here: list[str], env: dict[str, str], session_pid: int) -> None:
    """The builder, started by the first of the session's processes to ask: it runs the chapters among ``run_here``
    that no one has claimed, waits for every other chapter's run, builds the book and opens its pages. It ends with
    the session, whose controller is ``session_pid`` (:func:`watch_session`)."""
    if not claim("book"):
        return
    with RUNNER_LOG.open("w") as log:  # where the builder's own failure, if any, is told
        process = subprocess.Popen([sys.executable, __file__, "--book", f"--session={session_pid}", *run_here],
                                   cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    reap_apart(process)
    written = BUILDER_PID.with_suffix(".tmp")
    written.write_text(str(process.pid))
    written.replace(BUILDER_PID)


def reap_apart(process: subprocess.Popen) -> None:
    """Wait for ``process`` (the builder) in a thread of its own and keep its CPU seconds out of the tests':
    a child's CPU joins this process's ``RUSAGE_CHILDREN`` when it is reaped, which would otherwise happen in whatever
    test is running then (``subprocess`` reaps a forgotten ``Popen`` when the next one starts), and the book's build
    and the browser's visits are two minutes of CPU that test never spent
    (:func:`cpu_seconds_without_builder`)."""
    BUILDER.append(process)
    spent = BUILDER_CPU_S

    def reap() -> None:
        while True:
            with REAPING:
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    process.returncode = os.waitstatus_to_exitcode(status)
                    spent[0] += usage.ru_utime + usage.ru_stime
                    return
            time.sleep(POLL_S)

    threading.Thread(target=reap, name="builder reaper", daemon=True).start()


def cpu_seconds_without_builder() -> float:
    """This process's CPU seconds and those of the children it waited for (``slowest.cpu_seconds``), less the builder
    it started: what the tests themselves cost."""
    with REAPING:
        return slowest.cpu_seconds() - BUILDER_CPU_S[0]


def builder_running() -> bool:
    """True while the builder has not ended (or is being started)."""
    if BUILDER_EXIT.exists():
        return False
    if not BUILDER_PID.exists():
        return (RUNS / "book.claim").exists()  # claimed a moment ago, its process not started yet
    return _alive(int(BUILDER_PID.read_text()))


def wait_for_builder() -> None:
    """Return once the builder has ended (the browser's visits done)."""
    while builder_running():
        time.sleep(POLL_S)


def stop_builder() -> None:
    """Stop the builder if it still runs (a session that ends early): it stops the chapters it runs with it."""
    if builder_running() and BUILDER_PID.exists():
        os.kill(int(BUILDER_PID.read_text()), signal.SIGTERM)


def claim(stem: str) -> bool:
    """True for the one process that gets to run ``stem``."""
    try:
        descriptor = os.open(RUNS / f"{stem}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(descriptor, str(os.getpid()).encode())
    os.close(descriptor)
    return True


def run_chapter(stem: str, env: dict[str, str]) -> ChapterRun:
    """``stem``'s notebook under nbval in a process of its own (stopped with its kernel if it overruns); its result
    is written for any process that waits on it, and returned. Its kernel is this Python's, forked from the builder's
    warm parent where it runs (tests/warm_kernels.py), else started afresh."""
    report = RUNS / f"{stem}.xml"
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--nbval-lax", f"--nbval-kernel-name={warm_kernels.KERNEL_NAME}",
         "-p", "no:cacheprovider", "-p", "tests.nbval_outputs", f"--junit-xml={report}", "-q",
         str(NOTEBOOKS / f"{stem}.ipynb")],
        cwd=ROOT, env={**env, "OPTLAB_EXECUTED_DIR": str(EXECUTED), "JUPYTER_PATH": str(KERNELSPECS)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    RUNNING.add(process.pid)
    try:
        stdout, _ = process.communicate(timeout=TIMEOUT_S)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        returncode = None
    finally:
        RUNNING.discard(process.pid)
    cells = sum(1 for _ in ET.parse(report).getroot().iter("testcase")) if report.exists() else 0
    run = ChapterRun(stem, returncode, time.monotonic() - started, cells, stdout[-8000:])
    written = result_path(stem).with_suffix(".tmp")
    written.write_text(json.dumps(run.__dict__))
    written.replace(result_path(stem))  # whole or absent, for a process that waits on it
    return run


def read_run(path: Path) -> ChapterRun:
    return ChapterRun(**json.loads(path.read_text()))


def finished_runs() -> list[ChapterRun]:
    return [read_run(result_path(stem)) for stem in all_chapters() if result_path(stem).exists()]


def wait_for(stem: str) -> ChapterRun:
    """The result of ``stem``'s run by the process that claimed it, or that will: a chapter the session selected may
    not be claimed yet (its worker is still on another test, or between two)."""
    deadline = time.monotonic() + TIMEOUT_S + 120
    while not result_path(stem).exists():
        try:
            claimer = int((RUNS / f"{stem}.claim").read_text() or 0)
        except FileNotFoundError:
            claimer = 0  # not claimed yet: 0 counts as alive, as a claim whose pid is not written yet does
        if not _alive(claimer):
            raise RuntimeError(f"the process that ran {stem} (pid {claimer}) ended without a result")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no result for {stem} after {TIMEOUT_S + 120} s")
        time.sleep(POLL_S)
    return read_run(result_path(stem))


def run_or_wait(stem: str, env: dict[str, str]) -> ChapterRun:
    return run_chapter(stem, env) if claim(stem) else wait_for(stem)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # claimed a moment ago, the pid not written yet
    for builder in BUILDER:
        if builder.pid == pid:
            return builder.returncode is None  # its reaper thread waits for it
    try:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return False  # this process's own child, ended (and now reaped)
    except ChildProcessError:
        pass  # another process's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def all_chapters() -> list[str]:
    return sorted(path.stem for path in NOTEBOOKS.glob("*.ipynb"))


def book_pages() -> list[str]:
    """Every page of ``_toc.yml`` (root first), as paths without suffix relative to the book root."""
    def walk(node):
        if isinstance(node, dict):
            yield from ([node["file"]] if "file" in node else [])
            for key in ("parts", "chapters", "sections"):
                for child in node.get(key, []):
                    yield from walk(child)
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"], *walk(toc)]


def build_book(env: dict[str, str]) -> int:
    """The book built from the chapters' runs (``-W -n``, as ``make book`` builds it): their outputs come from a
    jupyter-cache, so the build executes only the pages that are not chapters. Returns the build's exit status."""
    from jupyter_cache import get_cache

    cache = get_cache(CACHE)
    for stem in all_chapters():
        cache.cache_notebook_file(EXECUTED / f"{stem}.ipynb", uri=str(NOTEBOOKS / f"{stem}.ipynb"))
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"].update(execute_notebooks="cache", cache=str(CACHE))
    extensions = config["sphinx"]["local_extensions"]  # a config outside the book root names them by full path
    config["sphinx"]["local_extensions"] = {name: str(ROOT / folder) for name, folder in extensions.items()}
    BUILD_CONFIG.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [str(Path(sys.executable).parent / "jupyter-book"), "build", ".", "--config", str(BUILD_CONFIG),
               "-W", "-n", "--keep-going"]
    with BUILD_LOG.open("w") as log:
        return run_to_end(command, env, log)


def run_to_end(command: list[str], env: dict[str, str], log) -> int:
    """``command``'s exit status, its output in ``log``; stopped with this process."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    RUNNING.add(process.pid)
    return process.wait()


def visit_site(env: dict[str, str]) -> int:
    """Every page of the build opened in a browser (``tests/site_visits.py``), its findings in ``VISITS``."""
    command = [sys.executable, str(Path(__file__).with_name("site_visits.py")), str(BUILD / "html"), str(VISITS)]
    with VISITS_LOG.open("w") as log:
        return run_to_end(command, env, log)


def wait_for_build() -> int | None:
    """The exit status of the book's build by the builder, once it ends; ``None`` if the builder ended without one."""
    while not BUILD_STATUS.exists() and builder_running():
        time.sleep(POLL_S)
    return int(BUILD_STATUS.read_text()) if BUILD_STATUS.exists() else None


def kill_running() -> None:
    """Kill the chapters and steps this process runs now, with their process groups."""
    for group in list(RUNNING):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def stop(*_) -> None:
    kill_running()
    sys.exit(1)


def watch_session(session_pid: int, run: str) -> None:
    """End this builder, and the chapter or build it runs, once its session is over without having stopped it: the
    session's controller gone (killed by a signal that left it no time to stop the builder, as a timeout's SIGTERM
    does) or a later session begun. Nothing is written then: the folders are the next session's."""
    def watch() -> None:
        while _alive(session_pid) and began(run):
            time.sleep(POLL_S)
        kill_running()
        os._exit(1)

    threading.Thread(target=watch, name="session watch", daemon=True).start()


def main(stems: list[str], book: bool) -> int:
    """Run the unclaimed chapters among ``stems``, from the last (a test session takes them from the first); with
    ``book``, wait for every chapter, build the book from their runs and open its pages in a browser."""
    signal.signal(signal.SIGTERM, stop)
    env = dict(os.environ)
    kernels = start_warm_kernels(env) if book else None
    for stem in reversed(stems):
        if claim(stem):
            run_chapter(stem, env)
    if not book:
        return 0
    failed = [run.stem for run in map(wait_for, all_chapters()) if not run.passed]
    kernels.terminate()  # every chapter has run: its memory goes back before the build
    kernels.wait()
    if failed:
        BUILD_LOG.write_text(f"the book is built from the chapters' runs, and these failed under nbval: {failed}\n")
        return 1
    status = timed("the book's build", build_book, env)
    written = BUILD_STATUS.with_suffix(".tmp")
    written.write_text(str(status))
    written.replace(BUILD_STATUS)  # whole or absent, for the session that waits on it
    return status or timed("the browser's visits to every page", visit_site, env)


def start_warm_kernels(env: dict[str, str]) -> subprocess.Popen:
    """The parent that the chapters' kernels fork from (tests/warm_kernels.py), for the chapters of the run whose
    id ``RUN_ID`` holds; it ends with this process."""
    name = warm_kernels.socket_name(RUN_ID.read_text())
    with WARM_LOG.open("w") as log:
        process = subprocess.Popen([sys.executable, warm_kernels.__file__, "serve", name.lstrip("\0"), str(os.getpid())],
                                   cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    RUNNING.add(process.pid)
    return process


def timed(step: str, run, env: dict[str, str]) -> int:
    """``run(env)``'s exit status; its seconds are added to ``STEP_SECONDS`` under ``step``."""
    started = time.monotonic()
    status = run(env)
    seconds = json.loads(STEP_SECONDS.read_text()) if STEP_SECONDS.exists() else {}
    STEP_SECONDS.write_text(json.dumps({**seconds, step: time.monotonic() - started}))
    return status


def step_seconds() -> dict[str, float]:
    """The seconds of each step the builder took after the chapters, so far."""
    return json.loads(STEP_SECONDS.read_text()) if STEP_SECONDS.exists() else {}


def ended(status: int) -> int:
    """``status``, written where the session's processes see that the builder has ended."""
    BUILDER_EXIT.write_text(str(status))
    return status


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--book" not in arguments:
        sys.exit(main(arguments, book=False))
    session = next(int(argument.split("=")[1]) for argument in arguments if argument.startswith("--session="))
    run = RUN_ID.read_text()
    watch_session(session, run)
    status = 1
    try:
        status = main([stem for stem in arguments if not stem.startswith("--")], book=True)
    finally:
        if began(run):  # not into a later session's folders
            ended(status)
    sys.exit(status)
