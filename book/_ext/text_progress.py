"""The chapters' progress bars as text while the book executes them: a widget would be kept in the page as a stale
picture of a bar, while text goes to stderr, which the build leaves out (``optlab.core.run.progress``)."""
import os

from optlab.core.run.progress import PROGRESS_ENV


def setup(app):
    os.environ[PROGRESS_ENV] = "text"  # set before any chapter's kernel starts: each inherits it
    return {"parallel_read_safe": True, "parallel_write_safe": True}
