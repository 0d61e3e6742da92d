"""The built book: every page of the table of contents, with its figures and tables, and no errors in it."""
import re

ERROR_OUTPUT = re.compile(r"Traceback \(most recent call last\)|\bename\b|class=\"[^\"]*\b(traceback|stderr)\b")
REMOTE_ASSET = re.compile(r"<(script|img)\b[^>]*\bsrc=\"(https?:)?//|<link\b[^>]*\bhref=\"(https?:)?//[^\"]*\.css")
READ = re.compile(r"reading sources\.\.\. \[\s*\d+%\] (\S+)")


def chapters(pages: list[str]) -> list[str]:
    """The pages that measure something: the notebooks and the summary."""
    return [page for page in pages if page.startswith("notebooks/") or page == "book/summary"]


def test_every_page_is_built(book, toc_pages):
    missing = [page for page in toc_pages if not (book.html / f"{page}.html").is_file()]
    assert not missing, f"pages of _toc.yml missing from the build: {missing}"


def test_chapters_have_a_figure_and_a_table(book, toc_pages):
    assert chapters(toc_pages), "the table of contents lists no chapters"
    problems = []
    for page in chapters(toc_pages):
        html = (book.html / f"{page}.html").read_text()
        problems += [f"{page}: no {tag}" for tag in ("<img", "<table") if tag not in html]
    assert not problems, "\n".join(problems)


def test_notebook_chapters_offer_binder_colab_and_download(book, toc_pages):
    missing = []
    for page in (name for name in toc_pages if name.startswith("notebooks/")):
        html = (book.html / f"{page}.html").read_text()
        wanted = {"Binder (JupyterLab)": f"?urlpath=lab/tree/{page}.ipynb", "Colab": f"/blob/main/{page}.ipynb",
                  "download": f"_sources/{page}.ipynb"}
        missing += [f"{page}: {button}" for button, link in wanted.items() if link not in html]
    assert not missing, f"launch or download buttons missing: {missing}"


def test_no_page_shows_an_error(book, toc_pages):
    shown = {page: match.group(0) for page in toc_pages
             if (match := ERROR_OUTPUT.search((book.html / f"{page}.html").read_text()))}
    assert not shown, f"error output in the built pages: {shown}"


def test_no_page_needs_a_remote_asset(book):
    remote = {str(path.relative_to(book.html)): match.group(0) for path in book.html.rglob("*.html")
              if (match := REMOTE_ASSET.search(path.read_text()))}
    assert not remote, f"pages that load scripts, images or styles from the network: {remote}"


def test_the_summary_runs_after_every_chapter(book, toc_pages):
    """Sphinx executes a page when it reads it; the summary reads the records the chapters write."""
    read = READ.findall(book.log)
    assert sorted(read) == sorted(toc_pages), "the build did not read (and so execute) every page"
    assert read[-1] == "book/summary"
