"""The chapters run as the book's pages: their progress bars as text (a widget would stay in the page as a stale
picture of a bar, while text goes to stderr, which the build leaves out: ``optlab.core.run.progress``), their links to
the site's own pages and records (``optlab.book.downloads``)."""
import os

from optlab.core.run.progress import BOOK_ENV


def setup(app):
    os.environ[BOOK_ENV] = "1"  # set before any chapter's kernel starts: each inherits it
    return {"parallel_read_safe": True, "parallel_write_safe": True}
