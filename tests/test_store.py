import json

import pandas as pd
import pytest

from optlab.core.results import store
from optlab.core.errors import OptlabError
from optlab.core.run.experiments import run_experiment
from tests.helpers import TINY
from tests.test_experiments import AA


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("results")
    return run_experiment(AA, profile=TINY, device="cpu", progress=False, out=folder)


def test_results_survive_a_save_and_load(saved):
    record = store.load_record(saved.path)
    assert record["schema_version"] == store.SCHEMA_VERSION
    assert record["technique"] == "a_a" and record["environment"]["torch"]
    samples = store.load_samples(saved.path)
    assert len(samples) == len(saved.samples)
    assert samples["step_times_s"].tolist() == saved.samples["step_times_s"].tolist()
    pd.testing.assert_series_equal(samples["epoch_equiv_s"], saved.samples["epoch_equiv_s"], check_names=False)
    summaries = store.load_summaries(saved.path.parent)
    assert set(summaries["verdict"]) == set(saved.summary["verdict"])
    assert summaries["machine"].notna().all()


def test_an_interrupted_write_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    path = store.save_record({"schema_version": store.SCHEMA_VERSION, "technique": "x"}, tmp_path, "x.json")
    before = path.read_text()

    def crash(fd):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(store.os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        store.save_record({"schema_version": store.SCHEMA_VERSION, "technique": "new"}, tmp_path, "x.json")
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # no temporary file left behind


def test_unwritable_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OptlabError, match="cannot be written"):
        store.writable_dir(blocker)


def test_foreign_or_broken_files_are_refused(tmp_path):
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "other.json").write_text(json.dumps({"schema_version": 999}))
    with pytest.raises(OptlabError, match="cannot read results file"):
        store.load_record(tmp_path / "broken.json")
    with pytest.raises(OptlabError, match="not an optlab record of schema version"):
        store.load_record(tmp_path / "other.json")


def test_records_are_strict_json(saved):
    json.loads(saved.path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_results_are_found_at_the_repository_root_whatever_folder_the_store_sits_in():
    """The stored references and the live records sit in the repository's own results/: a store moved one folder
    deeper once looked for them inside the package."""
    assert (store.REPO_ROOT / "pyproject.toml").is_file() and (store.REPO_ROOT / "optlab" / "__init__.py").is_file()
    assert store.REFERENCE_DIR == store.REPO_ROOT / "results" / "reference"
