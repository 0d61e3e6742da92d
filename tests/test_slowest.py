"""The end of a run names its ten slowest chapters and tests (tests/slowest.py)."""
import subprocess
import sys
import time
from types import SimpleNamespace

import chapter_runs
from chapter_runs import ChapterRun
from slowest import cpu_seconds, lines, slowest_chapters, slowest_tests


BURN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"  # 0.3 s of CPU


def report(nodeid: str, when: str, duration: float) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration)


def test_a_tests_seconds_are_its_setup_call_and_teardown_together_and_chapters_are_left_to_their_own_list():
    reports = [report("a.py::test_fixture_heavy", "setup", 5.0), report("a.py::test_fixture_heavy", "call", 0.5),
               report("a.py::test_fixture_heavy", "teardown", 1.0), report("b.py::test_long_call", "call", 6.0),
               report("t.py::test_notebook_runs_under_nbval[01_x]", "call", 60.0), SimpleNamespace(message="warning")]
    reports += [report(f"c.py::test_{index}", "call", index / 10) for index in range(12)]
    ranked = slowest_tests(reports, leave_out="test_notebook_runs_under_nbval")
    assert ranked[:2] == [("a.py::test_fixture_heavy", 6.5), ("b.py::test_long_call", 6.0)]
    assert [name for name, _ in ranked[2:]] == [f"c.py::test_{index}" for index in (11, 10, 9, 8, 7, 6, 5, 4)]


def test_the_slowest_chapters_come_first_with_their_seconds():
    runs = [ChapterRun(stem, 0, seconds, 3, "") for stem, seconds in [("01_a", 40.0), ("02_b", 71.26), ("03_c", 5.0)]]
    assert slowest_chapters(runs, count=2) == [("02_b", 71.26), ("01_a", 40.0)]
    assert lines(slowest_chapters(runs, count=2)) == ["    71.3 s  02_b", "    40.0 s  01_a"]


def test_a_tests_cpu_seconds_count_its_own_work_and_its_waited_children_and_stand_beside_its_wall_seconds():
    started = cpu_seconds()
    subprocess.run([sys.executable, "-c", BURN], check=True)
    assert cpu_seconds() - started >= 0.3
    pairs = [("a.py::test_x", 12.0), ("a.py::test_y", 3.0)]
    assert lines(pairs, {"a.py::test_x": 1.25}) == ["    12.0 s      1.2 s CPU  a.py::test_x", "     3.0 s  a.py::test_y"]


def test_the_builder_s_cpu_seconds_stay_out_of_the_tests_even_when_a_test_reaps_it(monkeypatch):
    """The builder a worker started is reaped by a thread of its own, and its CPU seconds (a child's, counted in
    ``RUSAGE_CHILDREN`` once reaped) are not any test's: starting other processes meanwhile, as tests do, reaps
    nothing, and the worker knows it ended."""
    monkeypatch.setattr(chapter_runs, "BUILDER", [])
    monkeypatch.setattr(chapter_runs, "BUILDER_CPU_S", [0.0])
    before_all, before_tests = cpu_seconds(), chapter_runs.cpu_seconds_without_builder()
    builder = subprocess.Popen([sys.executable, "-c", BURN])
    chapter_runs.reap_apart(builder)
    assert chapter_runs._alive(builder.pid)
    deadline = time.monotonic() + 30
    while builder.returncode is None and time.monotonic() < deadline:
        subprocess.run(["true"], check=True)  # a later Popen reaps every forgotten one it finds
        time.sleep(0.05)
    assert builder.returncode == 0 and not chapter_runs._alive(builder.pid)
    assert chapter_runs.BUILDER_CPU_S[0] >= 0.3
    assert cpu_seconds() - before_all >= 0.3  # reaped: in the process's children's seconds
    assert chapter_runs.cpu_seconds_without_builder() - before_tests < 0.3, "the builder's counted as the test's"
