"""The built book: every page of the table of contents, with its figures and tables, and nothing on it that a reader
should not see (errors, warnings, NaN, an index column, the build machine's paths)."""
import json
import re
import sys
from functools import lru_cache
from pathlib import Path

import torch
from bs4 import BeautifulSoup

ERROR_OUTPUT = re.compile(r"Traceback \(most recent call last\)|\bename\b|class=\"[^\"]*\btraceback\b")
REMOTE_ASSET = re.compile(r"<(script|img)\b[^>]*\bsrc=\"(https?:)?//|<link\b[^>]*\bhref=\"(https?:)?//[^\"]*\.css")
READ = re.compile(r"reading sources\.\.\. \[\s*\d+%\] (\S+)")
# A warning or an error on stderr: Python's warnings and exceptions, torch's "W1130 10:27:29..." log lines, the words.
STDERR_PROBLEM = re.compile(r"\b\w*(Warning|Error|Exception)\b|^[WE]\d{4} \d\d:\d\d:\d\d|\b(warning|error)s?\b"
                            r"|Traceback", re.IGNORECASE | re.MULTILINE)
# Folders that only exist on the machine that built the page. A path template such as /tmp/torchinductor_<user>
# names no machine and is allowed.
MACHINE_ROOTS = r"home|root|tmp|var|usr|opt|work|mnt|srv|private|Users|builds|workspace"
ABSOLUTE_PATH = re.compile(rf"(?<![\w.~/:<>-])/(?:{MACHINE_ROOTS})(?:/[\w.+-]+)+(?![\w.<+-])")
MACHINE_PATHS = [str(Path(__file__).resolve().parent.parent), str(Path.home()), sys.prefix]
SPEEDUP_FIGURE = 'img[class~="speedup-figure"]'
NO_COMPARISON = {"notebooks/15_profiling",  # profiles one step before and after; it times no comparison
                 # past data parallel: parity and counted bytes against the formulas; step times on gloo processes
                 # sharing a CPU say nothing of a GPU link, so they are shown, not compared
                 "notebooks/19_tensor_parallel", "notebooks/20_pipeline_parallel",
                 "notebooks/21_composing_parallelism"}
GPU_ONLY = {"notebooks/11_cuda_graphs",  # its comparison needs CUDA graphs, so a CPU build has none to show
            "notebooks/26_gpt_compile"}  # compiling the GPT takes longer on a CPU than a page may: a CPU compiles its MLP


def chapters(pages: list[str]) -> list[str]:
    """The pages that measure something: the notebooks and the summary."""
    return [page for page in pages if page.startswith("notebooks/") or page == "book/summary"]


def compared(pages: list[str]) -> list[str]:
    """The chapters that show a live comparison on this machine, and so its speed-up figure."""
    skip = NO_COMPARISON | (set() if torch.cuda.is_available() else GPU_ONLY)
    return [page for page in chapters(pages) if page not in skip]


def soup(book, page: str) -> BeautifulSoup:
    """``page`` of the built book, parsed once for all the tests that read it (each page is parsed by five or six:
    15 s of CPU); they only read it."""
    return parsed(book.html / f"{page}.html")


@lru_cache(maxsize=None)
def parsed(path: Path) -> BeautifulSoup:
    return BeautifulSoup(path.read_text(), "html.parser")


def test_every_page_is_built(book, toc_pages):
    missing = [page for page in toc_pages if not (book.html / f"{page}.html").is_file()]
    assert not missing, f"pages of _toc.yml missing from the build: {missing}"


def test_chapters_have_a_figure_and_a_table_in_their_outputs(book, toc_pages):
    """Only images inside cell outputs count: every chapter page also carries the Binder and Colab logos."""
    assert chapters(toc_pages), "the table of contents lists no chapters"
    problems = []
    for page in chapters(toc_pages):
        outputs = soup(book, page).select("div.cell_output")
        problems += [f"{page}: no {tag} in a cell output" for tag in ("img", "table")
                     if not any(output.find(tag) for output in outputs)]
    assert not problems, "\n".join(problems)


