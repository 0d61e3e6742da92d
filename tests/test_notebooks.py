"""Every chapter notebook runs under nbval in the smoke profile, and is committed without outputs."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import chapter_runs
import conftest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def code_cells(path: Path) -> list[dict]:
    return [cell for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]


def test_the_notebooks_are_the_chapters_of_the_toc(toc_pages):
    listed = {page for page in toc_pages if page.startswith("notebooks/")}
    on_disk = {str(path.relative_to(ROOT).with_suffix("")) for path in NOTEBOOKS}
    assert on_disk == listed, f"only on disk: {sorted(on_disk - listed)}; only in _toc.yml: {sorted(listed - on_disk)}"


def test_notebooks_are_committed_without_outputs():
    dirty = [f"{path.name} cell {index}" for path in NOTEBOOKS for index, cell in enumerate(code_cells(path))
             if cell["outputs"] or cell["execution_count"] is not None]
    assert not dirty, f"clear the outputs of these cells before committing: {dirty}"


class Item:
    """A collected test as the run order sees it: its node id, name, fixtures and markers."""

    def __init__(self, nodeid: str, fixtures: tuple[str, ...] = (), marked: bool = False) -> None:
        self.nodeid, self.name, self.fixturenames, self.marked = nodeid, nodeid.split("::")[-1], fixtures, marked
        self.originalname = self.name.split("[")[0]

    def get_closest_marker(self, name: str):
        return name if self.marked and name in (conftest.BESIDE_BUILD, conftest.SLOW) else None


def test_the_chapters_run_first_the_slow_files_next_and_the_book_s_files_last():
    chapter = Item(f"tests/test_notebooks.py::{conftest.CHAPTER_TEST}[01]")
    slow, slow_file_fast = Item("tests/test_s.py::test_waits", marked=True), Item("tests/test_s.py::test_quick")
    unit, browser = Item("tests/test_u.py::test_unit"), Item("tests/test_l.py::test_lab", marked=True)
    reads_book, book_file_fast = Item("tests/test_b.py::test_page", ("book",)), Item("tests/test_b.py::test_form")
    order, chapters, needs_book = conftest.run_order([book_file_fast, reads_book, unit, slow_file_fast, slow, browser,
                                                      chapter])
    assert [item.nodeid for item in order] == [item.nodeid for item in (chapter, slow_file_fast, slow, browser, unit,
                                                                         book_file_fast, reads_book)]
    assert (chapters, needs_book) == ([chapter], [reads_book])


class Worker:
    """An xdist worker as its scheduler sees it: the indices of the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.sent, self.shutting_down, self.gateway = [], False, SimpleNamespace(id=name)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def test_each_chapter_goes_to_a_worker_on_its_own_and_each_other_file_whole_in_the_run_order():
    config = SimpleNamespace(option=SimpleNamespace(dist="loadfile", tx=["2*popen"], loadscopereorder=True))
    config.getvalue = lambda name: getattr(config.option, name)
    scheduler = conftest.pytest_xdist_make_scheduler(config, None)
    chapters = [f"tests/test_notebooks.py::{conftest.CHAPTER_TEST}[{stem}]" for stem in ("01", "02", "03")]
    collection = [*chapters, "tests/test_s.py::test_a", "tests/test_s.py::test_b", *(f"tests/test_{n}.py::test" for n in
                                                                                      "uvwxyz")]
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    first, second = ([collection[index] for index in worker.sent] for worker in workers)
    assert first[:1] == chapters[:1] and second[:1] == chapters[1:2], (first, second)  # one chapter each, in order
    assert sorted(first + second) == sorted(collection[:len(first) + len(second)]), "the queue's order was not kept"
    for worker, tests in zip(workers, (first, second)):
        assert ("tests/test_s.py::test_a" in tests) == ("tests/test_s.py::test_b" in tests), "a file was split"
    assert conftest.pytest_xdist_make_scheduler(SimpleNamespace(getvalue=lambda name: "load"), None) is None


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs_under_nbval(notebook, smoke_env, chapter_session):
    """Each notebook in its own process, stopped with its kernel if it overruns; the book's builder may have claimed
    the chapter first (tests/chapter_runs.py), so this test runs the chapter or waits for that run."""
    run = chapter_runs.run_or_wait(notebook.stem, smoke_env)
    assert run.returncode is not None, f"{notebook.name} did not finish within {chapter_runs.TIMEOUT_S} s:\n{run.output}"
    assert run.passed, run.output
    assert run.cells_reported == len(code_cells(notebook)), "nbval did not collect every code cell"


