"""Every page of the built book opened once in a real headless Chromium at 1400 px, as a reader would, served the way
GitHub Pages publishes it (``tools/site_server.py``); ``tests/test_browser.py`` checks what was found.

A page load costs seconds on two cores, so the book's builder (``tests/chapter_runs.py``) runs this as soon as the
book is built, while the test session runs its other tests:
``python tests/site_visits.py HTML_FOLDER RESULT.json``. Two browsers share the pages, so the second core works
whenever the session waits. The result holds, per page, what went wrong while it loaded and was read and, for a
chapter, the files it offers, downloaded, and for the summary, where its per-workload answer lies in a 1280x900 window
and how tall the page is there; or why no browser could open the pages.
"""
import contextlib
import json
import re
import shutil
import sys
import threading
import traceback
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(ROOT))  # tools/, when run as a script

from chapter_runs import book_pages  # noqa: E402
from tools.site_server import make_server, site_prefix  # noqa: E402

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
# Every host name but this machine's fails to resolve: a page's request for anything outside the site fails in the
# browser itself (and open_in reports it), where a route that refused it would hold every request of every page for
# the driver's answer and turn the browser's cache off (the visits' CPU a quarter more).
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
BROWSERS = 2  # the pages are shared between two browsers, one per core
VIEWPORT = {"width": 1400, "height": 900}
SUMMARY = "book/summary"
FIRST_SCREEN = {"width": 1280, "height": 900}  # a laptop's window, where the summary's answer must fit unscrolled
ANSWER = "#summary-answer"  # the summary's per-workload answer (optlab.book.answer)
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
# Every link of the article and the navigation that stays on this site, resolved by the browser.
LINKS = """() => [...document.querySelectorAll("a[href]")].map(a => a.href)"""


@dataclass
class Visit:
    """One page of the book as a reader's browser showed it: what went wrong while it loaded and was read, for a
    chapter, the files it offers, downloaded (``None`` for a page that is not a chapter), and for the summary,
    :func:`first_screen` (``None`` for any other page)."""

    problems: list[str]
    downloads: list[str] | None = None
    first_screen: dict | None = None


def origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/"


def reader_context(browser, viewport: dict = VIEWPORT):
    """A browser context at 1400 px (or ``viewport``); the browser (``ARGS``) reaches no host but this one."""
    return browser.new_context(viewport=viewport, accept_downloads=True)


def open_page(browser, site: str, path: str, viewport: dict = VIEWPORT):
    """Load ``path`` (relative to ``site``) in a context of its own (:func:`reader_context`); return the page and what
    went wrong while it loaded (a request outside the sub-path gets a 404, and is reported)."""
    return open_in(reader_context(browser, viewport), site, path)


