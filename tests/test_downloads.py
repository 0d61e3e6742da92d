"""The records behind a page: which files a chapter offers, the links it shows, and what the site publishes."""
import zipfile
from types import SimpleNamespace

import pandas as pd
import pytest

import optlab
from optlab.book import chapter, downloads
from optlab.core.results import store


def record(technique: str, machine: str, gpu: "str | None" = None) -> dict:
    return {"schema_version": store.SCHEMA_VERSION, "technique": technique, "title": technique,
            "environment": {"device_name": machine, "gpu_name": gpu, "data_source": "stand-in"},
            "profile": {"name": "tiny"}, "samples": [{"model": "resnet18", "variant": "a", "seconds": 1.5}],
            "summary": []}


@pytest.fixture(autouse=True)
def as_the_book_builds_it(monkeypatch):
    """The pages' links as the book's build writes them (a notebook in Lab links elsewhere: tests/test_lab_links.py)."""
    monkeypatch.setenv("OPTLAB_BOOK", "1")


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """Empty live, reference and distributed folders in place of the repository's."""
    live, reference, distributed = (tmp_path / name for name in ("live", "reference", "distributed"))
    monkeypatch.setattr(store, "LIVE_DIR", live)
    monkeypatch.setattr(store, "REFERENCE_DIR", reference)
    monkeypatch.setattr(store, "DISTRIBUTED_DIR", distributed)
    return live, reference, distributed


def test_a_chapter_offers_its_live_record_and_every_stored_reference(folders):
    live, reference, _ = folders
    path = store.save_record(record("set_to_none", "this cpu"), live, "set_to_none.json")
    store.save_record(record("set_to_none", "h200", "NVIDIA H200"), reference / "h200", "set_to_none.json")
    store.save_record(record("other", "h200", "NVIDIA H200"), reference / "h200", "other.json")
    offered = downloads.downloads("set_to_none", live=path)
    assert [file.href for file in offered.files] == ["../records/live/set_to_none.json",
                                                     "../records/reference/h200/set_to_none.json"]
    html = offered._repr_html_()
    assert '<a href="../records/live/set_to_none.json" download>set_to_none.json</a>' in html
    assert "the live run on this page (this cpu (CPU), tiny profile)" in html and "on h200" in html
    assert "<code>optlab.load_samples(path)</code> reads a .json file back" in html


def test_a_page_without_records_says_so(folders):
    assert "no stored GPU reference yet" in downloads.downloads("set_to_none")._repr_html_()


def test_kept_runs_and_tables_are_saved_beside_the_live_records_not_among_them(folders):
    live, _, _ = folders
    table = pd.DataFrame({"batch_size": [1, 2], "per_image_us": [10.0, 6.0]})
    offered = downloads.downloads(kept={"cuda_graphs sweep": table, "tune ViT (small)": record("tune", "this cpu")})
    assert [file.name for file in offered.files] == ["live/pages/cuda_graphs-sweep.csv", "live/pages/tune-vit-small.json"]
    assert pd.read_csv(live / "pages" / "cuda_graphs-sweep.csv").equals(table)
    assert not list(live.glob("*.json")), "the summary page reads live/*.json: a page's extra runs stay out of it"


def test_built_on_shows_the_line_and_the_downloads(folders):
    live, _, _ = folders
    path = store.save_record(record("optimizers", "this cpu"), live, "optimizers.json")
    result = optlab.ExperimentResult(optlab.get_experiment("optimizers"), pd.DataFrame(), pd.DataFrame(),
                                     store.load_record(path), path)
    shown = chapter.built_on(result)._repr_html_()
    assert shown.index('class="optlab-note"') < shown.index('href="../records/live/optimizers.json"')


