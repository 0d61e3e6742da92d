"""The book build shared by test_book.py and test_browser.py.

Under pytest-xdist run with ``--dist loadgroup``: both modules are in the group "book", so one worker builds once.
"""
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "_build"


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): tests that pytest-xdist runs on one worker")


@pytest.fixture(scope="session")
def toc_pages() -> list[str]:
    """Every page of ``_toc.yml`` (root first), as paths without suffix relative to the book root."""
    def walk(node):
        if isinstance(node, dict):
            yield from ([node["file"]] if "file" in node else [])
            for key in ("parts", "chapters", "sections"):
                for child in node.get(key, []):
                    yield from walk(child)
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"], *walk(toc)]


@pytest.fixture(scope="session")
def smoke_env() -> dict[str, str]:
    """The environment notebooks run in under test: the CI size, and one thread per process, because the test
    workers share the cores and oversubscribed threads spin (ten times slower steps, measured)."""
    return {**os.environ, "OPTLAB_PROFILE": "smoke", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Build:
    html: Path
    log: str


@pytest.fixture(scope="session")
def book(smoke_env) -> Build:
    """A fresh build of the book (stale doctrees would let Sphinx skip executing the notebooks)."""
    for stale in (".doctrees", "html", "jupyter_execute"):
        shutil.rmtree(BUILD / stale, ignore_errors=True)
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    done = subprocess.run([str(jupyter_book), "build", ".", "-W", "-n", "--keep-going"], capture_output=True,
                          text=True, cwd=ROOT, env=smoke_env)
    assert done.returncode == 0, f"the book build failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return Build(BUILD / "html", re.sub(r"\x1b\[[0-9;]*m", "", done.stdout))
