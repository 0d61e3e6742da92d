"""Every chapter opens with a cell tagged ``parameters`` (the convention papermill and Jupyter Book share): the models,
profile, batch size and time budget a reader may change. Values put there (by hand, or injected after it as papermill
does) reach the chapter's setup line and its runs."""
import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import optlab
from optlab.book import chapter

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NAMES = ("models", "profile", "batch_size", "time_budget_s")


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
    assert f"chapter.use({', '.join(NAMES)})" in after, f"{path.name}: the next cell does not apply the parameters"


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


@pytest.mark.parametrize("bad, message", [({"models": "resnet18"}, "write ['resnet18']"),
                                          ({"profile": "fast"}, "unknown profile 'fast'"),
                                          ({"batch_size": 0}, "batch size must be at least 1")])
def test_a_bad_parameter_is_one_clear_error(reader_choice, bad, message):
    with pytest.raises(optlab.OptlabError, match=message.replace("[", r"\[").replace("]", r"\]")):
        reader_choice(**bad)


@pytest.mark.parametrize("stem, workload_line", [("01_data_loading", "models mobilenet_v2; batch 6;"),
                                                 ("30_kv_cache", "models gpt_tiny; batch 3;")])
def test_values_injected_after_the_parameter_cell_reach_the_setup_line(stem, workload_line, smoke_env, tmp_path):
    """As papermill runs a chapter: a cell of new values after the tagged one, then the chapter's set-up cell."""
    notebook = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    index = next(i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", []))
    models = "['mobilenet_v2']" if stem.startswith("01") else "None"
    batch = 6 if stem.startswith("01") else 3
    injected = nbformat.v4.new_code_cell(f"models = {models}\nbatch_size = {batch}\ntime_budget_s = 5")
    notebook.cells = [notebook.cells[index], injected, notebook.cells[index + 1]]
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute(env=smoke_env | {"PYTHONPATH": str(ROOT)})
    printed = "".join(out.get("text", "") for out in notebook.cells[-1].outputs)
    assert workload_line in printed and "at most 5 s a model" in printed, printed
