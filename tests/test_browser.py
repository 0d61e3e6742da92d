"""A real headless Chromium opens every page of the built book at 1400 px, as a reader would, served the way GitHub
Pages publishes it: under the repository's sub-path (``/optlab/``), by the server of ``make serve``
(``tools/site_server.py``), on 127.0.0.1.

Each page must load without a console error or a failed request (style sheets, scripts, images, fonts), show every
image it links (``naturalWidth > 0``), link only pages and anchors that exist, and keep its article body from
scrolling sideways anywhere but in code (``pre`` blocks); a screenshot of each page's first screen goes to
``_build/screenshots/``.
Every chapter offers the records behind it for download, and each one loads back with ``optlab.load_samples``; the
summary offers them all as one archive, and in a 1280x900 window its per-workload answer lies wholly in the first
screen (its page height is printed and kept in ``site-visits.json``). Each page is opened once for all these checks,
by the builder as soon as the book is built (``tests/site_visits.py``: a page load costs seconds on two cores),
while the session runs its other tests. A missing page gets the book's 404 page,
styled, with a way back to the contents. Runs wherever Chromium and playwright are installed (``.ci/run`` installs
Debian's Chromium); skipped elsewhere, except under CI (``CI`` set), where either one missing is a failure.
"""
import io
import json
import os
import re
import zipfile
from pathlib import Path

import pandas as pd
import pytest

import chapter_runs
import optlab
from site_visits import ARGS, CHROMIUM, FIRST_SCREEN, SUMMARY, Visit, download_links, open_page, serving, why_no_browser


def missing(message: str):
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")  # session, like the book: a missing browser fails before the build is awaited
def browser():
    if reason := why_no_browser():
        missing(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def site(book):
    """The built book over HTTP on a free local port, under the site's sub-path: ``http://127.0.0.1:PORT/optlab/``."""
    with serving(book.html) as url:
        yield url


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


@pytest.fixture(scope="module")
def visits(book) -> dict[str, Visit]:
    """Every page of the table of contents as the builder's browser found it (``tests/site_visits.py``)."""
    chapter_runs.wait_for_builder()
    log = chapter_runs.VISITS_LOG.read_text() if chapter_runs.VISITS_LOG.exists() else ""
    assert chapter_runs.VISITS.exists(), f"the builder ended before it opened the pages:\n{log[-4000:]}"
    found = json.loads(chapter_runs.VISITS.read_text())
    if "missing" in found:
        missing(found["missing"])
    assert "error" not in found, found.get("error")
    return {name: Visit(**visit) for name, visit in found["pages"].items()}


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
        for path in map(Path, visit.downloads):
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


def test_the_summary_answers_per_workload_in_its_first_screen(visits):
    screen = visits[SUMMARY].first_screen
    assert screen is not None, f"{SUMMARY} was not opened at {FIRST_SCREEN}"
    print(f"{SUMMARY} at {FIRST_SCREEN['width']} px: {screen['page_height']} px tall; its answer spans "
          f"{screen['answer_top']} to {screen['answer_bottom']} px")
    assert screen["answer_bottom"] is not None, f"{SUMMARY} has no per-workload answer (#summary-answer)"
    assert 0 <= screen["answer_top"] and screen["answer_bottom"] <= FIRST_SCREEN["height"], (
        f"the answer ends at {screen['answer_bottom']:.0f} px, below the first {FIRST_SCREEN['height']} px")


@pytest.mark.slow  # a browser of its own: the full tier, beside the others that open one
def test_a_page_that_asks_for_anything_outside_the_site_gets_none_of_it_and_says_so(browser, tmp_path):
    """A script and an image from another host: here the same server under the name ``localhost``, which this
    machine would answer; the browser reaches neither, and each one is a problem."""
    (tmp_path / "lib.js").write_text("window.outsideScriptRan = true;")
    (tmp_path / "dot.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"></svg>')
    with serving(tmp_path) as site:
        other = site.replace("127.0.0.1", "localhost")
        outside = [f"{other}lib.js", f"{other}dot.svg"]
        (tmp_path / "page.html").write_text(f'<html><head><script src="{outside[0]}"></script></head>'
                                            f'<body><img src="{outside[1]}"></body></html>')
        page, problems = open_page(browser, site, "page.html")
        page.wait_for_load_state("networkidle")
        loaded = page.evaluate("() => [document.images[0].naturalWidth, window.outsideScriptRan === true]")
    assert loaded == [0, False]
    for url in outside:
        assert f"request outside the site: {url}" in problems and f"request failed: {url}" in problems, problems
