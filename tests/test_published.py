"""The one table of published figures: each schema rule refuses a row that breaks it, the kept rows pass, and a page
shows a chapter's figures (or, for a chapter with none, the sources searched) in the same block."""
import pandas as pd
import pytest

from optlab.book import report, summary_page
from optlab.core.errors import OptlabError
from optlab.core.results import published
from optlab.core.techniques.cnn import BEYOND_TECHNIQUES, SEED_TECHNIQUES

GOOD = dict(chapter="mixed_precision", kind="measured", source="DLE", url="https://example.org/readme", where="table 1",
            hardware="1x A100 80GB", software="", model="ResNet-50", before_setting="TF32",
            after_setting="mixed precision", metric="training throughput", before=938, after=2470, unit="img/s",
            speedup="2.63", from_plot="no", note="")


@pytest.fixture
def table_of(tmp_path, monkeypatch):
    """Write rows as a published table and load it through the one loader."""
    class Folder:
        def joinpath(self, name):
            return tmp_path / name

    monkeypatch.setattr(published.resources, "files", lambda package: Folder())

    def load(*rows: dict) -> pd.DataFrame:
        pd.DataFrame(list(rows)).to_csv(tmp_path / "t.csv", index=False)
        return published.published_figures(name="t.csv")
    return load


def test_a_good_row_passes_with_its_published_speedup(table_of):
    assert table_of(GOOD)["speed-up"].iloc[0] == pytest.approx(2.63)


def test_a_row_without_a_url_is_refused(table_of):
    with pytest.raises(OptlabError, match="no URL"):
        table_of(GOOD | dict(url=""))


@pytest.mark.parametrize("field", ["before", "after", "speedup"])
def test_a_number_that_is_not_positive_is_refused(table_of, field):
    with pytest.raises(OptlabError, match="positive"):
        table_of(GOOD | {field: 0 if field != "speedup" else "-2.63"})


def test_a_published_speedup_must_follow_the_units_direction(table_of):
    time = GOOD | dict(unit="s", before=0.11, after=0.016, speedup="7")  # a time: before / after = 6.875, printed 7
    assert table_of(time)["speed-up"].iloc[0] == 7
    with pytest.raises(OptlabError, match="before / after"):
        table_of(time | dict(speedup="0.15"))  # after / before: the rate's direction on a time
    with pytest.raises(OptlabError, match="after / before"):
        table_of(GOOD | dict(speedup="0.38"))  # before / after on a rate
    with pytest.raises(OptlabError, match="published speed-up 2.65"):
        table_of(GOOD | dict(speedup="2.65"))  # 2470 / 938 = 2.633: not 2.65 to the two digits printed
    assert table_of(GOOD | dict(speedup=""))["speed-up"].iloc[0] == pytest.approx(2470 / 938)  # computed


def test_an_unknown_chapter_kind_or_unit_is_refused(table_of):
    for change, message in ((dict(chapter="warp_drive"), "unknown chapter"), (dict(kind="rumour"), "unknown kind"),
                            (dict(unit="furlongs"), "unknown unit")):
        with pytest.raises(OptlabError, match=message):
            table_of(GOOD | change)


def test_a_duplicate_row_is_refused(table_of):
    assert len(table_of(GOOD, GOOD | dict(where="table 2"))) == 2  # the same number from two places is two rows
    with pytest.raises(OptlabError, match="duplicate"):
        table_of(GOOD, GOOD)


def test_a_measured_row_needs_a_number(table_of):
    with pytest.raises(OptlabError, match="needs an after value"):
        table_of(GOOD | dict(after="", speedup=""))
    assert table_of(GOOD | dict(kind="advice", before="", after="", speedup="", unit=""))["speed-up"].isna().all()


def test_the_kept_table_covers_every_chapter_of_the_seed_and_beyond():
    table = published.published_figures()
    early = table[table["chapter"].isin(SEED_TECHNIQUES + BEYOND_TECHNIQUES + ("profiling",))]
    assert (early["kind"] == "measured").sum() >= 20
    for chapter in SEED_TECHNIQUES + BEYOND_TECHNIQUES + ("profiling",):
        rows = table[table["chapter"] == chapter]
        assert rows["kind"].isin(["measured", "searched"]).any(), chapter  # a figure, or the sources searched
    # every earlier figure is kept: the MAMF table, compile times, graph breaks, serving and the transformer track
    assert table.groupby("chapter").size()[["ceilings", "compile_time", "graph_breaks", "kv_cache", "quantization",
                                            "speculative", "serving", "gpt_all_together"]].tolist() == [7, 3, 4, 4, 9,
                                                                                                        3, 9, 8]
    flex = table[table["after_setting"] == "FlexAttention"].iloc[0]
    assert flex["speed-up"] == pytest.approx(7.2 / 5.03)  # a time: before / after
    accumulation = table[(table["chapter"] == "gradient_accumulation") & (table["kind"] == "measured")].iloc[0]
    assert accumulation["speed-up"] == pytest.approx(236.39 / 210.53)  # samples a second, a rate: after / before


def test_a_chapter_with_none_names_the_sources_searched():
    block = report.published_block("set_to_none")
    assert block.table is None and "No published figure" in block.lines[0]
    assert "sources searched" in block.lines[0] and "tuning_guide" in block._repr_html_()
    assert report.summary_cell("set_to_none") == "none found"


def test_a_chapter_with_figures_shows_them_linked_and_says_where_the_seed_disagrees():
    block = report.published_block("mixed_precision")
    page = block._repr_html_()
    assert report.theirs.HEADING in page and '<a href="https://github.com/NVIDIA/DeepLearningExamples' in page
    assert "url" not in block.table and (block.table["speed-up"] == ["2.63", "2.29", "3.02", "2.89", "2.16", "1.93"]).all()
    assert any(line.startswith("The seed and the published figures disagree") for line in block.lines)
    assert "0.919x to 2.24x" in block.lines[0]  # the seed's MobileNetV2 slowdown to its ResNet18 gain
    computed = report.published_block("channels_last").table["speed-up"]
    assert computed.str.endswith("(computed)").all()  # the PR prints no speed-up: ours is marked as ours


def test_the_summary_sets_the_published_figure_beside_each_technique():
    table = summary_page.summary_table(summary_page.speedups({}))
    column = table[report.SUMMARY_COLUMN]
    assert list(table.columns[1:3]) == [report.SEED, report.SUMMARY_COLUMN]  # after the seed's V100 column
    mixed = column.xs("mixed_precision", level="technique").unique().tolist()
    assert mixed == ["[2.63x, 1x A100 80GB](https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/"
                     "Classification/ConvNets/resnet50v1.5/README.md)"]
    assert set(column.xs("set_to_none", level="technique")) == {"none found"}
