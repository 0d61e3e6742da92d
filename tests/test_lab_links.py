"""A chapter's links answer where it is read: in the built book, the site's pages and its copies of the records; in a
notebook opened from the checkout (``make lab`` serves the checkout), the record files where the runs wrote them,
relative to the notebook's folder, and the published book for its pages. Progress bars know their total from the start
(the tunes' and their batch-size sweep's too), end there and say why a run stopped early."""
import ast
import inspect
import re
import time
import urllib.parse
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest
import torch
from torch import nn

import optlab
from optlab.book import chapter, downloads
from optlab.core.results import store
from optlab.core.measuring.timing import FASTER
from optlab.core.run import progress
from optlab.core.gpt.transformer import GPT, GPTConfig
from optlab.studies.serving import decoding
from optlab.studies.tune import NothingRecommended, inference, memory, training
from optlab.studies.tune.batch_sweep import doubling_series
from tests.helpers import TINY
from tests.test_tune import FailsToTrain

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


TARGET = re.compile(r"\]\(([^)\s]+)\)|href=\"([^\"]+)\"")  # [text](target) or href="target"
PLACEHOLDER = re.compile(r"^\{chapter\.(\w+)\}$")  # an f-string's {chapter.SUMMARY_PAGE}


def chapter_links(notebook: Path) -> list[str]:
    """Every link target a chapter writes: in its markdown, and in its code's strings (a ``{chapter.NAME}`` read from
    :mod:`optlab.book.chapter`)."""
    found = []
    for cell in nbformat.read(notebook, as_version=4).cells:
        for match in TARGET.finditer(cell.source):
            target = match[1] or match[2]
            named = PLACEHOLDER.match(target)
            found.append(getattr(chapter, named[1]) if named else target)
    return found


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda path: path.stem)
def test_every_link_a_chapter_writes_answers_where_lab_serves_it(in_lab, notebook):
    """In Lab, a link to a file opens it if the checkout holds it (relative to the chapter's folder); a page of the book
    is the published book's, built from a page the checkout holds; any other link to the web must be a well-formed
    https URL (there is no network here to ask)."""
    for target in chapter_links(notebook):
        href = chapter.page_href(target)
        assert "{" not in href, f"{target}: a link this test cannot read; write it out or name a chapter constant"
        url = urllib.parse.urlsplit(href)
        if href.startswith(chapter.SITE):  # a page of the published book: built from a source in the checkout
            page = ROOT / href.removeprefix(chapter.SITE).split("#")[0]
            assert any(page.with_suffix(suffix).exists() for suffix in (".md", ".ipynb")), \
                f"{target}: the book has no page {page.relative_to(ROOT)}"
        elif url.scheme:
            assert url.scheme == "https" and "." in url.netloc, f"{target}: not a well-formed https URL"
        else:
            assert (ROOT / "notebooks" / url.path).exists(), f"{target}: no such file where Lab serves the chapter"


AUTOLINKED = re.compile(r"\bdata:\S+")  # text Lab's output turns into a data: link, which leads nowhere


def printed_sources(notebook: Path) -> dict[str, str]:
    """The source of every function a chapter prints with ``inspect.getsource``, by the name it gives (a name the
    chapter binds in a loop, as chapter 17 does, is left out), imported as the chapter imports it."""
    namespace: dict = {}
    cells = [cell.source for cell in nbformat.read(notebook, as_version=4).cells if cell.cell_type == "code"]
    for source in cells:
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a cell with IPython's % commands: not an import cell
            continue
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(imports, []), str(notebook), "exec"), namespace)
    found = {}
    for name in {name for source in cells for name in re.findall(r"getsource\(([\w.]+)\)", source)}:
        try:
            found[name] = inspect.getsource(eval(name, namespace))
        except NameError:
            continue
    return found


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda path: path.stem)
def test_the_code_a_chapter_prints_holds_no_text_lab_links_to_nowhere(notebook):
    """Lab turns ``data:...`` in printed text into a link (a Sphinx role such as :data:`NAME` in a printed
    docstring), which leads nowhere: a docstring a chapter prints writes such a name as ``NAME``."""
    for name, source in printed_sources(notebook).items():
        assert not AUTOLINKED.findall(source), f"{name} prints {AUTOLINKED.findall(source)}: Lab links it nowhere"


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


@pytest.fixture
def bars(monkeypatch):
    """Every bar the tunes make, as text (whatever runs the tests), with the total it was made with."""
    made = []

    def recorded(total, desc, enabled=True, keep=True):
        made.append((desc, total, progress.progress_bar(total, desc, enabled, keep)))
        return made[-1][2]

    monkeypatch.setenv(progress.BOOK_ENV, "1")
    monkeypatch.setattr(inference, "progress_bar", recorded)
    monkeypatch.setattr(training, "progress_bar", recorded)
    return made


