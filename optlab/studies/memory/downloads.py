"""A breakdown's files for a reader to open: the timeline as gzipped JSON, the GPU allocator's snapshot as a pickle.

The timeline is gzipped (``.json.gz``) so that a folder of records stays a folder of records: the book reads every
``.json`` under its live folder as a run's record, and a timeline is not one. ``gunzip`` or Python's ``gzip`` module
opens it; the JSON is ``Breakdown.save_timeline``'s (device, peak, categories at the peak, the arithmetic, and every
category's bytes after each change, with its phase). The snapshot is the CUDA allocator's history, which
pytorch.org/memory_viz draws in the browser (nothing is uploaded).
"""
from __future__ import annotations

import gzip
import tempfile
from pathlib import Path

from ...core.results import store
from ...core.errors import OptlabError
from .breakdown import Breakdown

TIMELINE_SUFFIX = ".json.gz"
SNAPSHOT_SUFFIX = ".pickle"


def save_timeline(breakdown: Breakdown, path: str | Path) -> Path:
    """Write ``breakdown``'s timeline as gzipped JSON at ``path`` (which must end in ``.json.gz``), atomically."""
    path = Path(path)
    if not path.name.endswith(TIMELINE_SUFFIX):
        raise OptlabError(f"a timeline is written as gzipped JSON: give a path ending in {TIMELINE_SUFFIX}, "
                          f"not {path.name!r}")
    store.writable_dir(path.parent)
    with tempfile.TemporaryDirectory() as folder:
        plain = breakdown.save_timeline(Path(folder) / "timeline.json")
        store.atomic_write_bytes(path, gzip.compress(plain.read_bytes(), mtime=0))
    return path


def save_snapshot(breakdown: Breakdown, path: str | Path) -> Path | None:
    """Write the allocator's snapshot of a GPU breakdown at ``path`` (ending in ``.pickle``); None on a CPU, which
    has no caching allocator to take one from."""
    path = Path(path)
    if path.suffix != SNAPSHOT_SUFFIX:
        raise OptlabError(f"a memory snapshot is a pickle: give a path ending in {SNAPSHOT_SUFFIX}, not {path.name!r}")
    if breakdown.snapshot is None:
        return None
    return breakdown.save_snapshot(store.writable_dir(path.parent) / path.name)
