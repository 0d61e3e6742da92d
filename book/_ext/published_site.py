"""The published site: its front door, its 404 page under the repository's sub-path, and the records its pages offer
for download.

The front door (``index.html``) sends the reader on to the contents at once, with an empty icon of its own: a page
that names no icon makes the browser ask the server's root for ``/favicon.ico`` (a 404 in its console, outside the
sub-path), and one that names the book's icon has that request cut short by the redirect. Jupyter Book's own redirect
names none.

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


def write_front_door(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        Path(app.outdir, "index.html").write_text(
            f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{app.config.html_title}</title>'
            f'<link rel="icon" href="data:,"><meta http-equiv="Refresh" content="0; url={CONTENTS}"></head></html>\n',
            encoding="utf-8")


def publish_records(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        downloads.publish(Path(app.outdir))


def setup(app):
    app.setup_extension("notfound.extension")
    app.connect("config-inited", set_prefix)
    app.connect("build-finished", write_front_door, priority=400)  # before sphinx-external-toc writes its own
    app.connect("build-finished", publish_records)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
