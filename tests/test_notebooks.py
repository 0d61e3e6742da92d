"""Every chapter notebook runs under nbval in the smoke profile, and is committed without outputs."""
import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NBVAL_TIMEOUT_S = 900  # the slowest chapter (torch.compile, cold cache) takes about 2-3 minutes on 2 busy cores


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


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs_under_nbval(notebook, tmp_path, smoke_env):
    """Each notebook in its own process, writing its records to its own folder (the book build, running beside the
    tests, writes results/live), stopped with its kernel if it overruns."""
    report = tmp_path / "nbval.xml"
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
         f"--junit-xml={report}", "-q", str(notebook)],
        cwd=ROOT, env={**smoke_env, "OPTLAB_LIVE_DIR": str(tmp_path / "live")}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        stdout, _ = process.communicate(timeout=NBVAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        pytest.fail(f"{notebook.name} did not finish within {NBVAL_TIMEOUT_S} s under nbval:\n{stdout[-4000:]}")
    assert process.returncode == 0, stdout[-8000:]
    cases = ET.parse(report).getroot().iter("testcase")
    assert sum(1 for _ in cases) == len(code_cells(notebook)), "nbval did not collect every code cell"
