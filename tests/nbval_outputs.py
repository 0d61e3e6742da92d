"""A pytest plugin for nbval runs: writes each notebook back with the outputs its cells gave, so that the book can be
built from the notebooks the tests ran instead of executing every chapter a second time.

Load it with ``-p nbval_outputs`` (``tests/`` on the path) and name the folder in ``OPTLAB_EXECUTED_DIR``.
"""
import os
from pathlib import Path

import nbformat
import pytest

EXECUTED_DIR_ENV = "OPTLAB_EXECUTED_DIR"


def executed_notebooks(items: list[pytest.Item]) -> dict[Path, nbformat.NotebookNode]:
    """Each notebook nbval collected, its code cells holding what they printed and showed, numbered 1, 2, ... as a
    kernel numbers them (a cell that did not run stays unnumbered)."""
    notebooks = {}
    for item in items:
        if not hasattr(item, "test_outputs"):  # not an nbval cell
            continue
        notebooks[Path(item.parent.fspath)] = item.parent.nb
        if item.test_outputs is not None:
            item.cell.outputs = item.test_outputs
            item.cell.execution_count = item.cell_num + 1
            for output in item.test_outputs:
                if output.output_type == "execute_result":
                    output.execution_count = item.cell.execution_count
    return notebooks


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.get(EXECUTED_DIR_ENV)
    if not folder:
        return
    for path, notebook in executed_notebooks(session.items).items():
        nbformat.write(notebook, Path(folder) / path.name)
