import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import LineCollection, PathCollection  # noqa: E402

from optlab.book import report  # noqa: E402
from optlab.core.results import store  # noqa: E402
from optlab.core.run.experiments import run_experiment  # noqa: E402
from optlab.core.results.seed import seed_results, seed_speedups  # noqa: E402
from optlab.core.stats.summary import CONTROL  # noqa: E402
from tests.helpers import TINY  # noqa: E402

LABELS = ["w/o gradient none", "w gradient none"]


@pytest.fixture(scope="module")
def result():
    return run_experiment("set_to_none", profile=TINY, device="cpu", progress=False)


@pytest.fixture
def stored(result, tmp_path, monkeypatch) -> str:
    """The same run stored as a reference machine's record; returns the machine's name."""
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path)
    record = result.record | {"environment": result.record["environment"] | {"gpu_name": "Test GPU"}}
    store.save_record(record, tmp_path / "test-gpu", "set_to_none.json")
    return "Test GPU"


def test_seed_data_is_carried_as_tidy_rows():
    seed = seed_results()
    assert len(seed["technique"].unique()) == 9 and set(seed["phase"]) == {"train", "test"}
    amp = seed_speedups("mixed_precision").set_index(["model", "phase", "variant"])
    assert amp.loc[("resnet18", "train", "w mixed precision"), "speedup"] == pytest.approx(20.4 / 10.4)


def test_numbers_are_written_with_three_significant_figures_and_a_dash_when_missing():
    assert [report.number(v) for v in (1068.2, 55.13, 0.012345, 3, 2.0, float("nan"), None, "", "x")] == \
        ["1068", "55.1", "0.0123", "3", "2", "—", "—", "—", "x"]
    assert report.speedup_text(1.1, 1.05, 1.152) == "1.10 (1.05–1.15)"
    assert report.speedup_text(1.0, 1.0, 1.0) == "1.00" and report.speedup_text(0.025, float("nan"), 1) == "0.0250"
    assert report.significant(1068.24) == 1068 and report.significant(0.0123456) == 0.0123


def test_comparison_table_puts_the_decision_first_in_the_registrys_order(result):
    shuffled = result.summary.sample(frac=1, random_state=1)
    table = report.comparison_table(shuffled, LABELS)
    assert list(table.columns[:7]) == ["model", "phase", "variant", "compared with", "speed-up (99.5 % sequential interval)",
                                       "verdict", "peak MiB"]
    assert list(table["compared with"]) == ["—", LABELS[0]] * 2
    assert table.attrs["details"] == list(report.DETAILS.values()) and set(table.attrs["details"]) <= set(table)
    assert list(table["phase"]) == ["train", "train", "test", "test"] and list(table["variant"]) == LABELS * 2
    control = table[(table["phase"] == "test") & (table["variant"] == LABELS[1])]
    assert control["verdict"].item().endswith(f"({CONTROL})")  # set_to_none cannot touch the evaluation loop


def test_a_table_shows_no_index_no_nan_and_collapses_its_details(result):
    html = report.html_table(report.comparison_table(result.summary, LABELS))
    shown, details = html.split("<details")
    assert "<th>model</th>" in shown and report.SPEEDUP not in details and "epoch s (median)" not in shown
    assert "<summary>all columns</summary>" in details and "<th>epoch s (median)</th>" in details
    plain = report.html_table(pd.DataFrame({"a": [1.23456, float("nan")], "b": ["x", None]}))
    assert plain.count("<th>") == 2 and ">1.23<" in plain and plain.count(">—<") == 2 and "nan" not in plain.lower()
    indexed = report.html_table(pd.DataFrame({"a": [1.0]}, index=pd.Index(["r"], name="row")))
    assert "<th>row</th><th>a</th>" in indexed  # a named index is a column like the others


def test_speedups_set_the_live_run_beside_each_reference_and_the_seed(result, stored):
    tidy = report.speedups("set_to_none", result.summary)
    assert set(tidy["source"]) == {report.SEED, report.LIVE, stored}
    assert set(tidy["variant"]) == {LABELS[1]}, "the baseline against itself is not a speed-up"
    seed = tidy[tidy["source"] == report.SEED]
    assert set(seed["model"]) == {"resnet18"} and seed["speedup"].notna().all()  # only what ours measured too
    assert (tidy.loc[(tidy["phase"] == "test") & (tidy["source"] != report.SEED), "role"] == CONTROL).all()


