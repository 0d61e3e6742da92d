"""Every chapter opens with a cell tagged ``parameters`` (the convention papermill and Jupyter Book share): the models,
profile, batch size and time budget a reader may change. Values put there (by hand, or injected after it as papermill
does) are checked against what the chapter can run, reach its runs, and its setup line names them, or says plainly
that one has no effect on the page."""
import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import optlab
from optlab.book import chapter
from optlab.book.parameters import PAGES
from optlab.core.workload import get_workload

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NAMES = ("models", "profile", "batch_size", "time_budget_s")
SETUP_PRINT = "print(setup)"  # the line of a chapter's set-up cell that prints what the page runs
BATCH, BUDGET = 6, 5  # no page's own default: a line that names them names the reader's


@pytest.fixture
def reader_choice():
    """Whatever a test chooses is undone afterwards: the choice holds for the whole process."""
    yield chapter.use
    chapter.use()


def parameter_cell(path: Path) -> tuple[int, dict]:
    cells = json.loads(path.read_text())["cells"]
    tagged = [(i, c) for i, c in enumerate(cells) if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged parameters"
    return tagged[0]


def code_after_parameters(path: Path) -> str:
    index, _ = parameter_cell(path)
    cells = json.loads(path.read_text())["cells"][index + 1:]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_every_chapter_opens_with_its_parameter_cell_and_applies_it(path):
    index, cell = parameter_cell(path)
    cells = json.loads(path.read_text())["cells"]
    assert all(c["cell_type"] == "markdown" or "remove-cell" in c["metadata"].get("tags", []) for c in cells[:index])
    source = "".join(cell["source"])
    for name in NAMES:
        assert f"\n{name} = None  # " in source, f"{path.name}: {name} is not set to None with its comment"
    assert len(source.splitlines()) <= 6, "keep the parameter cell short"
    after = "".join(cells[index + 1]["source"])
    assert f'setup = chapter.use({", ".join(NAMES)}, page="{path.stem}")' in after, \
        f"{path.name}: the next cell does not apply the parameters to its own page"
    assert after.count(SETUP_PRINT) == 1, f"{path.name}: the set-up cell does not print what the page runs"


def test_every_chapter_has_its_page_and_every_page_its_chapter():
    assert sorted(PAGES) == [path.stem for path in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_a_chapter_s_runs_take_their_models_and_batch_from_its_setup(path):
    """The models a run uses come from the setup (or the profile it chose), never from a list written in the chapter;
    a study that has a batch size of its own is handed the setup's; a page that runs one model runs the setup's."""
    code, page = code_after_parameters(path), PAGES[path.stem]
    written = re.findall(r"models\s*=\s*(\[\s*[\"']|chosen\b|models\b)", code)
    assert not written, f"{path.name}: models given to a run by the chapter itself: {written}"
    overwritten = re.search(r"^\s*(\w+\s*,\s*)*models\s*=(?!=)", code, re.MULTILINE)
    assert not overwritten, f"{path.name}: the parameter `models` is overwritten: {overwritten}"
    if page.workload is None and "batch_size" not in page.unused:
        assert "setup.batch_size" in code, f"{path.name}: the study's batch size is not the setup's"
    if page.most == 1:
        assert "setup.model" in code, f"{path.name}: the one model the page runs is not the setup's"


def test_the_serving_pages_name_the_models_their_studies_load():
    from optlab.studies.serving import batching, decoding, quantization, speculative
    for cuda, device in ((False, "cpu"), (True, "cuda")):
        assert PAGES["30_kv_cache"].models[device] == (decoding.DECODE_SIZES[device].size,)
        assert PAGES["31_quantization"].models[device] == (quantization.chapter_plan(cuda).size,)
        plan = speculative.chapter_plan(cuda)
        assert PAGES["32_speculative_decoding"].models[device] == (plan.target, plan.draft)
        assert PAGES["33_serving"].models[device] == (batching.SETUPS[device].model,)


def test_the_reader_s_models_batch_size_and_budget_reach_the_runs_configs(reader_choice):
    reader_choice(models=["mobilenet_v2"], batch_size=6, time_budget_s=4.0)
    profile = optlab.get_profile(None, cuda=False)
    assert (profile.name, profile.models, profile.time_budget_s) == ("smoke", ("mobilenet_v2",), 4.0)
    cnn, gpt = optlab.get_experiment("mixed_precision"), optlab.get_experiment("gpt_precision")
    assert cnn.default_models(profile) == ("mobilenet_v2",)
    assert {config.batch_size for config in cnn.configs("mobilenet_v2", profile).values()} == {6}
    # the GPT workload sets its own batch per profile (8 in smoke): the reader's wins over it
    assert {config.batch_size for config in gpt.configs("gpt_tiny", profile).values()} == {6}
    line = chapter.setup_line(workload="gpt")
    assert "models gpt_tiny; batch 6;" in line and "at most 4 s a model" in line, line
    reader_choice()
    assert optlab.get_profile(None, cuda=False) == optlab.get_profile("smoke")


def test_a_page_s_own_default_goes_where_the_reader_s_would_and_the_reader_s_wins(reader_choice):
    assert reader_choice(page="12_precision").models == ("mobilenet_v2",)  # the page's own on a CPU
    assert optlab.get_profile(None, cuda=False).models == ("mobilenet_v2",)
    assert reader_choice(["resnet50"], page="12_precision").models == ("resnet50",)
    assert optlab.get_profile(None, cuda=False).models == ("resnet50",)
    assert reader_choice(page="02_non_blocking").models == optlab.get_profile("smoke").models


@pytest.mark.parametrize("bad, message", [({"models": "resnet18"}, "write ['resnet18']"),
                                          ({"profile": "fast"}, "unknown profile 'fast'"),
                                          ({"batch_size": 0}, "batch size must be at least 1"),
                                          ({"page": "01_data_loading", "models": ["gpt_tiny"]},
                                           "chapter 01_data_loading cannot run 'gpt_tiny': it runs the cifar models "
                                           "resnet18, resnet50, resnet101, mobilenet_v2"),
                                          ({"page": "27_gpt_shapes", "models": ["gpt_tiny", "gpt2_small"]},
                                           "chapter 27_gpt_shapes runs one model, got ['gpt_tiny', 'gpt2_small']"),
                                          ({"page": "19_tensor_parallel", "models": ["resnet18"]},
                                           "chapter 19_tensor_parallel runs its own models ['toy_gpt'] on this "
                                           "device, no others: set models to ['toy_gpt'] or None"),
                                          ({"page": "99_nothing"}, "unknown chapter '99_nothing'")])
def test_a_bad_parameter_is_one_clear_error(reader_choice, bad, message):
    reader_choice(batch_size=3)
    with pytest.raises(optlab.OptlabError, match=re.escape(message)):
        reader_choice(**bad)
    assert optlab.get_profile(None, cuda=False).batch_size == 3, "a refused choice changed the one in force"


def injected_models(stem: str) -> list[str]:
    """Models a reader might set on ``stem``'s page (a CPU's, smoke): a study's own; on a comparison's page a model
    that is not its default."""
    page = PAGES[stem]
    if page.workload is None:
        return list(page.own(page.models, False, "smoke"))
    names, own = get_workload(page.workload).model_names, page.own(page.models, False, "smoke")
    return [names[-1] if own != (names[-1],) else names[0]]


@pytest.mark.slow  # one kernel runs the set-up cell of every chapter (about 20 s of imports on a loaded 2-core CPU)
def test_values_injected_after_the_parameter_cell_reach_every_chapter_s_setup(smoke_env):
    """As papermill runs a chapter: a cell of new values after the tagged one, then the chapter's set-up cell up to
    its printed setup (what follows it builds the page's models), then a probe of the profile every run reads. All
    the chapters in turn, in one kernel."""
    cells, probes = [], {}
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        index, _ = parameter_cell(path)
        setup = notebook.cells[index + 1].source
        setup = setup[:setup.index(SETUP_PRINT) + len(SETUP_PRINT)]  # what follows builds the page's models
        values = f"models = {injected_models(path.stem)!r}\nbatch_size = {BATCH}\ntime_budget_s = {BUDGET}"
        probe = "print(json.dumps({'models': list(optlab.get_profile(None, False).models), 'batch': setup.batch_size}))"
        cells += [notebook.cells[index], nbformat.v4.new_code_cell(values), nbformat.v4.new_code_cell(setup),
                  nbformat.v4.new_code_cell(f"import json\n{probe}")]
        probes[path.stem] = len(cells) - 1
    notebook = nbformat.v4.new_notebook(cells=cells)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute(env=smoke_env | {"PYTHONPATH": str(ROOT)})
    text = lambda cell: "".join(out.get("text", "") for out in cell.outputs)
    for stem, probe in probes.items():
        page, models, printed = PAGES[stem], injected_models(stem), text(notebook.cells[probe - 1])
        assert f"models {', '.join(models)};" in printed, (stem, printed)
        assert f"batch {BATCH}" in printed or f"batch_size = {BATCH} has no effect on this page: " in printed, \
            (stem, printed)
        assert f"at most {BUDGET} s a" in printed or f"time_budget_s = {BUDGET} has no effect on this page: " in \
            printed, (stem, printed)
        reached = json.loads(text(notebook.cells[probe]))
        if page.workload is not None:  # what the runs' configs read (the test above follows it into them)
            assert reached == {"models": models, "batch": BATCH}, (stem, reached)
        elif "batch_size" not in page.unused:
            assert reached["batch"] == BATCH, (stem, reached)
