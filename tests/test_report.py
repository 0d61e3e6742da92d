import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from optlab.book import report  # noqa: E402
from optlab.core.experiments import run_experiment  # noqa: E402
from optlab.core.seed import seed_results, seed_speedups  # noqa: E402
from tests.helpers import TINY  # noqa: E402


@pytest.fixture(scope="module")
def result():
    return run_experiment("set_to_none", profile=TINY, device="cpu", progress=False)


def test_seed_data_is_carried_as_tidy_rows():
    seed = seed_results()
    assert len(seed["technique"].unique()) == 9 and set(seed["phase"]) == {"train", "test"}
    amp = seed_speedups("mixed_precision").set_index(["model", "phase", "variant"])
    assert amp.loc[("resnet18", "train", "w mixed precision"), "speedup"] == pytest.approx(20.4 / 10.4)


def test_comparison_table_has_the_promised_columns(result):
    table = report.comparison_table(result.summary)
    for column in ["epoch s (median)", "IQR s", "speed-up", "95% CI", "verdict", "peak MiB"]:
        assert column in table
    assert len(table) == len(result.summary)


def test_plot_has_one_bar_per_model_and_variant_per_phase(result):
    grid = report.plot_comparison(result.samples, title="t")
    assert len(grid.axes.flat) == 2  # train and test
    assert all(len(ax.patches) >= 2 for ax in grid.axes.flat)


def test_seed_comparison_puts_seed_and_live_side_by_side(result):
    table = report.seed_comparison("set_to_none", live=result.summary)
    assert {"V100 s", "V100 speed-up", "live s", "live speed-up", "live verdict"} <= set(table.columns)
    row = table[(table["model"] == "resnet18") & (table["phase"] == "train") & (table["variant"] == "w gradient none")]
    assert row["V100 s"].item() == 20.0 and row["live s"].notna().item()


def test_reference_summary_is_none_without_stored_runs():
    assert report.reference_summary("no_such_technique") is None
