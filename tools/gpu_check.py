"""The CUDA paths, checked before a GPU reference run: every test marked ``cuda`` (``@pytest.mark.cuda``: it needs a
CUDA device, and tests/conftest.py skips it without one), and the code cells of the chapters that take a CUDA branch,
run with plain Python (no Jupyter: the chapters' code cells in order, in one namespace, in the notebooks' folder, in
the smoke profile, Dynamo reset between chapters). It comes in parts that each fit one 240 s command
(``optlab/commands/reference/check_parts.py``); on a machine without CUDA it says so in one line and exits 0.

    make gpu-check                               # every part in one process; or, without the venv:
    PYTHONPATH=. python3 tools/gpu_check.py      # --list: what it would run; --parts: the parts and their seconds
    PYTHONPATH=. python3 tools/gpu_check.py --part 2 --out results/reference/h200 --archive h200-check.tar.gz
    make gpu-rehearsal                           # the same on a CPU, in a clean environment (--rehearse)

``--part N`` runs one part; a part stops at ``--deadline`` seconds (from the process start for the first part) and
writes what finished: after every test file's run and every chapter, ``<out>/gpu-check.csv`` gets its row and
``--archive`` re-packs the folder, so a command ended at its time limit keeps what it checked.

``--rehearse`` runs exactly what the GPU would run (the same processes, order and working folders) with the device
forced to the CPU: a fresh interpreter that sees the installed packages but not an installed optlab (so optlab comes
only from ``PYTHONPATH=.``, as on a GPU machine with a plain checkout), with a clean environment, Jupyter hidden (the
GPU image has none), and each chapter's CUDA-only child processes started up to their first CUDA call, so that a child
that cannot import optlab from the chapter's folder fails here and not on the GPU.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import datetime as dt
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import types
import venv
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # optlab is imported once the path is set (main)
    from optlab.commands.reference.check_parts import CheckPart

PROCESS_START = time.monotonic()
ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
NOTEBOOKS = ROOT / "notebooks"
NOTHING = "gpu-check: no CUDA device here, so nothing to run (the CUDA-only tests and the chapters' CUDA checks need one)"
MARKER = "cuda"  # pytest.mark.cuda: a test that needs a CUDA device (tests/conftest.py skips it without one)


def cuda_only(item) -> bool:
    """Whether a collected test needs CUDA: it, its class, module or parameter carries the ``cuda`` marker (whatever
    other skip conditions it has, and however they are worded)."""
    return item.get_closest_marker(MARKER) is not None


def _marks_cuda(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.Attribute) and ast.unparse(node) == f"pytest.mark.{MARKER}"
               for node in ast.walk(tree))


def test_files(folder: Path = TESTS) -> list[Path]:
    """The test files of ``folder`` that mark a test ``cuda`` (read, not imported: the GPU machine may lack
    Jupyter)."""
    return [path for path in sorted(folder.glob("test_*.py")) if _marks_cuda(ast.parse(path.read_text()))]


class OnlyCuda:
    """A pytest plugin that keeps the CUDA-only tests of the files it is given and deselects the rest."""

    def __init__(self) -> None:
        self.kept: list[str] = []

    def pytest_collection_modifyitems(self, config, items) -> None:
        keep = [item for item in items if cuda_only(item)]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
        self.kept = [item.nodeid for item in keep]


def selected(files: list[Path], options: list[str]) -> list[str]:
    """The node ids of the CUDA-only tests in ``files``, collected without running them."""
    import pytest

    plugin = OnlyCuda()
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        pytest.main([*options, "--collect-only", *map(str, files)], plugins=[plugin])
    return plugin.kept


def check_cells(chapter: str, folder: Path = NOTEBOOKS) -> list[str]:
    """A chapter's code cells in order, IPython's magics (lines that start with % or !) made ``pass`` at their
    indentation: the install cell's magic is the only line of its ``except`` block."""
    notebook = json.loads((folder / f"{chapter}.ipynb").read_text())
    return ["\n".join(_without_magic(line) for line in "".join(cell["source"]).splitlines())
            for cell in notebook["cells"] if cell["cell_type"] == "code"]


def _without_magic(line: str) -> str:
    code = line.lstrip()
    return line[:len(line) - len(code)] + "pass" if code.startswith(("%", "!")) else line


