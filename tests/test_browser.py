"""A real headless Chromium opens every page of the built book at 1400 px, as a reader would.

Each page must load without a console error, show every image it links (``naturalWidth > 0``), and keep its article
body from scrolling sideways anywhere but in code (``pre`` blocks); a screenshot of each page goes to
``_build/screenshots/``. Runs wherever Chromium and playwright are installed (``.ci/run`` installs Debian's Chromium);
skipped elsewhere, except under CI (``CI`` set), where either one missing is a failure.
"""
import functools
import http.server
import os
import shutil
import threading

import pytest

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
    """The built book over HTTP on a free local port, as a reader would get it."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(book.html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def open_page(browser, site: str, path: str):
    """Load ``path`` at 1400 px, refusing every request that is not for ``site``; return the page and what went
    wrong while it loaded."""
    context = browser.new_context(viewport=VIEWPORT)
    context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(site) else route.abort())
    page = context.new_page()
    problems = []
    page.on("console", lambda message: problems.append(f"console {message.type}: {message.text}")
            if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    page.on("requestfailed", lambda request: problems.append(f"request failed: {request.url}"))
    page.goto(f"{site}/{path}", wait_until="load")
    return page, problems


def test_index_leads_to_the_navigation(browser, site, toc_pages):
    page, problems = open_page(browser, site, "index.html")
    page.wait_for_url(f"**/{toc_pages[0]}.html")
    navigation = page.locator("nav.bd-docs-nav")
    assert navigation.is_visible()
    links = navigation.locator("a").evaluate_all("links => links.map(a => a.href)")
    not_linked = [name for name in toc_pages[1:] if not any(link.endswith(f"/{name}.html") for link in links)]
    assert not not_linked, f"the navigation does not link {not_linked}"
    page.wait_for_load_state("networkidle")
    assert not problems, problems


def test_every_page_loads_cleanly_and_fits_the_article(browser, site, book, toc_pages):
    shots = book.html.parent / "screenshots"
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir()
    problems = {}
    for name in toc_pages:
        page, found = open_page(browser, site, f"{name}.html")
        found += [f"image did not load: {src}" for src in page.evaluate(BROKEN_IMAGES)]
        found += [f"scrolls sideways: {what}" for what in page.evaluate(SIDEWAYS)]
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(shots / f"{name.replace('/', '_')}.png"), full_page=True)
        page.context.close()
        if found:
            problems[name] = found
    assert not problems, problems
