"""The data behind a page, offered for download: a chapter's live record, the stored GPU references it shows, the
tables it measured, and one archive of them all for the summary page.

A page links its files under ``records/`` at the root of the built site, relative to the page, so the links work
wherever the site is served (``https://<owner>.github.io/optlab/`` included). The files themselves stay where the runs
wrote them; :func:`publish`, which the book calls once its pages are written, copies them there and builds the archive.
A chapter opened from the checkout (JupyterLab, whose root is the checkout) links the files where they are, relative to
the notebook's folder, which Lab serves; only the book's build (``$OPTLAB_BOOK``) links the site's copies.
"""
from __future__ import annotations

import html
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ..core.results import store
from ..core.errors import OptlabError
from ..core.run.progress import BOOK_ENV

SITE_FOLDER = "records"  # at the root of the built site
FROM_PAGE = ".."  # from a page (notebooks/NN.html, book/summary.html) to the root of the site
ARCHIVE = "optlab-records.zip"
PAGE_RUNS = "pages"  # under the live folder: runs and tables a page keeps that are not a chapter's comparison
PUBLISHED = (".json", ".csv", ".gz", ".pickle")  # records, tables, compressed profiler traces, memory snapshots
LOADERS = {".json": "`optlab.load_samples(path)`", ".csv": "`pandas.read_csv(path)`"}


def sources() -> dict[str, Path]:
    """The site's record folders and the folders in this checkout that fill them."""
    return {"live": store.LIVE_DIR, "reference": store.REFERENCE_DIR, "distributed": store.DISTRIBUTED_DIR}


def site_path(path: Path) -> str:
    """Where ``path`` (a file under one of :func:`sources`) is published, relative to the site's record folder."""
    path = Path(path).resolve()
    for name, root in sources().items():
        if path.is_relative_to(root.resolve()):
            return f"{name}/{path.relative_to(root.resolve()).as_posix()}"
    folders = ", ".join(store.display_path(root) for root in sources().values())
    raise OptlabError(f"{store.display_path(path)} is not under a folder the site publishes ({folders})")


@dataclass(frozen=True)
class Download:
    """One file a page offers: where the site publishes it and what it is."""

    name: str  # relative to the site's record folder
    what: str

    @property
    def href(self) -> str:
        """The site's copy in the built book; elsewhere the file itself, relative to the notebook's folder."""
        if os.environ.get(BOOK_ENV) == "1":
            return f"{FROM_PAGE}/{SITE_FOLDER}/{self.name}"
        folder, name = self.name.split("/", 1)
        return Path(os.path.relpath(sources()[folder] / name)).as_posix()


@dataclass(frozen=True)
class Downloads:
    """The files behind a page, as a list of links (HTML in a notebook, plain text anywhere else)."""

    files: tuple[Download, ...]
    missing: str = "no record is kept for this page yet"

    def _repr_html_(self) -> str:
        if not self.files:
            return f'<p class="optlab-downloads">Data to download: {html.escape(self.missing)}.</p>'
        items = "".join(f'<li><a href="{html.escape(file.href)}" download>{html.escape(Path(file.name).name)}</a>: '
                        f"{_code(file.what)}</li>" for file in self.files)
        readers = [f"{_code(LOADERS[suffix])} reads a {suffix} file back" for suffix in LOADERS
                   if any(file.name.endswith(suffix) for file in self.files)]
        tail = f" ({'; '.join(readers)})" if readers else ""
        return (f'<div class="optlab-downloads"><p>The data behind this page, to download{tail}:</p>'
                f"<ul>{items}</ul></div>")

    def __repr__(self) -> str:
        if not self.files:
            return f"Data to download: {self.missing}."
        return "\n".join(["The data behind this page, to download:"]
                         + [f"  {file.href}: {file.what.replace('`', '')}" for file in self.files])


def _code(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text, quote=False))


def _slug(name: str) -> str:
    return re.sub(r"[^\w.]+", "-", name).strip("-").lower()


