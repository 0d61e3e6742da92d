"""`make repeat`'s audit and its tally: a test whose processes start in a fixture shared beyond it is told apart (a
repeat inside one session would not start them again), and the JUnit reports are counted per test; the chapters run
beside the repeats for as long as they last."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import repeat_tests  # noqa: E402

import conftest  # noqa: E402

pytest_plugins = ["pytester"]

AUDITED = """
import threading, time
import pytest

def started():
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()

@pytest.fixture(scope="module")
def job():
    started()

@pytest.fixture
def own_job():
    started()

def test_first_with_the_job(job):
    pass

def test_second_with_the_job(job):
    time.sleep(0)

def test_with_its_own_job(own_job):
    pass

def test_quiet():
    pass
"""


def test_the_audit_tells_a_shared_fixture_s_processes_from_a_test_s_own(pytester, monkeypatch):
    record = pytester.path / "audit.json"
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OPTLAB_PROCESS_AUDIT", str(record))
    pytester.makepyfile(test_audited=AUDITED)
    pytester.runpytest_subprocess("-p", "tests.process_audit", "-p", "no:cacheprovider").assert_outcomes(passed=4)
    audit = json.loads(record.read_text())
    assert audit == {"test_audited.py::test_first_with_the_job": [f"starts a thread {repeat_tests.SHARED}"],
                     "test_audited.py::test_second_with_the_job": ["sleeps"],
                     "test_audited.py::test_with_its_own_job": ["starts a thread"]}
    alone, shared = repeat_tests.split(audit)
    assert shared == ["test_audited.py::test_first_with_the_job"]
    assert alone == ["test_audited.py::test_second_with_the_job", "test_audited.py::test_with_its_own_job"]


def test_the_tally_counts_each_test_s_runs_and_failures_through_pytest_repeat_s_names(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text("""<testsuites><testsuite>
        <testcase classname="tests.test_a" name="test_b[1-3]"/>
        <testcase classname="tests.test_a" name="test_b[2-3]"><failure message="x"/></testcase>
        <testcase classname="tests.test_a" name="test_b[3-3]"/>
        <testcase classname="tests.test_a" name="test_c[fast-1-3]"><skipped/></testcase>
        <testcase classname="tests.test_a" name="test_c[fast-2-3]"><error message="y"/></testcase>
        </testsuite></testsuites>""")
    ids = ["tests/test_a.py::test_b", "tests/test_a.py::test_c[fast]"]
    runs, failed = repeat_tests.tally(report, ids, repeat_tests.re.compile(r"-?\d+-3\]$"))
    assert runs == {"tests/test_a.py::test_b": 3, "tests/test_a.py::test_c[fast]": 1}
    assert failed == {"tests/test_a.py::test_b": 1, "tests/test_a.py::test_c[fast]": 1}
    plain = tmp_path / "session.xml"  # one whole session: the names as pytest wrote them
    plain.write_text('<testsuite><testcase classname="tests.test_a" name="test_b"><failure/></testcase></testsuite>')
    assert repeat_tests.tally(plain, ids) == ({"tests/test_a.py::test_b": 1}, {"tests/test_a.py::test_b": 1})


def test_make_repeat_leaves_out_only_the_chapters_and_the_book_s_readers():
    """Not the other slow tests: Lab's chapter run, a probing fork server and the like start processes too."""
    def item(name, fixtures=(), markers=()):
        return SimpleNamespace(originalname=name, fixturenames=list(fixtures),
                               get_closest_marker=lambda marker: marker if marker in markers else None)

    assert repeat_tests.SELECT == f"not {conftest.NEEDS_RUNS}"
    assert conftest.needs_the_runs(item(conftest.CHAPTER_TEST)) and conftest.needs_the_runs(item("t", ["book"]))
    lab = item("test_a_chapter_run_all_in_lab_reads_cleanly", ["lab"], [conftest.SLOW])
    assert conftest.is_slow(lab) and not conftest.needs_the_runs(lab)


def test_the_chapters_beside_the_repeats_start_again_when_they_end_and_stop_with_the_repeats(monkeypatch):
    started = []

    def start() -> subprocess.Popen:  # the first run ends at once; the next lasts longer than the block
        started.append(subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({60 if started else 0})"]))
        return started[-1]

    monkeypatch.setattr(repeat_tests, "background_chapters", start)
    monkeypatch.setattr(repeat_tests.ChaptersBeside, "LOOK_EVERY_S", 0.05)
    with repeat_tests.ChaptersBeside():
        deadline = time.monotonic() + 30
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(started) == 2, "the chapters were not started again when they ended"
    assert started[0].returncode == 0 and started[1].wait(10) == -signal.SIGTERM


def test_a_batch_holds_every_parameter_of_its_functions():
    tests = ["t.py::a[1]", "t.py::a[2]", "t.py::b", "t.py::c[x]", "t.py::c[y]", "t.py::c[z]", "t.py::d"]
    assert repeat_tests.batches(tests, 2) == [["t.py::a[1]", "t.py::a[2]", "t.py::b"],
                                              ["t.py::c[x]", "t.py::c[y]", "t.py::c[z]", "t.py::d"]]
