"""The CUDA paths, checked before a GPU reference run: every test marked ``cuda`` (``@pytest.mark.cuda``: it needs a
CUDA device, and tests/conftest.py skips it without one), and the check cells of the chapters that take a CUDA
branch, run with plain Python (no Jupyter: the chapters' code cells in order, in one namespace, in the smoke
profile). On a machine without CUDA it says so in one line and exits 0.

    make gpu-check                               # or, without the venv:
    PYTHONPATH=. python3 tools/gpu_check.py      # --list: print what it would run, and run nothing
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# chapters whose check cells have is_cuda branches
CHAPTERS = ("11_cuda_graphs", "14_data_pipeline", "15_profiling", "22_attention", "23_checkpointing", "24_gpt_precision",
            "29_memory", "30_kv_cache", "31_quantization", "32_speculative_decoding", "33_serving", "37_your_model")
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


def check_cells(chapter: str) -> list[str]:
    """A chapter's code cells in order, IPython's magics (lines that start with % or !) made ``pass`` at their
    indentation: the install cell's magic is the only line of its ``except`` block."""
    notebook = json.loads((ROOT / "notebooks" / f"{chapter}.ipynb").read_text())
    return ["\n".join(_without_magic(line) for line in "".join(cell["source"]).splitlines())
            for cell in notebook["cells"] if cell["cell_type"] == "code"]


def _without_magic(line: str) -> str:
    code = line.lstrip()
    return line[:len(line) - len(code)] + "pass" if code.startswith(("%", "!")) else line


def _without_jupyter() -> None:
    """Where IPython is missing, a stand-in ``IPython.display.display`` that prints: the cells call it."""
    if importlib.util.find_spec("IPython") is None:
        display = types.ModuleType("IPython.display")
        display.display = lambda *objects, **kwargs: [print(o) for o in objects]
        sys.modules["IPython"], sys.modules["IPython.display"] = types.ModuleType("IPython"), display


def chapter_namespace() -> dict:
    """A fresh namespace for a chapter's cells with what a Jupyter kernel gives them: ``display`` without an import."""
    _without_jupyter()
    from IPython.display import display

    return {"__name__": "__main__", "display": display}


def run_chapter(chapter: str) -> None:
    """Every code cell of ``chapter``, in one namespace, as Jupyter would run them; raises what a cell raises."""
    namespace = chapter_namespace()
    with contextlib.chdir(ROOT / "notebooks"):  # where Jupyter runs a notebook
        for index, source in enumerate(check_cells(chapter)):
            exec(compile(source, f"{chapter}.ipynb cell {index}", "exec"), namespace)


def main(argv: list[str]) -> int:
    try:
        import torch
    except ImportError:
        print(f"gpu-check: {sys.executable} has no torch; run it with the Python that has (PYTHON=... make gpu-check)")
        return 2

    sys.path.insert(0, str(ROOT))
    files = test_files()
    options = ["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT)]
    if importlib.util.find_spec("yaml") is None:
        options.append("--noconftest")  # tests/conftest.py reads _toc.yml with PyYAML; the CUDA tests need neither
    if "--list" in argv:
        print("\n".join(f"test {node}" for node in selected(files, options)))
        print("\n".join(f"chapter notebooks/{chapter}.ipynb" for chapter in CHAPTERS))
        return 0
    if not torch.cuda.is_available():
        print(NOTHING)
        return 0
    import pytest

    os.environ["OPTLAB_PROFILE"] = "smoke"  # the chapters' CI size: a check of the CUDA paths, not a measurement
    os.environ["MPLBACKEND"] = "Agg"
    started, plugin = time.monotonic(), OnlyCuda()
    print(f"gpu-check on {torch.cuda.get_device_name()}: the CUDA-only tests of {len(files)} files, then the checks of "
          f"chapters {', '.join(c.split('_')[0] for c in CHAPTERS)}")
    tests_code = pytest.main([*options, *map(str, files)], plugins=[plugin])
    print(f"CUDA-only tests: {len(plugin.kept)} run, exit status {int(tests_code)}")
    failed = [] if tests_code == 0 else ["tests"]
    for chapter in CHAPTERS:
        began = time.monotonic()
        try:
            with contextlib.redirect_stdout(open(os.devnull, "w")):
                run_chapter(chapter)
        except Exception:  # noqa: BLE001  (reported, and the other chapters still run)
            traceback.print_exc()
            failed.append(chapter)
            print(f"chapter {chapter}: FAILED after {time.monotonic() - began:.0f} s")
        else:
            print(f"chapter {chapter}: every check passed in {time.monotonic() - began:.0f} s")
    print(f"gpu-check: {'failed: ' + ', '.join(failed) if failed else 'all passed'} "
          f"in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