def _live_record(path: Path) -> Download:
    record = store.load_record(path)
    environment = record["environment"]
    machine = environment.get("gpu_name") or f"{environment.get('device_name')} (CPU)"
    return Download(site_path(path), f"the live run on this page ({machine}, {record['profile']['name']} profile): "
                                     "every knob, the environment, every timed step and the summary")


def _stored(paths: Sequence[Path], what: str) -> list[Download]:
    return [Download(site_path(path), what.format(machine=path.parent.name)) for path in sorted(paths)]


def _kept(name: str, item: "Mapping[str, Any] | Path | pd.DataFrame") -> Download:
    """A run or table of the page, saved (atomically) into the live folder's ``pages/``."""
    folder = store.LIVE_DIR / PAGE_RUNS
    if isinstance(item, pd.DataFrame):
        path = store.save_table(item, folder, _slug(name))
        return Download(site_path(path), f"{name}, the table measured live on this page")
    record = store.load_record(item) if isinstance(item, (str, Path)) else dict(item)
    path = store.save_record(record, folder, f"{_slug(name)}.json")
    return Download(site_path(path), f"{name}: a run of this page, recorded live ({record.get('title', record['technique'])})")


def downloads(technique: str | None = None, *, live: Path | None = None, kept: "Mapping[str, Mapping[str, Any] | Path | pd.DataFrame] | None" = None,
              stored_tables: Sequence[str] = (), stored: Sequence[Path] = (),
              written: "Mapping[str, Path] | None" = None) -> Downloads:
    """The files behind a chapter: its ``live`` record (where ``chapter.run`` wrote it), the stored GPU references of
    ``technique``, the runs and tables of ``kept`` (records, record files or DataFrames, saved here under their names),
    the stored reference tables named in ``stored_tables``, any other ``stored`` files the page shows, and the files
    the page ``written`` into the live folder itself (a profiler's trace), by what each is."""
    files: list[Download] = []
    if live is not None:
        files.append(_live_record(Path(live)))
    files += [Download(site_path(Path(path)), what) for what, path in (written or {}).items()]
    if technique is not None:
        files += _stored(list(store.REFERENCE_DIR.glob(f"*/{technique}.json")),
                         f"the stored GPU reference run of {technique} on {{machine}}")
    files += [_kept(name, item) for name, item in (kept or {}).items()]
    for table in stored_tables:
        files += _stored(list(store.REFERENCE_DIR.glob(f"*/{table}.csv")), f"the stored GPU table {table} on {{machine}}")
    files += _stored([Path(path) for path in stored], "a stored run on {machine}")
    return Downloads(tuple(files), "no record on this machine, and no stored GPU reference yet")


def published_files() -> dict[str, Path]:
    """Every file the site publishes, by its name under the record folder."""
    found = {}
    for root in sources().values():
        for path in sorted(root.rglob("*")) if root.is_dir() else []:
            if path.is_file() and path.suffix in PUBLISHED and not path.name.startswith("."):
                found[site_path(path)] = path
    return found


def archive() -> Downloads:
    """The summary page's one download: an archive of every file the chapters offer (made by :func:`publish`)."""
    names = sorted(published_files())
    if not names:
        return Downloads((), "no record was made on this machine, and no stored GPU reference exists yet")
    folders = sorted({name.split("/")[0] for name in names})
    return Downloads((Download(ARCHIVE, f"{len(names)} files, every record and table the chapters offer, in the "
                                        f"folders {', '.join(folders)} (live: this build's runs; reference: the stored "
                                        "GPU runs, one folder per machine); unzip it and give a folder or a .json file "
                                        "to `optlab.load_samples`"),))


def publish(site: str | Path) -> list[str]:
    """Copy every published file into ``site/records/`` and write the archive beside them (atomically); return the
    names published."""
    folder = Path(site) / SITE_FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    files = published_files()
    for name, path in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, folder / name)
    folder.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=folder, prefix=f".{ARCHIVE}.", suffix=".tmp")
    try:
        with open(fd, "wb") as handle, zipfile.ZipFile(handle, "w", zipfile.ZIP_DEFLATED) as bundle:
            for name, path in files.items():
                bundle.write(path, f"optlab-records/{name}")
        Path(temp).replace(folder / ARCHIVE)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return list(files)
