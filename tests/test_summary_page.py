import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402

from optlab import summary_page  # noqa: E402
from optlab.techniques import SEED_TECHNIQUES  # noqa: E402

ROW = {"technique": "set_to_none", "model": "resnet18", "phase": "train", "machine": "cpu", "profile": "smoke"}
LIVE = pd.DataFrame([
    {**ROW, "variant": "w/o gradient none", "speedup": 1.0, "ci_low": 1.0, "ci_high": 1.0, "verdict": "baseline"},
    {**ROW, "variant": "w gradient none", "speedup": 1.1, "ci_low": 1.05, "ci_high": 1.15, "verdict": "faster"},
])


def test_every_seed_technique_has_a_row_and_missing_records_say_not_run():
    table = summary_page.summary_table(summary_page.speedups({"live": pd.DataFrame()}))
    assert set(table.index.get_level_values("technique")) == set(SEED_TECHNIQUES)
    assert (table["live"] == summary_page.NOT_RUN).all()
    assert table.loc[("mixed_precision", "w mixed precision", "resnet18"), "seed V100"] == round(20.4 / 10.4, 2)


def test_a_live_record_fills_its_rows_with_interval_and_verdict():
    tidy = summary_page.speedups({"live": LIVE, "h200": pd.DataFrame()})
    table = summary_page.summary_table(tidy)
    row = table.loc[("set_to_none", "w gradient none", "resnet18")]
    assert (row["live"], row["live verdict"]) == ("1.10 (1.05-1.15)", "faster")
    assert table.loc[("set_to_none", "w gradient none", "resnet50"), "live"] == summary_page.NOT_RUN
    assert list(table.columns) == ["seed V100", "live", "live verdict"]  # a machine without records: no column
    assert summary_page.describe({"live": LIVE}).startswith("live: 1 of 9 seed techniques (missing: channels_last")


def test_the_figure_has_a_panel_per_model_with_points_from_every_source():
    grid = summary_page.plot_speedups(summary_page.speedups({"live": LIVE}))
    assert [ax.get_title() for ax in grid.axes.flat] == ["resnet18", "resnet50", "resnet101", "mobilenet_v2"]
    assert sorted(text.get_text() for text in grid.legend.texts) == ["live", "seed V100"]
