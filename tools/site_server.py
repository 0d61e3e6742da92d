"""Serve the built book (``_build/html``) the way GitHub Pages publishes it: under the repository's sub-path
(``/optlab/`` for https://github.com/optlab/optlab, read from ``_config.yml``), on 127.0.0.1 only, with the book's
``404.html`` for any path that does not exist.

``make serve`` runs it for a local preview; ``tests/test_browser.py`` uses the same server for the browser test.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import posixpath
import urllib.parse
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "_build" / "html"
HOST = "127.0.0.1"


def site_prefix(config: Path = ROOT / "_config.yml") -> str:
    """The path the site is published under: ``/<repository name>/`` of ``repository.url``."""
    url = yaml.safe_load(config.read_text())["repository"]["url"]
    return f"/{urllib.parse.urlparse(url).path.rstrip('/').rsplit('/', 1)[-1]}/"


class SiteHandler(http.server.SimpleHTTPRequestHandler):
    """Files of ``directory`` under ``prefix``; ``404.html`` (with status 404) for everything else."""

    prefix = "/"

    def __init__(self, *args, prefix: str, **kwargs) -> None:
        self.prefix = prefix
        super().__init__(*args, **kwargs)

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if urllib.parse.urlsplit(self.path).path == self.prefix.rstrip("/"):
            self.send_response(301)
            self.send_header("Location", self.prefix)
            self.end_headers()
            return
        super().do_GET()

    def translate_path(self, path: str) -> str:
        route = urllib.parse.unquote(urllib.parse.urlsplit(path).path)
        normal = posixpath.normpath(route) + ("/" if route.endswith("/") else "")
        if not normal.startswith(self.prefix):
            return str(Path(self.directory) / ".outside-the-site")  # no such file: answered with the 404 page
        target = Path(self.directory, *[part for part in normal[len(self.prefix):].split("/") if part])
        return str(target) + ("/" if route.endswith("/") else "")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        page = Path(self.directory) / "404.html"
        if code != 404 or not page.is_file():
            super().send_error(code, message, explain)
            return
        body = page.read_bytes()
        self.send_response(404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def make_server(directory: Path = SITE, prefix: str | None = None, port: int = 0) -> http.server.ThreadingHTTPServer:
    """A server for ``directory`` under ``prefix`` on 127.0.0.1 (port 0: a free one); start it with serve_forever."""
    handler = functools.partial(SiteHandler, directory=str(directory), prefix=prefix or site_prefix())
    return http.server.ThreadingHTTPServer((HOST, port), handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--directory", type=Path, default=SITE)
    args = parser.parse_args()
    if not (args.directory / "index.html").is_file():
        parser.exit(2, f"optlab: error: no built book in {args.directory}; run `make book` first\n")
    server = make_server(args.directory, port=args.port)
    print(f"the book at http://{HOST}:{server.server_address[1]}{site_prefix()} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