def open_in(context, site: str, path: str):
    """Load ``path`` (relative to ``site``) in a new page of ``context``; return the page and what went wrong while
    it loaded, a request for anything outside the site's server among it."""
    page = context.new_page()
    problems = []
    page.on("request", lambda request: None if request.url.startswith((origin(site), "data:", "blob:"))
            else problems.append(f"request outside the site: {request.url}"))
    page.on("console", lambda message: problems.append(f"console {message.type}: {message.text} "
                                                       f"({message.location.get('url')})")
            if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    page.on("requestfailed", lambda request: problems.append(f"request failed: {request.url}"))
    page.on("response", lambda response: problems.append(f"HTTP {response.status}: {response.url}")
            if response.status >= 400 and not response.request.is_navigation_request() else None)
    page.goto(f"{site}{path}", wait_until="load")
    return page, problems


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


def download_links(page) -> list[dict]:
    return page.locator("div.optlab-downloads a[download]").evaluate_all(
        "links => links.map(a => ({href: a.href, name: a.textContent}))")


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


def first_screen(browser, site: str) -> dict:
    """The summary in a 1280x900 window, unscrolled, once everything has loaded: the top and bottom of its
    per-workload answer (``None`` where the page has none) and the page's height, in CSS pixels."""
    page, _ = open_page(browser, site, f"{SUMMARY}.html", FIRST_SCREEN)
    page.wait_for_load_state("networkidle")
    answer = page.locator(ANSWER)
    box = answer.bounding_box() if answer.count() == 1 else None
    height = page.evaluate("() => document.documentElement.scrollHeight")
    page.context.close()
    return {"viewport": FIRST_SCREEN, "answer_top": box and box["y"], "answer_bottom": box and box["y"] + box["height"],
            "page_height": height}


def visit_pages(browser, site: str, pages: list[str], shots: Path, downloads: Path) -> dict[str, Visit]:
    """Every page of ``pages`` opened once at 1400 px: its load problems, images that did not load, what scrolls
    sideways, links to missing pages or anchors, a screenshot of its first screen in ``shots``, and a chapter's
    downloads. The pages share one context, as a reader's tabs share the browser's cache (a context a page cost 20 %
    more CPU: the theme's scripts parsed afresh each time)."""
    context, visited = reader_context(browser), {}
    targets = Targets(context.request)
    for name in pages:
        page, found = open_in(context, site, f"{name}.html")
        found += [f"image did not load: {src}" for src in page.evaluate(BROKEN_IMAGES)]
        found += [f"scrolls sideways: {what}" for what in page.evaluate(SIDEWAYS)]
        page.wait_for_load_state("networkidle")
        links = {link for link in page.evaluate(LINKS) if link.startswith(site)}
        found += [problem for link in sorted(links) if (problem := targets.problem(link))]
        # the first screen, as a reader opens the page: the whole of the longest pages cost 30 s of CPU in all
        page.screenshot(path=str(shots / f"{name.replace('/', '_')}.jpg"), type="jpeg", quality=85)
        offered = None
        if name.startswith("notebooks/"):
            folder = downloads / name.replace("/", "_")
            folder.mkdir()
            saved, failed = download_offered(page, folder)
            offered, found = [str(path) for path in saved], found + failed
        page.close()
        visited[name] = Visit(found, offered, first_screen(browser, site) if name == SUMMARY else None)
    return visited


@contextlib.contextmanager
def serving(html: Path) -> Iterator[str]:
    """``html`` over HTTP on a free local port while the block runs: the site's address, under its sub-path
    (``http://127.0.0.1:PORT/optlab/``)."""
    server = make_server(html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}{site_prefix()}"
    finally:
        server.shutdown()


def why_no_browser() -> str | None:
    """Why no browser can open the book's pages on this machine, or ``None`` when one can."""
    if CHROMIUM is None:
        return "no Chromium found (apt-get install -y chromium); .ci/run installs it"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (it is in requirements.txt)"
    return None


def visit_book(html: Path) -> dict:
    """What a visit of every page of the book built in ``html`` found, or why no browser could open them."""
    if reason := why_no_browser():
        return {"missing": reason}
    from playwright.sync_api import sync_playwright

    pages = book_pages()
    shots, downloads = html.parent / "screenshots", html.parent / "downloads"
    for folder in (shots, downloads):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    def visit_share(site: str, share: list[str]) -> dict[str, Visit]:
        with sync_playwright() as driver:  # one driver per thread: playwright's sync API is not thread-safe
            browser = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            try:
                return visit_pages(browser, site, share, shots, downloads)
            finally:
                browser.close()

    with serving(html) as site, ThreadPoolExecutor(BROWSERS) as pool:
        shares = pool.map(partial(visit_share, site), [pages[first::BROWSERS] for first in range(BROWSERS)])
        visited = {name: visit for share in shares for name, visit in share.items()}
    return {"pages": {name: asdict(visited[name]) for name in pages}}


def main(html: Path, result: Path) -> int:
    """Write what the visit found to ``result`` (whole or absent); a visit that fails says how, in the result."""
    try:
        found = visit_book(html)
    except Exception:  # the test reports it with the traceback
        found = {"error": traceback.format_exc()}
    written = result.with_suffix(".tmp")
    written.write_text(json.dumps(found))
    written.replace(result)
    return 1 if "error" in found else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve(), Path(sys.argv[2])))
