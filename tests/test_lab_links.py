"""A chapter's links answer where it is read: in the built book, the site's pages and its copies of the records; in a
notebook opened from the checkout (``make lab`` serves the checkout), the record files where the runs wrote them,
relative to the notebook's folder, and the published book for its pages. Progress bars know their total from the start
and say why a run stopped early."""
from pathlib import Path

import pytest

from optlab.book import chapter, downloads
from optlab.core.results import store
from optlab.core.run import progress

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def in_lab(monkeypatch):
    monkeypatch.delenv(progress.BOOK_ENV, raising=False)
    monkeypatch.chdir(ROOT / "notebooks")  # where Lab starts a chapter's kernel


def test_in_a_notebook_a_record_links_the_file_lab_serves(in_lab):
    href = downloads.Download("live/data_loading.json", "a run").href
    assert not href.startswith("../records/"), href  # the site's copy exists only in the built book
    assert (ROOT / "notebooks" / href).resolve() == (store.LIVE_DIR / "data_loading.json").resolve()


def test_in_a_notebook_the_summary_is_the_published_book_s(in_lab):
    html = chapter.Note(f"Every technique side by side: [the summary]({chapter.SUMMARY_PAGE}).")._repr_html_()
    assert '<a href="https://optlab.github.io/optlab/book/summary.html">the summary</a>' in html


def test_in_the_book_the_links_are_the_site_s(monkeypatch):
    monkeypatch.setenv(progress.BOOK_ENV, "1")
    assert downloads.Download("live/data_loading.json", "a run").href == "../records/live/data_loading.json"
    html = chapter.Note(f"[the summary]({chapter.SUMMARY_PAGE})")._repr_html_()
    assert f'href="{chapter.SUMMARY_PAGE}"' in html


def test_a_bar_that_stops_early_ends_at_its_total_and_says_why(monkeypatch):
    monkeypatch.setenv(progress.BOOK_ENV, "1")  # text, whatever runs the tests
    bar = progress.progress_bar(40, "demo")
    bar.update(12)
    progress.finish(bar, planned=40, done=12, why="resnet18: 6 of 48 rounds, every answer clear")
    assert (bar.n, bar.total) == (40, 40) and "every answer clear" in bar.postfix
    bar.close()
