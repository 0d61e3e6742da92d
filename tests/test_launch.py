"""The launch buttons: a chapter opened outside the repository (Colab, Binder, a downloaded .ipynb) installs optlab in
its first cell, from the repository that ``_config.yml`` names, and only where ``import optlab`` fails.

The test installs from this checkout instead (``OPTLAB_PIP_SOURCE``), offline, into a fresh virtual environment that
sees every package of this one except optlab.
"""
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest
import yaml
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHECK = "import optlab\nprint(optlab.__file__)"


def first_code_cell(path: Path) -> dict:
    return next(cell for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code")


def run_cells(sources: list[str], folder: Path, kernel: str = "python3") -> list[str]:
    """Execute ``sources`` as one notebook in ``folder`` and return each cell's text output."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    NotebookClient(notebook, kernel_name=kernel, timeout=300, resources={"metadata": {"path": str(folder)}}).execute()
    return ["".join(output.get("text", "") for output in cell.outputs) for cell in notebook.cells]


def test_every_chapter_starts_with_the_same_hidden_install_cell():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    cells = {path.stem: first_code_cell(path) for path in NOTEBOOKS}
    sources = {"".join(cell["source"]) for cell in cells.values()}
    assert len(sources) == 1, "the chapters' first cells differ"
    source = sources.pop()
    assert f'"git+{config["url"]}@{config["branch"]}"' in source, "the install cell names another repository"
    assert "except ImportError" in source and "OPTLAB_PIP_SOURCE" in source
    hidden = [name for name, cell in cells.items() if "remove-cell" not in cell["metadata"].get("tags", [])]
    assert not hidden, f"the install cell shows in the book: {hidden}"


def test_inside_the_repository_the_install_cell_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTLAB_PIP_SOURCE", str(tmp_path / "no-such-package"))  # pip would fail on this
    install, check = run_cells(["".join(first_code_cell(NOTEBOOKS[0])["source"]), CHECK], ROOT / "notebooks")
    assert install == "" and Path(check.strip()).is_relative_to(ROOT)


@pytest.fixture
def outside(tmp_path, monkeypatch) -> Path:
    """A kernel named ``outside``: a new virtual environment that sees this one's packages but not optlab."""
    packages = tmp_path / "packages"
    packages.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "optlab" not in entry.name:  # the editable install's finder, .pth and metadata
            (packages / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    where = [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    purelib = subprocess.run(where, capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "this-venv.pth").write_text(f"{packages}\n")
    spec = tmp_path / "jupyter" / "kernels" / "outside"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(venv / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "outside", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.delenv("PYTHONPATH", raising=False)  # one naming this checkout (make repeat sets it) gives it optlab
    checkout = tmp_path / "checkout"  # pip builds in the source folder: not in ours
    shutil.copytree(ROOT / "optlab", checkout / "optlab", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, checkout / name)
    monkeypatch.setenv("OPTLAB_PIP_SOURCE", f"--no-index --no-build-isolation {checkout}")
    return venv


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
def test_a_chapter_copied_out_of_the_repository_installs_optlab_in_its_first_cell(outside, tmp_path):
    folder = tmp_path / "downloads"
    folder.mkdir()
    chapter = shutil.copy(NOTEBOOKS[0], folder)
    install = "".join(first_code_cell(Path(chapter))["source"])
    probe = "import importlib.util\nprint(importlib.util.find_spec('optlab') is None)"
    before, _, after = run_cells([probe, install, CHECK], folder, kernel="outside")
    assert before.strip() == "True", "optlab was importable before the first cell ran"
    assert Path(after.strip()).is_relative_to(outside), f"optlab was not installed into the environment: {after}"
