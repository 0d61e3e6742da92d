"""The environment of a child Python that must import this very optlab, wherever its working folder is."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the folder that holds this optlab


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child Python, with ``extra`` set and an import path that finds this very
    optlab wherever the child runs: its folder first, then each inherited ``PYTHONPATH`` entry made absolute (a
    relative ``PYTHONPATH=.`` names another folder once the working folder is a chapter's)."""
    inherited = [str(Path(entry).resolve()) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return os.environ | (extra or {}) | {"PYTHONPATH": os.pathsep.join(dict.fromkeys([str(PACKAGE_ROOT), *inherited]))}
