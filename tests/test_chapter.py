"""What a chapter shows around its live run: the line naming the device and the stored references, and the
comparison with those references."""
import math
from dataclasses import replace

import pandas as pd
import pytest

from optlab.book import chapter, report
from optlab.core.results import store
from optlab.core.run.experiments import run_experiment
from optlab.core.knobs.profiles import get_profile
from tests.helpers import TINY


@pytest.fixture(scope="module")
def result():
    """A live run of every variant: one timed step and two repeats are all the page's lines and tables read."""
    return run_experiment("optimizers", models=["resnet18"], profile=TINY.with_sizes(steps=1, repeats=2), device="cpu",
                          progress=False)


def test_without_a_reference_the_page_says_so_once_and_how_to_make_one(result, tmp_path, monkeypatch):
    monkeypatch.setenv("OPTLAB_BOOK", "1")  # the page's links as the book's build writes them
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path)
    line = chapter.built_on(result)
    assert "(CPU), tiny profile" in repr(line) and "none yet (`python -m optlab reference --set beyond`" in repr(line)
    assert '<a href="../book/summary.html">the summary</a>' in line._repr_html_()
    assert "<code>python -m optlab reference --set beyond</code>" in line._repr_html_()
    beside = chapter.beside_references(result)
    assert isinstance(beside, chapter.Note) and "Nothing to set beside" in repr(beside)


def test_with_a_reference_the_page_names_it_and_sets_it_beside_the_live_numbers(result, tmp_path, monkeypatch):
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path)
    record = result.record | {"environment": result.record["environment"] | {"gpu_name": "Test GPU"}}
    store.save_record(record, tmp_path / "test-gpu", "optimizers.json")
    assert "Stored GPU references of optimizers: Test GPU." in repr(chapter.built_on(result))
    table = chapter.beside_references(result)
    assert isinstance(table, pd.DataFrame) and {"live s", "Test GPU s", "Test GPU peak MiB"} <= set(table.columns)
    assert list(table["variant"]) == [v for v in result.experiment.labels if v in set(table["variant"])]
    assert set(report.speedups(result.experiment, result.summary)["source"]) == {report.LIVE, "Test GPU"}


def test_the_setup_line_names_the_models_and_sizes_of_the_chapters_workload():
    cnn, gpt = chapter.setup_line("smoke", "cpu"), chapter.setup_line("smoke", "cpu", workload="gpt")
    assert "models resnet18" in cnn and "models gpt_tiny; batch 8;" in gpt and "resnet" not in gpt


@pytest.mark.parametrize("profile, budget", [("smoke", 26.0), ("quick", 150.0), ("full", math.inf)])
def test_a_page_with_time_to_spare_widens_only_the_smoke_profiles_budget_and_says_so(profile, budget):
    try:
        setup = chapter.use(profile=profile, page="13_optimizers")  # 26 s a model in smoke
        chosen = get_profile(None, cuda=False)
        assert chosen.time_budget_s == setup.profile.time_budget_s == budget
        plain = get_profile(profile)
        assert replace(chosen, time_budget_s=plain.time_budget_s, models=plain.models) == plain  # nothing else
        assert (f"at most {budget:g} s a model" in setup.line) == (not math.isinf(budget)), setup.line
        assert chapter.use(profile=profile, time_budget_s=5, page="13_optimizers").profile.time_budget_s == 5
    finally:
        chapter.use()
