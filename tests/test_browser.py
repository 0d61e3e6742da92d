"""A real headless Chromium opens every page of the built book at 1400 px, as a reader would, served the way GitHub
Pages publishes it: under the repository's sub-path (``/optlab/``), by the server of ``make serve``
(``tools/site_server.py``), on 127.0.0.1.

Each page must load without a console error or a failed request (style sheets, scripts, images, fonts), show every
image it links (``naturalWidth > 0``), link only pages and anchors that exist, and keep its article body from scrolling
sideways anywhere but in code (``pre`` blocks); a screenshot of each page goes to ``_build/screenshots/``. Every
chapter offers the records behind it for download, and each one loads back with ``optlab.load_samples``; the summary
offers them all as one archive. Each page is opened once for all these checks (a page load costs seconds on two cores).
A missing page gets the book's 404 page, styled, with a way back to the contents. Runs wherever Chromium and playwright
are installed (``.ci/run`` installs Debian's Chromium); skipped elsewhere, except under CI (``CI`` set), where either
one missing is a failure.
"""
import io
import os
import re
import shutil
import threading
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

import optlab
from tools.site_server import make_server, site_prefix

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 900}
# Every image of the article, loaded (lazy ones too): the sources of those that did not load.
BROKEN_IMAGES = """async () => {
    const images = [...document.querySelectorAll("article img")];
    images.forEach(image => { image.loading = "eager"; });
    await Promise.all(images.map(image => image.decode().catch(() => null)));
    return images.filter(image => image.naturalWidth === 0).map(image => image.getAttribute("src"));
}"""
# Whatever scrolls sideways in the article (or the article or the page itself), code blocks aside.
SIDEWAYS = """() => {
    const wide = element => element.scrollWidth > element.clientWidth + 1;
    const scrolls = element => ["auto", "scroll"].includes(getComputedStyle(element).overflowX);
    const article = document.querySelector("article");
    const found = [...article.querySelectorAll("*")]
        .filter(element => scrolls(element) && wide(element) && !element.closest("pre, div.highlight"))
        .map(element => `${element.tagName.toLowerCase()}.${[...element.classList].join(".")} `
                        + `(${element.scrollWidth} > ${element.clientWidth} px)`);
    if (wide(article)) found.push(`the article (${article.scrollWidth} > ${article.clientWidth} px)`);
    if (document.documentElement.scrollWidth > window.innerWidth) found.push("the page");
    return found;
}"""


def missing(message: str):
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")  # session, like the book: a missing browser fails before the build is awaited
def browser():
    if CHROMIUM is None:
        missing("no Chromium found (apt-get install -y chromium); .ci/run installs it")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed (it is in requirements.txt)")
    with sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def site(book):
    """The built book over HTTP on a free local port, under the site's sub-path: ``http://127.0.0.1:PORT/optlab/``."""
    server = make_server(book.html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}{site_prefix()}"
    server.shutdown()


def origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/"