def _without_jupyter() -> None:
    """Where IPython is missing, a stand-in ``IPython.display.display`` that prints: the cells call it. matplotlib
    asks any ``IPython`` module it finds for its shell and version: ``get_ipython()`` says there is no shell, and
    ``version_info`` is one that needs no backend fix."""
    if sys.modules.get("IPython") is None and importlib.util.find_spec("IPython") is None:  # none, nor a stand-in
        display, ipython = types.ModuleType("IPython.display"), types.ModuleType("IPython")
        display.display = lambda *objects, **kwargs: [print(o) for o in objects]
        ipython.get_ipython, ipython.version_info = (lambda: None), (8, 24)
        sys.modules["IPython"], sys.modules["IPython.display"] = ipython, display


def chapter_namespace() -> dict:
    """A fresh namespace for a chapter's cells with what a Jupyter kernel gives them: ``display`` without an import."""
    _without_jupyter()
    from IPython.display import display

    return {"__name__": "__main__", "display": display}


JUPYTER = ("IPython", "ipykernel", "ipywidgets", "jupyter_client", "jupyter_core", "nbclient", "nbformat")


def hide_jupyter() -> None:
    """Make Jupyter's packages unimportable in this process, as on a GPU image that has none."""
    for name in JUPYTER:
        sys.modules.setdefault(name, None)


# A chapter's child processes that start only on a GPU: in the rehearsal each is started up to its first CUDA call,
# from the chapter's folder and namespace, so that one that cannot import optlab there fails on the CPU too.
CHILD_PROBES = {"29_memory": "fixes.allocator_table('cuda', batch_size=1, steps=1)"}
IMPORT_FAILURES = ("No module named", "ModuleNotFoundError", "ImportError")


class ChildCannotImport(RuntimeError):
    """A chapter's child process could not import what it runs (or the probe started none)."""


STARTED: list[str] = []  # the processes started while a probe listens (an audit hook cannot be removed: it is gated)


def _count_processes(event: str, arguments: tuple) -> None:
    if event == "subprocess.Popen" and STARTED and STARTED[0] == "listening":
        STARTED.append(str(arguments[1])[:200])


def probe_children(chapter: str, namespace: dict) -> None:
    """Start ``chapter``'s CUDA-only child processes (:data:`CHILD_PROBES`) on a CPU: they must get past their
    imports to the first CUDA call; a child that cannot import, or a probe that starts no child (the chapter's code
    changed), is a :class:`ChildCannotImport`."""
    if chapter not in CHILD_PROBES:
        return
    if not STARTED:
        sys.addaudithook(_count_processes)
    STARTED[:] = ["listening"]
    try:
        exec(CHILD_PROBES[chapter], namespace)
    except Exception as error:  # noqa: BLE001  (a child that reached CUDA on a CPU fails: that is the probe passing)
        if any(failure in str(error) for failure in IMPORT_FAILURES):
            raise ChildCannotImport(f"{chapter}: a child process started from notebooks/ cannot import: "
                                    f"{error}") from error
    finally:
        started, STARTED[:] = STARTED[1:], ["off"]
    if not started:
        raise ChildCannotImport(f"{chapter}: {CHILD_PROBES[chapter]} started no child process; update CHILD_PROBES")


def fresh_compiler() -> None:
    """What one chapter compiled is not the next one's: Dynamo's caches and recompile counts start empty, as in a
    kernel of its own."""
    import torch

    torch._dynamo.reset()


def run_chapter(chapter: str, folder: Path = NOTEBOOKS, probe: bool = False) -> None:
    """Every code cell of ``chapter`` in ``folder``, in one namespace, as Jupyter would run them, after a Dynamo reset;
    ``probe``: then its CUDA-only child processes up to their first CUDA call. Raises what a cell raises."""
    fresh_compiler()
    namespace = chapter_namespace()
    with contextlib.chdir(folder):  # where Jupyter runs a notebook
        for index, source in enumerate(check_cells(chapter, folder)):
            exec(compile(source, f"{chapter}.ipynb cell {index}", "exec"), namespace)
        if probe:
            probe_children(chapter, namespace)