def test_every_comparison_shows_the_speedup_figure_and_what_it_was_measured_on(book, toc_pages):
    problems = []
    for page in compared(toc_pages):
        html = soup(book, page)
        if not html.select(f"div.cell_output {SPEEDUP_FIGURE}"):
            problems.append(f"{page}: no speed-up figure")
        if page.startswith("notebooks/") and page != "notebooks/17_distributed" and not any(
                note.find("a", href="../book/summary.html") for note in html.select("p.optlab-note")):
            problems.append(f"{page}: no line naming the device and the stored references, linking the summary")
    assert not problems, "\n".join(problems)


def test_tables_have_no_index_column_and_no_nan(book, toc_pages):
    """Every DataFrame goes through report.html_table; pandas' own rendering (class "dataframe") would bring its
    0..N index back."""
    problems = []
    for page in toc_pages:
        for table in soup(book, page).select("div.cell_output table"):
            cells = [cell.get_text(strip=True) for cell in table.find_all(["td", "th"])]
            if "dataframe" in table.get("class", []):
                problems.append(f"{page}: a table rendered by pandas, with its index: {cells[:6]}")
            if {"NaN", "nan", "None", "<NA>"} & set(cells):
                problems.append(f"{page}: NaN in a table: {cells[:6]}")
    assert not problems, "\n".join(problems)


def test_no_page_shows_a_path_of_the_build_machine(book, toc_pages):
    shown = {}
    for page in toc_pages:
        text = soup(book, page).find("main").get_text(" ")
        found = ABSOLUTE_PATH.findall(text) + [path for path in MACHINE_PATHS if len(path) > 1 and path in text]
        if found:
            shown[page] = sorted(set(found))
    assert not shown, f"absolute paths in the pages' text: {shown}"


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


def test_no_page_wrote_a_warning_or_an_error_to_stderr(book, toc_pages):
    """The pages leave stderr out (progress bars go there), so the executed notebooks are read instead."""
    executed = book.html.parent / "jupyter_execute"
    problems = {}
    for page in chapters(toc_pages):
        notebook = json.loads((executed / f"{page}.ipynb").read_text())
        stderr = "".join("".join(output["text"]) for cell in notebook["cells"] for output in cell.get("outputs", [])
                         if output.get("name") == "stderr")
        lines = [line for line in re.split(r"[\r\n]+", stderr) if STDERR_PROBLEM.search(line)]
        if lines:
            problems[page] = lines[:5]
    assert not problems, f"warnings or errors on stderr: {problems}"


def test_no_page_needs_a_remote_asset(book):
    remote = {str(path.relative_to(book.html)): match.group(0) for path in book.html.rglob("*.html")
              if (match := REMOTE_ASSET.search(path.read_text()))}
    assert not remote, f"pages that load scripts, images or styles from the network: {remote}"


def test_the_summary_runs_after_every_chapter(book, toc_pages):
    """Sphinx executes a page when it reads it; the summary reads the records the chapters write."""
    read = READ.findall(book.log)
    assert sorted(read) == sorted(toc_pages), "the build did not read (and so execute) every page"
    assert read[-1] == "book/summary"


def test_the_book_shows_the_chapters_runs_under_nbval_and_executes_no_chapter_again(book, toc_pages):
    """The test book takes each chapter's outputs from its nbval run (tests/chapter_runs.py): a chapter executed a
    second time would double the time of the tests."""
    cached = set(re.findall(r"(notebooks/\S+)\.ipynb: Using cached notebook", book.log))
    executed = re.findall(r"(notebooks/\S+)\.ipynb: Execut", book.log)
    notebooks = {page for page in toc_pages if page.startswith("notebooks/")}
    assert cached == notebooks and not executed, f"executed again: {executed}; not from the cache: {notebooks - cached}"


WRONG_LEVEL = re.compile(r"\b(100|95)\s?%\s?(confidence\s)?(interval|CI)\b", re.IGNORECASE)


def test_no_page_names_the_interval_by_a_level_it_does_not_have(book, toc_pages):
    """The interval is 99.9 %: a page that calls it a 95 % or a 100 % interval (rounding, or an old text) fails."""
    problems = [page for page in toc_pages if WRONG_LEVEL.search(soup(book, page).get_text(" "))]
    assert not problems, f"pages naming a 95 % or 100 % interval: {problems}"
    shown = [page for page in compared(toc_pages) if "99.5 % sequential interval" in soup(book, page).get_text(" ")]
    assert shown == compared(toc_pages), "every comparison names its 99.5 % sequential interval"
