"""A child Python started from a chapter's folder with a relative ``PYTHONPATH`` imports the optlab that started it:
the memory chapter's allocator comparison and the distributed launcher's workers both run there."""
import os
import sys
from pathlib import Path

import optlab
from children import WITHOUT_INSTALLED_OPTLAB
from optlab.core.process.children import child_environment
from optlab.studies.distributed.launch import launch

ROOT = Path(optlab.__file__).resolve().parents[1]
PRINT_OPTLAB = f"{WITHOUT_INSTALLED_OPTLAB}; import optlab; print(optlab.__file__)"


def test_the_import_path_starts_with_this_optlab_and_makes_every_entry_absolute(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([".", "elsewhere"]))
    monkeypatch.chdir(ROOT / "notebooks")
    environment = child_environment({"X": "1"})
    assert environment["X"] == "1"
    assert environment["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(ROOT / "notebooks"),
                                                          str(ROOT / "notebooks" / "elsewhere")]


def test_a_launched_worker_imports_this_optlab_from_a_chapters_folder(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ".")
    monkeypatch.chdir(ROOT / "notebooks")
    done = launch([sys.executable, "-c", PRINT_OPTLAB], timeout=120)
    assert Path(done.stdout.strip()).resolve() == Path(optlab.__file__).resolve()
