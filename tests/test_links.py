"""Every internal link and asset of the built book resolves, nothing fetched: each ``href``/``src`` of every page (and
each ``url(...)`` of its style sheets) names a file of the build, and each ``#anchor`` an id on the page it points to.

The site is published under a sub-path (``/optlab/``), so a path that starts with ``/`` (``/_static/...``) is broken
there: only the 404 page, which is served at any depth, may use absolute paths, and only with the site's prefix.
"""
import re
import urllib.parse
from functools import lru_cache
from pathlib import Path

from bs4 import BeautifulSoup

from tools.site_server import site_prefix

LINKING = {"a": "href", "link": "href", "script": "src", "img": "src", "source": "src", "iframe": "src"}
CSS_URL = re.compile(r"url\(\s*['\"]?([^'\")]+)['\"]?\s*\)")
NOT_FOUND = "404.html"


def is_external(url: str) -> bool:
    return bool(urllib.parse.urlsplit(url).scheme) or url.startswith("//")


@lru_cache(maxsize=None)
def parsed(page: Path) -> BeautifulSoup:
    """``page`` parsed once, whether its links are checked or a link points into it."""
    return BeautifulSoup(page.read_text(), "html.parser")


@lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset[str]:
    soup = parsed(page)
    return frozenset([tag["id"] for tag in soup.find_all(id=True)] + [tag["name"] for tag in soup.find_all("a", attrs={"name": True})])


def resolve(root: Path, source: Path, url: str, prefix: str) -> "tuple[Path | None, str, str]":
    """The file ``url`` names from ``source``, its fragment, and a problem (empty when none)."""
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)
    if path.startswith("/"):
        if source.name != NOT_FOUND or source.parent != root:
            return None, "", "an absolute path, which breaks under the site's sub-path"
        if not path.startswith(prefix):
            return None, "", f"an absolute path outside the site's prefix {prefix}"
        target = root / path[len(prefix):]
    else:
        target = source.parent / path if path else source
    target = Path(*target.parts)  # normalise
    target = target.resolve()
    if not target.is_relative_to(root.resolve()):
        return None, "", "points outside the site"
    if target.is_dir():
        target = target / "index.html"
    return target, parts.fragment, "" if target.is_file() else "names no file of the build"


def broken_links(root: Path, prefix: str) -> list[str]:
    """Every internal link or asset of the pages and style sheets under ``root`` that does not resolve."""
    problems = []
    for page in sorted(root.rglob("*.html")):
        if page.relative_to(root).parts[0] in ("_static", "_sources"):
            continue
        for tag in parsed(page.resolve()).find_all(LINKING):
            url = tag.get(LINKING[tag.name])
            if not url or is_external(url) or url.startswith("#") and len(url) == 1:
                continue
            target, fragment, problem = resolve(root, page, url, prefix)
            if not problem and fragment and target.suffix == ".html" and fragment not in anchors(target):
                problem = f"no id {fragment!r} on {target.relative_to(root.resolve())}"
            if problem:
                problems.append(f"{page.relative_to(root)}: {url}: {problem}")
    for sheet in sorted((root / "_static").rglob("*.css")):
        for url in CSS_URL.findall(sheet.read_text(errors="replace")):
            if not is_external(url) and not url.startswith("data:"):
                target, _, problem = resolve(root, sheet, url, prefix)
                if problem:
                    problems.append(f"{sheet.relative_to(root)}: {url}: {problem}")
    return problems


def test_every_internal_link_and_asset_resolves(book):
    problems = broken_links(book.html, site_prefix())
    assert not problems, f"{len(problems)} broken links:\n" + "\n".join(problems[:40])


def test_the_link_check_finds_an_absolute_asset_path_a_missing_page_and_a_missing_anchor(tmp_path):
    """The check itself, on a small site: each kind of break is reported, and nothing else. A file just outside the
    site exists, so a link that leaves the site is reported for leaving it, not for a missing file; the broken
    ``../`` link and the broken style-sheet ``url()`` are found only if both are followed."""
    site = tmp_path / "html"
    (site / "_static").mkdir(parents=True)
    (site / "_static" / "style.css").write_text("a { background: url('../img.png') }\n"
                                                'b { src: url("fonts/gone.woff") }')
    (site / "img.png").write_bytes(b"")
    (tmp_path / "outside.html").write_text("<p>not part of the site</p>")
    (site / "book").mkdir()
    (site / "book" / "a.html").write_text('<h1 id="top">A</h1><link href="../_static/style.css">'
                                          '<a href="b.html#here">b</a><a href="https://example.org/">out</a>'
                                          '<a href="../../outside.html">leaves</a><a href="../missing.html">up</a>')
    (site / "book" / "b.html").write_text('<p id="here"></p><script src="/_static/x.js"></script>'
                                          '<a href="c.html">c</a><a href="a.html#nowhere">a</a>')
    (site / NOT_FOUND).write_text('<a href="/site/book/a.html#top">contents</a><a href="/elsewhere/">x</a>')
    problems = broken_links(site, "/site/")
    assert problems == [
        "404.html: /elsewhere/: an absolute path outside the site's prefix /site/",
        "book/a.html: ../../outside.html: points outside the site",
        "book/a.html: ../missing.html: names no file of the build",
        "book/b.html: /_static/x.js: an absolute path, which breaks under the site's sub-path",
        "book/b.html: c.html: names no file of the build",
        "book/b.html: a.html#nowhere: no id 'nowhere' on book/a.html",
        "_static/style.css: fonts/gone.woff: names no file of the build",
    ], problems


def test_only_a_scheme_or_a_network_path_is_external():
    for url in ("https://example.org/", "mailto:someone@example.org", "//cdn.example.org/x.js", "data:image/png;a"):
        assert is_external(url), url
    for url in ("../a.html", "./a.html", "a.html", "/optlab/a.html", "#top", "../_static/style.css"):
        assert not is_external(url), url