FIGURE_ROWS = pd.DataFrame([
    {"model": "resnet18", "phase": "train", "variant": "v", "source": report.SEED, "speedup": 1.9, "role": "claim"},
    {"model": "resnet18", "phase": "train", "variant": "v", "source": report.LIVE, "speedup": 0.03, "ci_low": 0.02,
     "ci_high": 0.04, "verdict": "slower", "role": "claim"},
    {"model": "resnet18", "phase": "train", "variant": "v", "source": "H200", "speedup": 2.0, "ci_low": 1.8,
     "ci_high": 2.2, "verdict": "faster", "role": "claim"},
    {"model": "resnet18", "phase": "test", "variant": "v", "source": report.LIVE, "speedup": 1.01, "ci_low": 0.9,
     "ci_high": 1.1, "verdict": "can't tell yet", "role": CONTROL},
    {"model": "resnet18", "phase": "train", "variant": "w", "source": report.LIVE, "speedup": 1.0, "ci_low": 0.99,
     "ci_high": 1.01, "verdict": "same within 2 %", "role": "claim", "versus": "v"},
])


def test_the_speedup_figure_shows_intervals_the_seed_mark_verdicts_and_controls():
    figure = report.plot_speedups(FIGURE_ROWS)
    train, test = [ax for ax in figure.axes if ax.get_visible()]
    assert train.get_xscale() == "log" and train.get_xlim()[0] < 0.02 and train.get_xlim()[1] > 2.2
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in train.lines), "no line at 1"
    points = [c for c in train.collections if isinstance(c, PathCollection)]
    faces = sorted(tuple(c.get_facecolor()[0].round(2)) for c in points)
    assert (0, 0, 0, 1) in faces, "no seed mark"
    fills = {tuple(face[:3]) for face in (tuple(c.get_facecolor()[0]) for c in points)}
    assert {tuple(matplotlib.colors.to_rgba(report.VERDICT_COLOURS[v]))[:3]
            for v in ("faster", "slower", "same within 2 %")} <= fills, "three filled colours"
    assert len({tuple(matplotlib.colors.to_rgba(c))[:3] for c in report.VERDICT_COLOURS.values()}) == 3
    assert len([c for c in train.collections if isinstance(c, LineCollection)]) == 3  # live (twice) and H200
    hollow = [c for c in test.collections if isinstance(c, PathCollection)]
    assert [tuple(c.get_facecolor()[0][:3]) for c in hollow] == [(1, 1, 1)], "can't tell yet is hollow"
    assert CONTROL in test.get_title() and CONTROL not in train.get_title()
    assert "resnet18 · w (vs v)" in [t.get_text().replace("\n", " ") for t in train.get_yticklabels()]
    legend = [text.get_text() for text in figure.legends[0].texts]
    assert {"seed V100 (no interval)", "faster", "slower", "same within 2 %", "can't tell yet (hollow)",
            "H200"} <= set(legend)
    assert figure.get_supxlabel().endswith("lines: 99.5 % sequential intervals")


def test_seed_comparison_keeps_the_registrys_variant_order(result, stored):
    reference = report.reference_summary("set_to_none")
    table = report.seed_comparison("set_to_none", live=result.summary, reference=reference)
    assert {"V100 s", "V100 speed-up", "live s", "live verdict", f"{stored} s"} <= set(table.columns)
    assert list(table["variant"][:2]) == LABELS and list(table["model"][:4]) == ["resnet18"] * 4
    row = table[(table["model"] == "resnet18") & (table["phase"] == "train") & (table["variant"] == LABELS[1])]
    assert row["V100 s"].item() == 20.0 and row["live s"].notna().item()


def test_reference_summary_is_none_without_stored_runs():
    assert report.reference_summary("no_such_technique") is None


def test_the_stack_table_reads_each_step_against_the_one_before():
    steps = pd.DataFrame([{"model": "resnet18", "phase": "train", "step": "+ channels_last", "epoch_s": 55.23, "n": 12,
                           "vs previous": 1.31, "ci_low": 0.853, "ci_high": 2.0, "verdict": "can't tell yet",
                           "vs baseline": 1.25, "baseline_low": 1.1, "baseline_high": 1.4, "baseline_n": 6,
                           "baseline_verdict": "not waited for", "peak_mem_mb": 2951.2}])
    assert list(report.stack_table(steps).iloc[0]) == [
        "resnet18", "train", "+ channels_last", "1.31 (0.853–2.00)", "can't tell yet", "1.25 (1.10–1.40)", 2951.0,
        55.2, 12, 6]
    assert list(report.stack_table(steps).columns)[3:6] == [
        "vs the step before (99.5 % sequential interval)", "verdict (vs the step before)",
        "vs the baseline (estimate at the same look)"]