class OutOfMemoryAbove8(nn.Module):
    """Serves up to 8 samples a batch: the batch-size sweep ends early, at 16."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 4)

    def forward(self, x):
        if len(x) > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 PiB")
        return self.body(x)


def test_tune_inference_s_bars_end_at_the_totals_they_started_with(bars, monkeypatch):
    """The step's candidate fails to start (its rounds never run), nothing is kept (the comparison afresh never
    runs) and the sweep stops at batch 16 of 32: each bar still ends at its first total, saying why."""
    prepare = inference._prepare

    def failing(run, config, check=True):
        if config.eval_grad_mode == "inference_mode":
            raise RuntimeError("the candidate does not start")
        return prepare(run, config, check)

    monkeypatch.setattr(inference, "_prepare", failing)
    result = optlab.tune(OutOfMemoryAbove8, inference=True, input_shape=(12,), max_batch=32, request_seconds=0.05,
                         profile=TINY, device="cpu", techniques=[inference.INFERENCE_MODE])
    assert result.steps.set_index("step").loc[inference.INFERENCE_MODE, "decision"] == "failed"
    assert result.sweep_ends == {"starting point": "out of memory at batch 16"}
    assert [(desc, total) for desc, total, _ in bars] == [
        ("tune --inference OutOfMemoryAbove8", 2 * (TINY.warmup_repeats + TINY.max_repeats) * 2),
        ("batch sizes", len(doubling_series(32)))]  # one configuration swept: nothing was kept
    for desc, total, bar in bars:
        assert (bar.total, bar.n) == (total, total), desc
    assert "out of memory at batch 16" in bars[1][2].postfix and "no step was kept" in bars[0][2].postfix


class SlowWithAutogradUpTo8(nn.Module):
    """A convnet 3 ms slower with autograd on that serves up to 8 samples a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if len(x) > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 PiB")
        if torch.is_grad_enabled():
            time.sleep(0.003)
        return self.body(x).mean((2, 3))


def test_a_step_that_fails_to_start_moves_the_bar_past_its_rounds(bars, monkeypatch):
    """channels_last fails to start, after inference_mode was kept: the comparison afresh still runs, so only the
    failed step's own rounds can leave the bar short; both configurations' sweeps stop at batch 16. The measured
    step reads as faster whatever its rounds said: on a busy machine a 3 ms gain may not, and the bars are the subject
    here, not the verdict."""
    prepare, decide = inference._prepare, inference.decide

    def failing(run, config, check=True):
        if config.channels_last:
            raise RuntimeError("the candidate does not start")
        return prepare(run, config, check)

    monkeypatch.setattr(inference, "_prepare", failing)
    monkeypatch.setattr(inference, "decide", lambda verdict, *rest: decide(FASTER, *rest))
    profile = replace(TINY, repeats=8, max_repeats=8)
    result = optlab.tune(SlowWithAutogradUpTo8, inference=True, input_shape=(3, 8, 8), max_batch=32,
                         request_seconds=0.05, profile=profile, device="cpu",
                         techniques=[inference.INFERENCE_MODE, inference.CHANNELS_LAST])
    decisions = result.steps.set_index("step")["decision"]
    assert (decisions[inference.INFERENCE_MODE], decisions[inference.CHANNELS_LAST]) == ("kept", "failed")
    assert [(desc, total) for desc, total, _ in bars] == [
        ("tune --inference SlowWithAutogradUpTo8", 2 * (profile.warmup_repeats + profile.max_repeats) * 3),
        ("batch sizes", 2 * len(doubling_series(32)))]
    for desc, total, bar in bars:
        assert (bar.total, bar.n) == (total, total), desc


def test_tune_s_bar_ends_at_its_total_when_nothing_is_kept(bars):
    with pytest.raises(NothingRecommended):  # every step failed: nothing timed afresh
        optlab.tune(FailsToTrain, input_shape=(12,), num_classes=4, profile=TINY, device="cpu",
                    techniques=["+ set_to_none, fused SGD"])
    (desc, total, bar), = bars
    assert (bar.total, bar.n) == (total, total) and total == 2 * (TINY.warmup_repeats + TINY.max_repeats) * 2


def test_the_decoding_bar_counts_first_runs_and_rounds_to_its_total(monkeypatch):
    made = []
    monkeypatch.setenv(progress.BOOK_ENV, "1")
    monkeypatch.setattr(decoding, "progress_bar", lambda total, desc, enabled=True: made.append(
        (total, progress.progress_bar(total, desc, enabled))) or made[-1][1])
    model = GPT(GPTConfig(vocab_size=40, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    decoding.decode_study(model, torch.randint(0, 40, (1, 8)), 3, rounds=2, variants=("no cache", "static cache"))
    (total, bar), = made
    assert total == 2 * (1 + 2) and (bar.total, bar.n) == (total, total)


def test_tune_memory_s_bar_counts_each_setting_it_measures_once(monkeypatch):
    """The foreach and fused optimizers share their before (the for-loop one), measured once: the bar's total counts
    the settings, not the fixes."""
    made = []
    monkeypatch.setenv(progress.BOOK_ENV, "1")
    monkeypatch.setattr(memory, "progress_bar", lambda total, desc, enabled=True: made.append(
        (total, progress.progress_bar(total, desc, enabled))) or made[-1][1])
    optlab.tune(lambda: nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4)), memory=True, input_shape=(12,),
                num_classes=4, batch_size=8, device="cpu")
    (total, bar), = made
    assert (bar.total, bar.n) == (total, total)

