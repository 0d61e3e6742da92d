"""Notebooks reach a commit without outputs or run metadata, whatever Lab saved: ``make install`` sets the nbstripout
filter that ``.gitattributes`` names, in any clone (tried here in a new repository, as a fresh clone would be)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
GIT = ["git", "-c", "user.name=optlab", "-c", "user.email=optlab@example.invalid", "-c", "init.defaultBranch=main"]


def git(folder: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=folder, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def clone(tmp_path) -> Path:
    """A new repository with the project's Makefile, .gitattributes and one chapter, and the filter set by make."""
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("needs git and make")
    for name in ("Makefile", ".gitattributes", "tools/notebook_strip.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "notebooks").mkdir()
    shutil.copy(NOTEBOOKS[0], tmp_path / "notebooks" / NOTEBOOKS[0].name)
    (tmp_path / ".venv").symlink_to(Path(os.path.realpath(ROOT / ".venv")))
    git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text(".venv\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # the new repository, not this one
    subprocess.run(["make", "--no-print-directory", "notebook-filter"], cwd=tmp_path, check=True, env=env,
                   capture_output=True)
    git(tmp_path, "add", "Makefile", ".gitattributes", ".gitignore", "tools", "notebooks")
    git(tmp_path, "commit", "-qm", "start")
    return tmp_path


def as_lab_saves_it(path: Path) -> None:
    """The chapter after Run All and a save in JupyterLab: outputs, counts, timing metadata, the kernel's full
    language details and widget state."""
    notebook = json.loads(path.read_text())
    for count, cell in enumerate(c for c in notebook["cells"] if c["cell_type"] == "code"):
        cell["execution_count"] = count + 1
        cell["outputs"] = [{"output_type": "stream", "name": "stderr", "text": ["  0%|  | 0/32\n"]}]
        cell["metadata"]["execution"] = {"iopub.execute_input": "2026-12-06T02:00:00.000Z"}
    notebook["metadata"]["language_info"] = {"name": "python", "version": "3.11.2", "mimetype": "text/x-python",
                                             "codemirror_mode": {"name": "ipython", "version": 3}}
    notebook["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    path.write_text(json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def test_a_notebook_saved_with_outputs_is_staged_as_committed(clone):
    chapter = clone / "notebooks" / NOTEBOOKS[0].name
    committed = git(clone, "show", f"HEAD:notebooks/{chapter.name}")
    assert committed == NOTEBOOKS[0].read_text(), "git's filter stores the chapter otherwise than it is kept"
    as_lab_saves_it(chapter)
    assert "0/32" in chapter.read_text()
    assert git(clone, "diff") == "", "the run's outputs and metadata would reach a commit"
    git(clone, "add", "notebooks")
    assert git(clone, "status", "--porcelain") == ""
    staged = json.loads(git(clone, "show", f":notebooks/{chapter.name}"))
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in staged["cells"])


def test_lab_saves_a_run_chapter_as_committed(tmp_path):
    """``make lab``'s save hook writes what the filter would stage, byte for byte: ``git status`` stays clean."""
    saved = tmp_path / NOTEBOOKS[0].name
    shutil.copy(NOTEBOOKS[0], saved)
    as_lab_saves_it(saved)
    config = Config()
    exec(compile((ROOT / "tools/lab_config.py").read_text(), "lab_config.py", "exec"),  # as Jupyter loads it
         {"get_config": lambda: config, "__file__": str(ROOT / "tools/lab_config.py")})
    model = {"type": "notebook", "content": json.loads(saved.read_text())}
    config["FileContentsManager"].pre_save_hook(model=model, path=saved.name, contents_manager=None)
    assert nbformat.writes(nbformat.from_dict(model["content"])) + "\n" == NOTEBOOKS[0].read_text()


class Config(dict):
    """Jupyter's config object, as far as tools/lab_config.py uses it: ``c.Section.option = value``."""

    def __getattr__(self, section: str) -> "Section":
        return self.setdefault(section, Section())


class Section:
    pass


def filter_module():
    """tools/notebook_strip.py, the code git's filter runs (the test above runs it through git itself)."""
    spec = importlib.util.spec_from_file_location("notebook_strip", ROOT / "tools/notebook_strip.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_every_chapter_is_stored_as_the_filter_writes_it(path):
    """A chapter stored otherwise would read as changed after a save in Lab that changed nothing."""
    stripped = filter_module().stored(path.read_text())
    assert stripped == path.read_text(), f"{path.name}: run `git add --renormalize {path.relative_to(ROOT)}`"


def test_the_filter_as_git_starts_it_cleans_without_building_jsonschema_s_iri_grammar():
    """git starts the filter once for each notebook whose timestamps it cannot trust: every chapter in a fresh clone.
    Started as git starts it, the filter refuses ``rfc3987_syntax`` (its parsers cost a second a start) and
    writes the chapter as committed; imported as a module (Lab's save hook), it leaves the import to its host."""
    started = subprocess.run([sys.executable, "-X", "importtime", "tools/notebook_strip.py"], cwd=ROOT, check=True,
                             input=NOTEBOOKS[0].read_text(), capture_output=True, text=True)
    assert started.stdout == NOTEBOOKS[0].read_text()
    imported = [line.rsplit("|", 1)[-1].strip() for line in started.stderr.splitlines() if "|" in line]
    assert "nbformat" in imported and "rfc3987_syntax.syntax_helpers" not in imported, started.stderr[-2000:]
    hooked = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tools'); import notebook_strip; "
                             "print(sys.modules.get('rfc3987_syntax', 'untouched'))"], cwd=ROOT, check=True,
                            capture_output=True, text=True)
    assert hooked.stdout.strip() != "None", "importing the module refused the import for its host"