def test_publish_copies_every_record_and_archives_them(folders, tmp_path):
    live, reference, distributed = folders
    store.save_record(record("set_to_none", "this cpu"), live, "set_to_none.json")
    store.save_record(record("set_to_none", "h200", "NVIDIA H200"), reference / "h200", "set_to_none.json")
    store.save_table(pd.DataFrame({"a": [1]}), reference / "h200", "microbench-copy")
    store.save_record(record("gradient_accumulation", "h200x8"), distributed / "h200x8", "run.json")
    (reference / "README.md").write_text("not a record")
    site = tmp_path / "html"
    names = downloads.publish(site)
    assert sorted(names) == ["distributed/h200x8/run.json", "live/set_to_none.json",
                             "reference/h200/microbench-copy.csv", "reference/h200/set_to_none.json"]
    assert "4 files" in repr(downloads.archive())
    samples = optlab.load_samples(site / "records" / "reference" / "h200" / "set_to_none.json")
    assert list(samples["machine"]) == ["NVIDIA H200"]
    with zipfile.ZipFile(site / "records" / downloads.ARCHIVE) as archive:
        assert sorted(archive.namelist()) == sorted(f"optlab-records/{name}" for name in names)
    assert not [path for path in (site / "records").iterdir() if path.name.startswith(".")], "a temporary file left"


def test_a_file_outside_the_published_folders_is_refused_in_one_line(folders, tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    with pytest.raises(optlab.OptlabError, match="is not under a folder the site publishes"):
        downloads.downloads(stored=[elsewhere])


def test_stored_tables_offer_each_machines_table_of_that_name_only(folders):
    _, reference, _ = folders
    for machine in ("h200", "a100"):
        store.save_table(pd.DataFrame({"batch_size": [1]}), reference / machine, "cuda_graphs_sweep")
    store.save_table(pd.DataFrame({"a": [1]}), reference / "h200", "profiling-breakdown")
    store.save_table(pd.DataFrame({"a": [1]}), reference / "h200", "cuda_graphs_sweep-old")
    store.save_record(record("cuda_graphs_sweep", "h200", "NVIDIA H200"), reference / "h200", "cuda_graphs_sweep.json")
    offered = downloads.downloads(stored_tables=["cuda_graphs_sweep", "profiling-breakdown", "profiling-top-ops"])
    assert [(file.name, file.what) for file in offered.files] == [
        ("reference/a100/cuda_graphs_sweep.csv", "the stored GPU table cuda_graphs_sweep on a100"),
        ("reference/h200/cuda_graphs_sweep.csv", "the stored GPU table cuda_graphs_sweep on h200"),
        ("reference/h200/profiling-breakdown.csv", "the stored GPU table profiling-breakdown on h200")]
    html = offered._repr_html_()
    assert '<a href="../records/reference/a100/cuda_graphs_sweep.csv" download>' in html
    assert "<code>pandas.read_csv(path)</code> reads a .csv file back" in html
    assert not downloads.downloads(stored_tables=["microbench-copy"]).files


def test_the_tables_chapters_offer_are_the_ones_run_reference_writes(folders, monkeypatch):
    """Chapters 11 and 15 name their stored tables by the constants that the GPU reference runs save them under."""
    from optlab.studies.kernels import cuda_graphs
    from optlab.studies import profiling

    _, reference, _ = folders
    monkeypatch.setattr(cuda_graphs, "resolve_device", lambda device: SimpleNamespace(is_cuda=True))  # a GPU's run
    monkeypatch.setattr(cuda_graphs, "sweep", lambda *args, **kwargs: pd.DataFrame({"batch_size": [1]}))
    monkeypatch.setattr(profiling, "profile_configs", lambda *args, **kwargs: {})
    monkeypatch.setattr(profiling, "breakdown_table", lambda results: pd.DataFrame({"wall_ms": [1.0]}))
    monkeypatch.setattr(profiling, "top_ops_table", lambda results: pd.DataFrame({"op": ["mm"]}))
    written = cuda_graphs.run_reference(reference / "h200") + profiling.run_reference(reference / "h200")
    offered = downloads.downloads(stored_tables=[cuda_graphs.REFERENCE_TABLE, *profiling.TABLES])
    assert sorted(file.name for file in offered.files) == sorted(downloads.site_path(path) for path in written)
