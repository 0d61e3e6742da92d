"""Every test that starts a process or a thread, forks, sends or handles a signal, or sleeps, run twenty times in a
row where ``make test`` runs it: inside a pytest session among the other such tests (their threads and children
around it), while a background process runs the chapters as ``make test`` does. A test that fails once here is
flaky: fix its cause, never retry it.

    python tools/repeat_tests.py                        # find such tests (one audited run), then repeat each
    python tools/repeat_tests.py tests/test_signals.py  # only those of these files or test ids
    python tools/repeat_tests.py --tests _build/repeat/tests.json --batch 20 --count 20

The tests are found by running them once with ``tests/process_audit.py``, which notes what each test did; the
repeats use pytest-repeat (``--count N --repeat-scope function``: each test N times in a row) in batches of test
functions, one pytest session a batch, each batch's result in ``_build/repeat/``. A test whose processes start in a
fixture shared beyond it (a module's job of gloo ranks) would start them once in such a session, so those tests run
instead as one session N times, their shared fixtures set up afresh in each. The last lines name every test with its
runs and failures.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import chapter_runs  # noqa: E402  (tests/ is not a package on the path)
from process_audit import SHARED  # noqa: E402

OUT = ROOT / "_build" / "repeat"
SELECT = "not needs_the_chapters_runs"  # every test but the chapters' and those that read the book (Lab's included)
ENV = {**os.environ, "OPTLAB_PROFILE": "smoke", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def pytest(*arguments: str, env: dict[str, str] = ENV) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *arguments]
    return subprocess.run(command, cwd=ROOT, env=env)


def audit(paths: list[str]) -> dict[str, list[str]]:
    """Each test among ``paths`` that starts a process or thread, forks, signals or sleeps, with what it did."""
    record = OUT / "tests.json"
    pytest("-m", SELECT, "-p", "tests.process_audit", *(paths or ["tests"]),
           env={**ENV, "OPTLAB_PROCESS_AUDIT": str(record)})
    return json.loads(record.read_text())


def split(tests: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """The audited tests (id -> what it did) that a repeat inside one session repeats whole, and those whose
    processes started in a fixture they share, which only whole sessions repeat; each list sorted."""
    shared = sorted(nodeid for nodeid, did in tests.items() if any(SHARED in what for what in did))
    return sorted(set(tests) - set(shared)), shared


def batches(tests: list[str], size: int) -> list[list[str]]:
    """``tests`` (ids, sorted) in batches of at most ``size`` test functions, all the parameters of a function in one
    batch: a batch runs whole functions, so a function split between two batches would run in both."""
    by_function: dict[str, list[str]] = {}
    for nodeid in tests:
        by_function.setdefault(nodeid.split("[")[0], []).append(nodeid)
    functions = list(by_function.values())
    return [[nodeid for ids in functions[start:start + size] for nodeid in ids]
            for start in range(0, len(functions), size)]


def background_chapters() -> subprocess.Popen:
    """The chapters under nbval in a background process (tests/chapter_runs.py), as ``make test`` runs them beside
    the other tests."""
    chapter_runs.start_afresh()
    return subprocess.Popen([sys.executable, chapter_runs.__file__, *chapter_runs.all_chapters()], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)


class ChaptersBeside:
    """The chapters' runs in the background for as long as the block lasts: started again whenever they end (all of
    them take a quarter of an hour; the repeats, longer), so that every repeat runs beside them."""

    LOOK_EVERY_S = 5.0

    def __enter__(self) -> "ChaptersBeside":
        self.worker, self.done = background_chapters(), threading.Event()
        self.keeper = threading.Thread(target=self.keep_running, daemon=True)
        self.keeper.start()
        return self

    def keep_running(self) -> None:
        while not self.done.wait(self.LOOK_EVERY_S):
            if self.worker.poll() is not None:
                self.worker = background_chapters()

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.keeper.join()
        if self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)
            self.worker.wait()


def repeat(batch: list[str], count: int, report: Path) -> tuple[Counter, Counter]:
    """Run each test of ``batch`` ``count`` times in a row in one session: the runs and the failures of each test id.
    A parametrized test is named by its function, so every parameter of it runs (pytest-repeat renames the ids)."""
    functions = sorted({nodeid.split("[")[0] for nodeid in batch})
    session(functions, report, f"--count={count}", "--repeat-scope=function")
    return tally(report, batch, re.compile(rf"-?\d+-{count}\]$"))  # pytest-repeat's "[3-20]" or "[param-3-20]"


def repeat_sessions(tests: list[str], count: int, folder: Path) -> tuple[Counter, Counter]:
    """Run ``tests`` as one pytest session ``count`` times, so that the fixtures they share, which start their
    processes, are set up afresh each time: the runs and the failures of each test id."""
    functions = sorted({nodeid.split("[")[0] for nodeid in tests})
    runs: Counter = Counter()
    failed: Counter = Counter()
    for number in range(count):
        report = folder / f"session-{number:03d}.xml"
        session(functions, report)
        ran, failures = tally(report, tests)
        runs, failed = runs + ran, failed + failures
    return runs, failed


def session(functions: list[str], report: Path, *options: str) -> None:
    """One pytest session of ``functions``, its results in the JUnit XML file ``report``."""
    ended = pytest(*options, f"--junit-xml={report}", *functions)
    if ended.returncode not in (0, 1):  # 1: some tests failed; anything else: the session itself went wrong
        raise SystemExit(f"the repeat session of {functions} ended with status {ended.returncode}")


def tally(report: Path, tests: list[str], suffix: "re.Pattern | None" = None) -> tuple[Counter, Counter]:
    """The runs and the failures of each test id in a JUnit XML ``report`` (``suffix``: the part of a case's name
    pytest-repeat added, cut off to find the test's own id)."""
    by_name = {dotted(nodeid): nodeid for nodeid in tests}
    runs: Counter = Counter()
    failed: Counter = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        name = (suffix.sub("]", name) if suffix else name).replace("[]", "")
        if case.find("skipped") is None:
            runs[by_name.get(name, name)] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed[by_name.get(name, name)] += 1
    return runs, failed


def dotted(nodeid: str) -> str:
    """A test id as JUnit XML names it: ``tests/test_a.py::Case::test_b[x]`` -> ``tests.test_a.Case.test_b[x]``."""
    path, _, rest = nodeid.partition("::")
    return f"{path.removesuffix('.py').replace('/', '.')}.{rest.replace('::', '.')}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="test files or ids to audit (default: every test file)")
    parser.add_argument("--tests", type=Path, help="an audit written before (skips the audited run)")
    parser.add_argument("--count", type=int, default=20, help="runs of each test in a row (default 20)")
    parser.add_argument("--batch", type=int, default=25, help="test functions a pytest session (default 25)")
    arguments = parser.parse_args()
    if arguments.count < 1 or arguments.batch < 1:
        parser.error(f"--count and --batch must be 1 or more, got {arguments.count} and {arguments.batch}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the chapters' worker is stopped with it
    OUT.mkdir(parents=True, exist_ok=True)
    tests = json.loads(arguments.tests.read_text()) if arguments.tests else audit(arguments.paths)
    ids = sorted(tests)
    alone, shared = split(tests)
    runs, failed = Counter(), Counter()
    with ChaptersBeside():
        done = 0
        for number, batch in enumerate(batches(alone, arguments.batch)):
            ran, failures = repeat(batch, arguments.count, OUT / f"batch-{number:03d}.xml")
            runs, failed, done = runs + ran, failed + failures, done + len(batch)
            print(f"repeated {done} of {len(ids)} tests; failures so far: {sum(failed.values())}", flush=True)
        if shared:
            ran, failures = repeat_sessions(shared, arguments.count, OUT)
            runs, failed = runs + ran, failed + failures
            print(f"repeated {len(ids)} of {len(ids)} tests ({len(shared)} as whole sessions: their processes start "
                  f"in fixtures they share); failures so far: {sum(failed.values())}", flush=True)
    for name in sorted(runs | failed):
        did = ", ".join(tests.get(name, ["a parameter of an audited test"]))
        print(f"{runs[name]:3d} runs, {failed[name]:2d} failed  {name}  ({did})")
    return 1 if failed or any(runs[name] < arguments.count for name in ids) else 0

if __name__ == "__main__":
    sys.exit(main())
