"""The published site: its 404 page under the repository's sub-path, and the records its pages offer for download.

GitHub Pages serves a project's book under ``/<repository>/`` and answers any missing path with ``404.html``; that page
can be served at any depth, so its links and assets must be absolute, with the prefix (sphinx-notfound-page's
``notfound_urls_prefix``). The prefix comes from ``repository.url`` in ``_config.yml``, like the launch buttons.
When the pages are written, :func:`optlab.book.downloads.publish` copies the records they link into ``records/``.
"""
import urllib.parse
from pathlib import Path

from optlab.book import downloads

CONTENTS = "book/intro.html"  # the book's first page, with the table of contents in its side bar


def set_prefix(app, config) -> None:
    url = config.html_theme_options.get("repository_url", "")
    name = urllib.parse.urlparse(url).path.rstrip("/").rsplit("/", 1)[-1]
    prefix = f"/{name}/" if name else "/"
    config.notfound_urls_prefix = prefix
    config.notfound_context = {
        "title": "Page not found",
        "body": ("<h1>Page not found</h1><p>There is no page at this address: it may have moved when the book was "
                 f'rebuilt. Start again from <a href="{prefix}{CONTENTS}">the contents</a>, or pick a chapter in the '
                 "side bar.</p>"),
    }


def publish_records(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        downloads.publish(Path(app.outdir))


def setup(app):
    app.setup_extension("notfound.extension")
    app.connect("config-inited", set_prefix)
    app.connect("build-finished", publish_records)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
