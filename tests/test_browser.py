"""A real headless Chromium opens the built book: navigation, a figure, and no console errors.

Runs wherever a Chromium is installed (``.ci/run`` installs Debian's); skipped elsewhere, except under CI
(``CI`` set), where a missing browser is a failure.
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


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        message = "no Chromium found (apt-get install -y chromium); .ci/run installs it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def site(book):
    """The built book over HTTP on a free local port, as a reader would get it."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(book.html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def open_page(browser, site: str, path: str):
    """Load ``path``, refusing every request that is not for ``site``; return the page and what went wrong."""
    context = browser.new_context()
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
    missing = [name for name in toc_pages[1:] if not any(link.endswith(f"/{name}.html") for link in links)]
    assert not missing, f"the navigation does not link {missing}"
    page.wait_for_load_state("networkidle")
    assert not problems, problems


def test_a_chapter_shows_its_figure(browser, site, toc_pages):
    chapter = next(name for name in toc_pages if name.startswith("notebooks/"))
    page, problems = open_page(browser, site, f"{chapter}.html")
    figure = page.locator("article img").first
    figure.scroll_into_view_if_needed()
    assert figure.evaluate("img => img.complete && img.naturalWidth > 0"), "the figure did not load"
    page.wait_for_load_state("networkidle")
    assert not problems, problems
