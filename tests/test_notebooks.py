"""Every chapter notebook runs under nbval in the smoke profile, and is committed without outputs."""
import json
from pathlib import Path

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
    """A collected test as the run order sees it: its name, fixtures and markers."""

    def __init__(self, name: str, fixtures: tuple[str, ...] = (), marked: bool = False) -> None:
        self.name, self.originalname, self.fixturenames, self.marked = name, name.split("[")[0], fixtures, marked

    def get_closest_marker(self, name: str):
        return name if self.marked and name == conftest.BESIDE_BUILD else None


def test_the_slow_tests_marked_so_run_while_the_book_builds_and_only_then():
    unit, slow = Item("test_unit"), Item("test_waits", marked=True)
    chapter, reads_book = Item(f"{conftest.CHAPTER_TEST}[01]"), Item("test_page", ("book",))
    order, chapters, needs_book = conftest.run_order([reads_book, slow, chapter, unit])
    assert [item.name for item in order] == ["test_unit", chapter.name, "test_waits", "test_page"]
    assert (chapters, needs_book) == ([chapter], [reads_book])
    without_book, _, _ = conftest.run_order([slow, chapter, unit])
    assert [item.name for item in without_book] == ["test_waits", "test_unit", chapter.name]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs_under_nbval(notebook, smoke_env):
    """Each notebook in its own process, stopped with its kernel if it overruns; a background worker shares the
    chapters with this test (tests/chapter_runs.py), so this test runs the chapter or waits for that run."""
    run = chapter_runs.run_or_wait(notebook.stem, smoke_env)
    assert run.returncode is not None, f"{notebook.name} did not finish within {chapter_runs.TIMEOUT_S} s:\n{run.output}"
    assert run.passed, run.output
    assert run.cells_reported == len(code_cells(notebook)), "nbval did not collect every code cell"
