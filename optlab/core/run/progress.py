"""Progress bars that read where they are shown: a widget in JupyterLab or Notebook (tqdm's notebook bar, drawn by
ipywidgets), one updating line in a terminal. A book build executes the chapters with no one watching: with
``$OPTLAB_BOOK=1`` (the book's build sets it) the bar is the terminal's, on stderr, which the build leaves out."""
from __future__ import annotations

import os
import sys

from tqdm.std import tqdm

BOOK_ENV = "OPTLAB_BOOK"  # "1" while the book's build executes the chapters as its pages


def progress_bar(total: int | None, desc: str, enabled: bool = True, keep: bool = True) -> tqdm:
    """A bar of ``total`` steps, known from the start: a widget when a notebook's front end shows it (which stays,
    finished, with ``keep``), else one line on stderr that goes when the bar closes."""
    if enabled and os.environ.get(BOOK_ENV) != "1":
        from tqdm.auto import tqdm as chosen  # the notebook's widget bar inside a kernel, else this module's own

        if chosen is not tqdm:
            return chosen(total=total, desc=desc, leave=keep)
    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=False)


def finish(bar: tqdm, planned: int, done: int, why: str | None = None) -> None:
    """Move ``bar`` past the ``planned - done`` steps a part of the run did not need, saying ``why`` it stopped."""
    if planned > done:
        bar.update(planned - done)
    if why:
        bar.set_postfix_str(why, refresh=True)