def test_a_session_s_chapter_runs_start_afresh_once_whichever_of_its_workers_asks_first(tmp_path, monkeypatch):
    build = tmp_path / "_build"
    for name, path in {"BUILD": build, "RUNS": build / "chapter-runs", "EXECUTED": build / "chapter-runs" / "executed",
                       "RUN_ID": build / "chapter-runs.id", "RUN_LOCK": build / "chapter-runs.lock",
                       "BUILD_LOG": build / "test-build.log", "BOOK_LIVE": tmp_path / "live"}.items():
        monkeypatch.setattr(chapter_runs, name, path)
    chapter_runs.begin("session-1")
    assert chapter_runs.claim("01")  # the first worker claims a chapter
    chapter_runs.begin("session-1")  # the second worker of the same session starts
    assert chapter_runs.began("session-1") and not chapter_runs.claim("01"), "the second worker wiped the first's claim"
    chapter_runs.begin("session-2")  # the next session
    assert chapter_runs.began("session-2") and not chapter_runs.began("session-1") and chapter_runs.claim("01")


BUILDER_STAND_IN = """
import subprocess, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import chapter_runs
chapter_runs.RUN_ID = Path(sys.argv[2])
chapter = subprocess.Popen(["sleep", "60"], start_new_session=True)  # the chapter or build in flight
chapter_runs.RUNNING.add(chapter.pid)
print(chapter.pid, flush=True)
chapter_runs.watch_session(int(sys.argv[3]), "session-1")
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    """True once ``pid`` has ended (a zombie too: its parent has not read its status yet)."""
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("ending", ["its controller killed", "a later session begun", "going on"])
def test_a_builder_ends_with_its_session_and_the_chapter_it_runs_with_it(tmp_path, ending):
    """A session killed without time to stop its builder (a timeout's SIGTERM), or followed by another, leaves no
    builder running chapters into the next session's folders: it ends within a second or two, its chapter's process
    group with it. While the session goes on, it runs."""
    run_id = tmp_path / "chapter-runs.id"
    run_id.write_text("session-1")
    controller = subprocess.Popen(["sleep", "60"])
    builder = subprocess.Popen([sys.executable, "-c", BUILDER_STAND_IN, str(Path(chapter_runs.__file__).parent),
                                str(run_id), str(controller.pid)], stdout=subprocess.PIPE, text=True)
    try:
        chapter = int(builder.stdout.readline())
        time.sleep(1.5)
        assert builder.poll() is None and not _gone(chapter), "the builder ended while its session went on"
        if ending == "its controller killed":
            controller.kill()
            controller.wait()
        elif ending == "a later session begun":
            run_id.write_text("session-2")
        if ending == "going on":
            return
        assert builder.wait(timeout=5) == 1
        deadline = time.monotonic() + 5
        while not _gone(chapter) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(chapter), "the builder left its chapter running"
    finally:
        for process in (builder, controller):
            process.kill()
            process.wait()


def test_the_builder_counts_as_running_from_its_claim_until_it_ends_or_its_process_is_gone(tmp_path, monkeypatch):
    runs = tmp_path / "chapter-runs"
    runs.mkdir()
    for name, path in {"RUNS": runs, "BUILDER_PID": runs / "builder.pid", "BUILDER_EXIT": runs / "builder-exit"}.items():
        monkeypatch.setattr(chapter_runs, name, path)
    assert not chapter_runs.builder_running()  # never claimed
    assert chapter_runs.claim("book") and chapter_runs.builder_running()  # claimed, its process being started
    ended = subprocess.Popen(["true"])
    time.sleep(0.5)  # ended, not yet waited for: a zombie, which still answers a signal 0
    chapter_runs.BUILDER_PID.write_text(str(ended.pid))
    assert not chapter_runs.builder_running(), "an ended builder started by this process counted as running"
    running = subprocess.Popen(["sleep", "30"])
    try:
        chapter_runs.BUILDER_PID.write_text(str(running.pid))
        assert chapter_runs.builder_running()
        chapter_runs.BUILDER_EXIT.write_text("0")  # it said it ended
        assert not chapter_runs.builder_running()
    finally:
        running.kill()
        running.wait()


def test_the_builder_waits_for_a_chapter_no_worker_has_claimed_yet(tmp_path, monkeypatch):
    """The builder waits for the chapters in their order, and a worker may not have reached the next one yet (still
    on another test, or between two): found when a builder ended on the missing claim and the book's tests failed."""
    monkeypatch.setattr(chapter_runs, "RUNS", tmp_path)
    monkeypatch.setattr(chapter_runs, "POLL_S", 0.05)
    run = chapter_runs.ChapterRun("02_later", 0, 1.5, 4, "passed")

    def worker_reaches_it():
        time.sleep(0.3)
        assert chapter_runs.claim("02_later")
        time.sleep(0.3)
        chapter_runs.result_path("02_later").write_text(json.dumps(run.__dict__))

    worker = threading.Thread(target=worker_reaches_it)
    worker.start()
    try:
        assert chapter_runs.wait_for("02_later") == run
    finally:
        worker.join()