def open_page(browser, site: str, path: str):
    """Load ``path`` (relative to ``site``) at 1400 px, refusing every request that is not for this server; return
    the page and what went wrong while it loaded (a request outside the sub-path gets a 404, and is reported)."""
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(origin(site))
                  else route.abort())
    page = context.new_page()
    problems = []
    page.on("console", lambda message: problems.append(f"console {message.type}: {message.text} "
                                                       f"({message.location.get('url')})")
            if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    page.on("requestfailed", lambda request: problems.append(f"request failed: {request.url}"))
    page.on("response", lambda response: problems.append(f"HTTP {response.status}: {response.url}")
            if response.status >= 400 and not response.request.is_navigation_request() else None)
    page.goto(f"{site}{path}", wait_until="load")
    return page, problems


# Every link of the article and the navigation that stays on this site, resolved by the browser.
LINKS = """() => [...document.querySelectorAll("a[href]")].map(a => a.href)"""


class Targets:
    """The pages and files of the site that links point to, each fetched once: whether it exists, and its ids."""

    def __init__(self, request) -> None:
        self.request, self.found = request, {}

    def problem(self, url: str) -> str:
        address, _, fragment = url.partition("#")
        if address not in self.found:
            response = self.request.get(address)
            ids = set(re.findall(r'\sid="([^"]+)"', response.text())) if address.endswith(".html") else set()
            self.found[address] = (response.status, ids)
        status, ids = self.found[address]
        if status != 200:
            return f"link to a missing page or file (HTTP {status}): {url}"
        if fragment and address.endswith(".html") and urllib.parse.unquote(fragment) not in ids:
            return f"link to a missing anchor: {url}"
        return ""


def test_index_leads_to_the_navigation(browser, site, toc_pages):
    page, problems = open_page(browser, site, "")
    page.wait_for_url(f"**/{toc_pages[0]}.html")
    navigation = page.locator("nav.bd-docs-nav")
    assert navigation.is_visible()
    links = navigation.locator("a").evaluate_all("links => links.map(a => a.href)")
    not_linked = [name for name in toc_pages[1:] if not any(link.endswith(f"/{name}.html") for link in links)]
    assert not not_linked, f"the navigation does not link {not_linked}"
    page.wait_for_load_state("networkidle")
    assert not problems, problems


def download_links(page) -> list[dict]:
    return page.locator("div.optlab-downloads a[download]").evaluate_all(
        "links => links.map(a => ({href: a.href, name: a.textContent}))")


@dataclass
class Visit:
    """One page of the book as a reader's browser showed it: what went wrong while it loaded and was read and, for a
    chapter, the files it offers, downloaded (``None`` for a page that is not a chapter)."""

    problems: list[str]
    downloads: list[Path] | None = None


def download_offered(page, folder: Path) -> tuple[list[Path], list[str]]:
    """The files a chapter page offers, saved in ``folder``: the first by a click, as a reader would, the others
    fetched; and what went wrong."""
    saved, problems = [], []
    for number, link in enumerate(download_links(page)):
        path = folder / link["name"].strip()
        if number == 0:
            with page.expect_download() as started:
                page.locator("div.optlab-downloads a[download]").first.click()
            started.value.save_as(path)
        else:
            response = page.context.request.get(link["href"])
            if response.status != 200:
                problems.append(f"HTTP {response.status} for {link['href']}")
                continue
            path.write_bytes(response.body())
        saved.append(path)
    return saved, problems


@pytest.fixture(scope="module")
def visits(browser, site, book, toc_pages, tmp_path_factory) -> dict[str, Visit]:
    """Every page of the table of contents opened once at 1400 px: its load problems, images that did not load, what
    scrolls sideways, links to missing pages or anchors, a screenshot in ``_build/screenshots/``, and a chapter's
    downloads."""
    shots = book.html.parent / "screenshots"
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir()
    downloads = tmp_path_factory.mktemp("downloads")
    targets, visited = None, {}
    for name in toc_pages:
        page, found = open_page(browser, site, f"{name}.html")
        targets = targets or Targets(browser.new_context().request)
        found += [f"image did not load: {src}" for src in page.evaluate(BROKEN_IMAGES)]
        found += [f"scrolls sideways: {what}" for what in page.evaluate(SIDEWAYS)]
        page.wait_for_load_state("networkidle")
        links = {link for link in page.evaluate(LINKS) if link.startswith(site)}
        found += [problem for link in sorted(links) if (problem := targets.problem(link))]
        page.screenshot(path=str(shots / f"{name.replace('/', '_')}.jpg"), full_page=True, type="jpeg", quality=85)
        offered = None
        if name.startswith("notebooks/"):
            folder = downloads / name.replace("/", "_")
            folder.mkdir()
            offered, failed = download_offered(page, folder)
            found += failed
        page.context.close()
        visited[name] = Visit(found, offered)
    return visited


def test_every_page_loads_cleanly_and_fits_the_article(visits):
    problems = {name: visit.problems for name, visit in visits.items() if visit.problems}
    assert not problems, problems


def test_every_chapter_offers_its_records_and_each_loads_back(visits):
    """Each chapter shows its download list; each file downloads, a record loads with optlab.load_samples and a table
    with pandas."""
    problems, loaded = {}, 0
    for name, visit in visits.items():
        if visit.downloads is None:
            continue
        found = [] if visit.downloads else ["no download links"]
        for path in visit.downloads:
            if path.suffix == ".json":
                samples = optlab.load_samples(path)
                loaded += 1
                if samples.empty or not {"technique", "machine", "profile"} <= set(samples.columns):
                    found.append(f"{path.name}: no samples loaded back ({list(samples.columns)[:8]})")
            elif path.suffix == ".csv" and pd.read_csv(path).empty:
                found.append(f"{path.name}: an empty table")
        if found:
            problems[name] = found
    assert not problems, problems
    assert loaded, "no chapter offered a record"


def test_the_summary_offers_one_archive_of_every_record(browser, site, book, toc_pages, tmp_path):
    offered = set()
    for name in (page for page in toc_pages if page.startswith("notebooks/")):
        html = (book.html / f"{name}.html").read_text()
        offered |= {href.split("/records/", 1)[1] for href in re.findall(r'href="([^"]*/records/[^"]+)" download', html)}
    page, problems = open_page(browser, site, "book/summary.html")
    links = download_links(page)
    assert [link["name"] for link in links] == ["optlab-records.zip"], links
    response = page.context.request.get(links[0]["href"])
    assert response.status == 200 and not problems, problems
    with zipfile.ZipFile(io.BytesIO(response.body())) as archive:
        names = {name.split("/", 1)[1] for name in archive.namelist()}
        archive.extractall(tmp_path)
    assert offered and offered <= names, f"offered by a chapter, missing from the archive: {sorted(offered - names)}"
    samples = optlab.load_samples(tmp_path / "optlab-records" / "live")
    assert not samples.empty and set(samples["technique"]) >= {"data_loading", "mixed_precision"}


def test_a_missing_page_gets_the_styled_404_page_that_leads_back_to_the_contents(browser, site, toc_pages):
    missing = f"{site}notebooks/no_such_chapter.html"
    page, problems = open_page(browser, site, "notebooks/no_such_chapter.html")
    page.wait_for_load_state("networkidle")
    own_status = f"console error: Failed to load resource: the server responded with a status of 404 (Not Found) ({missing})"
    assert own_status in problems, "the missing page was not answered with status 404"
    problems.remove(own_status)  # the page's own status, as GitHub Pages sends it; its assets must all load
    assert "Page not found" in page.title() + page.locator("article").inner_text()
    sheets = page.evaluate("() => [...document.styleSheets].filter(s => s.href && s.cssRules.length).length")
    assert sheets >= 3, "the 404 page's style sheets did not load"
    page.locator("article a", has_text="the contents").click()
    page.wait_for_url(f"{site}{toc_pages[0]}.html")
    assert not problems, problems