class DeadlineReached(KeyboardInterrupt):
    """A part's deadline (or a signal that ends the command) came: the check in flight stops, what finished is kept.
    A KeyboardInterrupt, so that pytest ends its session rather than count it as one test's failure."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise :class:`DeadlineReached` in this thread ``seconds`` from now, or at SIGTERM, SIGINT or SIGHUP; yields the
    list of the reasons raised so far (empty until one came), so that a caller that sees only an interruption (pytest
    returns INTERRUPTED for a collection error too) can tell whether it was this one."""
    reached: list[str] = []

    def stop(signum: int, _frame) -> None:
        reached.append("the deadline" if signum == signal.SIGALRM else signal.Signals(signum).name)
        raise DeadlineReached(reached[-1])

    caught = (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = {number: signal.signal(number, stop) for number in caught}
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield reached
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for number, handler in before.items():
            signal.signal(number, handler)


REPORT = "gpu-check.csv"  # <out>/gpu-check.csv: one row per part's test run or chapter
COLUMNS = ("part", "check", "status", "seconds", "device_name", "torch", "mode", "finished")


class Report:
    """The rows of ``<out>/gpu-check.csv`` (an earlier part's rows are kept, this part's replaced), written after
    every check, with ``archive`` re-packed from ``out``."""

    def __init__(self, out: Path | None, archive: Path | None, device_name: str, mode: str) -> None:
        self.out, self.archive, self.device_name, self.mode = out, archive, device_name, mode
        self.rows: list[dict] = []
        if out is not None and (out / REPORT).is_file():
            self.rows = list(csv.DictReader(io.StringIO((out / REPORT).read_text())))

    def add(self, part: str, check: str, status: str, seconds: float) -> None:
        import torch

        self.rows = [row for row in self.rows if (row["part"], row["check"]) != (part, check)]
        self.rows.append({"part": part, "check": check, "status": status, "seconds": f"{seconds:.1f}",
                          "device_name": self.device_name, "torch": torch.__version__, "mode": self.mode,
                          "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
        print(f"{part}: {check}: {status} in {seconds:.0f} s", flush=True)
        self.write()

    def write(self) -> None:
        if self.out is None:
            return
        from optlab.core.results import archive, store

        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        self.out.mkdir(parents=True, exist_ok=True)
        store.atomic_write_text(self.out / REPORT, text.getvalue())
        if self.archive is not None:
            archive.pack(self.out, self.archive)


def _status(error: BaseException) -> str:
    if isinstance(error, DeadlineReached):
        return f"stopped: {error}"
    return f"failed: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]


def pytest_reason(code: int) -> str:
    """What pytest's exit status ``code`` means, in words: INTERRUPTED without our deadline is a collection error (a
    test file that cannot be imported) or a test that raised KeyboardInterrupt itself."""
    import pytest

    if code == pytest.ExitCode.INTERRUPTED:
        return "interrupted, not by the deadline: a collection error or a KeyboardInterrupt in a test"
    try:
        return pytest.ExitCode(code).name.lower().replace("_", " ")
    except ValueError:
        return "an exit status pytest does not name"


def run_part(part: CheckPart, report: Report, files: list[Path], options: list[str], seconds: float, probe: bool,
             folder: Path = NOTEBOOKS) -> bool:
    """Run ``part``'s checks within ``seconds``, a row in ``report`` after each; True if all passed. At the deadline
    the check in flight is recorded as stopped and the rest as not reached."""
    import pytest

    checks = (["CUDA-only tests"] if part.tests else []) + list(part.chapters)
    done: list[str] = []
    passed, began = True, time.monotonic()
    try:
        with deadline(seconds) as reached:
            for check in checks:
                began = time.monotonic()
                try:
                    if check in part.chapters:
                        with contextlib.redirect_stdout(io.StringIO()):
                            run_chapter(check, folder, probe)
                        status = "ok"
                    else:
                        plugin = OnlyCuda()
                        code = pytest.main([*options, *map(str, files)], plugins=[plugin])
                        if code == pytest.ExitCode.INTERRUPTED and reached:  # our deadline or signal, not a test's
                            raise DeadlineReached(reached[-1])
                        status = "ok" if code in (0, pytest.ExitCode.NO_TESTS_COLLECTED) else \
                            f"failed: exit status {int(code)} ({pytest_reason(code)}, {len(plugin.kept)} tests)"
                except DeadlineReached:
                    raise
                except Exception as error:  # noqa: BLE001  (recorded, and the part's other checks still run)
                    traceback.print_exc()
                    status = _status(error)
                passed &= status == "ok"
                report.add(part.name, check, status, time.monotonic() - began)
                done.append(check)
    except DeadlineReached as stopped:
        in_flight = checks[len(done)]
        report.add(part.name, in_flight, _status(stopped), time.monotonic() - began)
        for check in checks[len(done) + 1:]:
            report.add(part.name, check, "not reached", 0.0)
        return False
    return passed


REHEARSAL = "OPTLAB_GPU_CHECK_REHEARSAL"  # set in the rehearsal's process: run the GPU's checks on the CPU
KEPT_VARIABLES = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "OPTLAB_DATA", "OMP_NUM_THREADS")


def clean_python(folder: Path) -> Path:
    """An interpreter (a venv in ``folder``) that imports every package this one has, but not an installed optlab:
    the packages' folders are listed in a .pth file, whose own .pth files (an editable install's finder) are not run."""
    import site

    python = folder / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(symlinks=True, with_pip=False, clear=True).create(folder)
    packages = folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (packages / "packages-of-the-calling-python.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def rehearse(argv: list[str]) -> int:
    """Run ``tools/gpu_check.py argv`` as ``make gpu-check`` would on a GPU machine (from the repository's folder,
    ``PYTHONPATH=.``), in a clean interpreter and environment, with the device forced to the CPU."""
    python = clean_python(ROOT / "_build" / "rehearsal-python")
    env = {name: os.environ[name] for name in KEPT_VARIABLES if name in os.environ}
    env |= {"PYTHONPATH": ".", "CUDA_VISIBLE_DEVICES": "", REHEARSAL: "1"}
    return subprocess.run([str(python), "tools/gpu_check.py", *argv], cwd=ROOT, env=env, check=False).returncode


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print what it would run, and run nothing")
    parser.add_argument("--parts", action="store_true", help="print the parts with their estimated seconds")
    parser.add_argument("--part", help="run one part, by number or name (default: every part, in order)")
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="stop a part after this many seconds and write what finished (default 220, in the "
                             "rehearsal 600; at most 3600)")
    parser.add_argument("--out", type=Path, help="write gpu-check.csv into this folder (a reference run's)")
    parser.add_argument("--archive", type=Path, metavar="PATH.tar.gz",
                        help="pack --out into this file after each check")
    parser.add_argument("--rehearse", action="store_true",
                        help="run it on the CPU as a GPU would, in a clean interpreter and environment")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = arguments(argv)
    if args.deadline is not None and not 1 <= args.deadline <= 3600:
        print(f"gpu-check: error: --deadline must be from 1 to 3600 seconds, got {args.deadline:g}")
        return 2
    if args.archive is not None and args.out is None:
        print("gpu-check: error: --archive packs the --out folder: give --out too")
        return 2
    if args.rehearse:
        return rehearse([a for a in argv if a != "--rehearse"])
    rehearsal = os.environ.get(REHEARSAL) == "1"
    if rehearsal:
        hide_jupyter()
    try:
        import torch
    except ImportError:
        print(f"gpu-check: {sys.executable} has no torch; run it with the Python that has (PYTHON=... make gpu-check)")
        return 2

    sys.path.insert(0, str(ROOT))
    from optlab.commands.reference.check_parts import (
        CHECK_PARTS, DEADLINE_S, REHEARSAL_DEADLINE_S, chapters, check_part, parts_plan)
    from optlab.core.errors import OptlabError

    if args.parts:
        print(parts_plan(args.deadline or DEADLINE_S))
        return 0
    try:
        parts = [check_part(args.part)] if args.part else list(CHECK_PARTS)
    except OptlabError as error:
        print(f"gpu-check: error: {error}")
        return 2
    files = test_files()
    options = ["-q", "-p", "no:cacheprovider", "-p", "no:nbval", "--rootdir", str(ROOT)]  # nbval: a Jupyter plugin
    if importlib.util.find_spec("yaml") is None:
        options.append("--noconftest")  # tests/conftest.py reads _toc.yml with PyYAML; the CUDA tests need neither
    if args.list:
        print("\n".join(f"test {node}" for node in selected(files, options)))
        print("\n".join(f"chapter notebooks/{chapter}.ipynb" for chapter in chapters()))
        return 0
    if not torch.cuda.is_available() and not rehearsal:
        print(NOTHING)
        return 0
    os.environ["OPTLAB_PROFILE"] = "smoke"  # the chapters' CI size: a check of the CUDA paths, not a measurement
    os.environ["MPLBACKEND"] = "Agg"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    report = Report(args.out, args.archive, device, "rehearsal on the CPU" if rehearsal else "GPU")
    print(f"gpu-check on {device}{' (the rehearsal)' if rehearsal else ''}: part(s) "
          f"{', '.join(part.name for part in parts)}", flush=True)
    failed, limit = [], args.deadline or (REHEARSAL_DEADLINE_S if rehearsal else DEADLINE_S)
    for index, part in enumerate(parts):
        began = PROCESS_START if index == 0 else time.monotonic()
        left = limit - (time.monotonic() - began)
        if not run_part(part, report, files, options, left, probe=rehearsal):
            failed.append(part.name)
    print(f"gpu-check: {'failed: ' + ', '.join(failed) if failed else 'all passed'} "
          f"in {time.monotonic() - PROCESS_START:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
