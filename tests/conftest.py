"""The table of contents, and one build of the book per session for test_book.py and test_browser.py.

The build executes every chapter and takes minutes, so it starts in the background as soon as the tests are
collected, runs while the other tests run, and the tests that read it go last.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

# One torch thread per process (set before any test imports torch; subprocesses inherit it): the background build
# and the tests share the cores, and oversubscribed threads spin (training steps ten times slower, measured here).
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "_build"
BUILD_LOG = BUILD / "test-build.log"
BOOK_LIVE = ROOT / "results" / "live"  # the book's chapters write here and its summary page reads it
# The tests never see a user's data folder: an empty one gives every run the stand-in, whatever the machine holds.
NO_DATA = BUILD / "test-data"
NO_DATA.mkdir(parents=True, exist_ok=True)
os.environ["OPTLAB_DATA"] = str(NO_DATA)
os.environ.pop("OPTLAB_LIVE_DIR", None)
SMOKE_ENV = {**os.environ, "OPTLAB_PROFILE": "smoke"}  # the CI size, whatever the machine
BUILDING = pytest.StashKey[subprocess.Popen]()


def start_build() -> subprocess.Popen:
    """``jupyter-book build`` from a clean state: stale doctrees would let Sphinx skip executing the notebooks, and
    an older run's records would show on the summary page."""
    for stale in (BUILD / ".doctrees", BUILD / "html", BUILD / "jupyter_execute", BOOK_LIVE):
        shutil.rmtree(stale, ignore_errors=True)  # start clean: the summary page shows only this build's records
    BUILD.mkdir(exist_ok=True)
    command = [str(Path(sys.executable).parent / "jupyter-book"), "build", ".", "-W", "-n", "--keep-going"]
    with BUILD_LOG.open("w") as log:
        return subprocess.Popen(command, cwd=ROOT, env=SMOKE_ENV, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    needs_book = [item for item in items if "book" in item.fixturenames]
    if needs_book and not config.option.collectonly:
        items[:] = [item for item in items if item not in needs_book] + needs_book
        config.stash[BUILDING] = start_build()


def pytest_sessionfinish(session):
    """Stop a build still running when the session ends early (its notebook kernels with it)."""
    build = session.config.stash.get(BUILDING, None)
    if build is not None and build.poll() is None:
        os.killpg(build.pid, signal.SIGTERM)


@pytest.fixture(scope="session")
def smoke_env() -> dict[str, str]:
    return SMOKE_ENV


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


@dataclass(frozen=True)
class Build:
    html: Path
    log: str


@pytest.fixture(scope="session")
def book(request) -> Build:
    """The finished build: its HTML folder and its log without colour codes."""
    build = request.config.stash.get(BUILDING, None) or start_build()
    returncode = build.wait()
    log = re.sub(r"\x1b\[[0-9;]*m", "", BUILD_LOG.read_text())
    assert returncode == 0, f"the book build failed (log: {BUILD_LOG}):\n{log[-8000:]}"
    return Build(BUILD / "html", log)


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as if it had no CUDA device, so CPU-only behaviour is tested on GPU machines too."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
