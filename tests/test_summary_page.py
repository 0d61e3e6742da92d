import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402

from optlab.book import report, summary_page  # noqa: E402
from optlab.core.techniques.cnn import SEED_TECHNIQUES  # noqa: E402

LIVE_COLUMN = "live (99.5 % sequential interval)"  # the literal label: not built from the code's constant

ROW = {"technique": "set_to_none", "model": "resnet18", "phase": "train", "machine": "cpu", "profile": "smoke"}
LIVE = pd.DataFrame([
    {**ROW, "variant": "w/o gradient none", "speedup": 1.0, "ci_low": 1.0, "ci_high": 1.0, "verdict": "baseline"},
    {**ROW, "variant": "w gradient none", "speedup": 1.1, "ci_low": 1.05, "ci_high": 1.15, "verdict": "faster"},
])


def test_every_seed_technique_has_a_row_and_missing_records_say_not_run():
    table = summary_page.summary_table(summary_page.speedups({"live": pd.DataFrame()}))
    assert set(table.index.get_level_values("technique")) == set(SEED_TECHNIQUES)
    assert (table[LIVE_COLUMN] == summary_page.NOT_RUN).all()
    assert table.loc[("mixed_precision", "w mixed precision", "resnet18"), "seed V100"] == "1.96"


def test_a_live_record_fills_its_rows_with_interval_and_verdict():
    tidy = summary_page.speedups({"live": LIVE, "h200": pd.DataFrame()})
    table = summary_page.summary_table(tidy)
    row = table.loc[("set_to_none", "w gradient none", "resnet18")]
    assert (row[LIVE_COLUMN], row["live verdict"]) == ("1.10 (1.05–1.15)", "faster")
    assert table.loc[("set_to_none", "w gradient none", "resnet50"), LIVE_COLUMN] == summary_page.NOT_RUN
    assert list(table.columns) == ["compared with", "seed V100", "published, modern GPU", LIVE_COLUMN, "live verdict"]  # no records: no column
    assert summary_page.describe({"live": LIVE}).startswith("live: 1 of 9 seed techniques (missing: channels_last")


def test_the_figure_has_a_panel_per_model_with_points_from_every_source():
    figure = summary_page.plot_speedups(summary_page.speedups({"live": LIVE}))
    assert [ax.get_title() for ax in figure.axes] == ["resnet18", "resnet50", "resnet101", "mobilenet_v2"]
    legend = [text.get_text() for text in figure.legends[0].texts]
    assert {"live (this page's run)", "seed V100 (no interval)"} <= set(legend)
    assert figure.axes[0].get_yticklabels()[0].get_text().startswith("data_loading · ")  # the registry's order


BEYOND = pd.DataFrame([
    {**ROW, "technique": "optimizers", "variant": "SGD for-loop", "speedup": 1.0, "ci_low": 1.0, "ci_high": 1.0,
     "verdict": "baseline", "peak_mem_mb": 100.0, "tflops": 0.01},
    {**ROW, "technique": "optimizers", "variant": "Adam fused", "speedup": 1.1, "ci_low": 1.0, "ci_high": 1.2,
     "verdict": "can't tell yet", "peak_mem_mb": 95.0, "tflops": 0.011},
    {**ROW, "technique": "optimizers", "variant": "SGD fused", "speedup": 1.2, "ci_low": 1.1, "ci_high": 1.3,
     "verdict": "faster", "peak_mem_mb": 90.0, "tflops": 0.012},
    {**ROW, "technique": "compile", "variant": "compile default", "speedup": 0.9, "ci_low": 0.7, "ci_high": 1.1,
     "verdict": "can't tell yet", "peak_mem_mb": 80.0, "tflops": 0.009},
])


def test_the_beyond_table_has_every_variant_of_every_source_in_registry_order():
    table = summary_page.beyond_table({"live": pd.concat([LIVE, BEYOND]), "h200": BEYOND.iloc[2:3]})
    assert list(table.index.get_level_values("technique")) == ["compile", "optimizers", "optimizers"]  # no seed rows
    assert list(table.index.get_level_values("variant")[1:]) == ["SGD fused", "Adam fused"]  # the registry's order
    row = table.loc[("optimizers", "SGD fused", "resnet18", "train")]
    assert (row[LIVE_COLUMN], row["live verdict"], row["live peak MiB"]) == ("1.20 (1.10–1.30)", "faster", 90.0)
    assert row["compared with"] == "SGD for-loop"
    assert table.loc[("optimizers", "Adam fused", "resnet18", "train"), "compared with"] == "Adam for-loop"
    h200 = "h200 (99.5 % sequential interval)"
    assert row[h200] == "1.20 (1.10–1.30)"
    assert table.loc[("compile", "compile default", "resnet18", "train"), h200] == summary_page.NOT_RUN


def test_the_beyond_table_without_records_is_empty():
    assert summary_page.beyond_table({"live": pd.DataFrame()}).empty


GPT_ROW = {"model": "gpt_tiny", "phase": "train", "machine": "cpu", "profile": "smoke", "unit": "tokens"}
TRANSFORMER = pd.DataFrame([
    {**GPT_ROW, "technique": "gpt_shapes", "variant": "vocab 65, 8 x 64", "speedup": 1.0, "ci_low": 1.0,
     "ci_high": 1.0, "verdict": "baseline", "reference": None, "items_per_s": 4000.0, "peak_mem_mb": 6.0},
    {**GPT_ROW, "technique": "gpt_shapes", "variant": "vocab 128, 8 x 64", "speedup": 0.98, "ci_low": 0.9,
     "ci_high": 1.1, "verdict": "can't tell yet", "reference": "vocab 65, 8 x 64", "items_per_s": 3900.0,
     "peak_mem_mb": 6.5},
    {**GPT_ROW, "technique": "attention", "variant": "SDPA (PyTorch picks)", "speedup": 1.08, "ci_low": 1.02,
     "ci_high": 1.14, "verdict": "faster", "reference": "hand-written attention", "items_per_s": 4321.0,
     "peak_mem_mb": 5.0},
])


def test_the_transformer_table_shows_tokens_per_second_beside_speedup_and_verdict_in_track_order():
    table = summary_page.transformer_table({"live": pd.concat([LIVE, BEYOND, TRANSFORMER])})
    assert list(table.index.get_level_values("technique")) == ["attention", "gpt_shapes", "gpt_shapes"]  # no CNNs
    row = table.loc[("attention", "SDPA (PyTorch picks)", "gpt_tiny", "train")]
    assert (row[LIVE_COLUMN], row["live verdict"], row["live tokens/s"]) == ("1.08 (1.02–1.14)", "faster", 4321.0)
    assert row["live compared with"] == "hand-written attention"
    assert table.loc[("gpt_shapes", "vocab 65, 8 x 64", "gpt_tiny", "train"), "live verdict"] == "baseline"


def test_the_transformer_table_keeps_the_cnn_tables_as_they_were():
    found = {"live": pd.concat([LIVE, BEYOND, TRANSFORMER])}
    beyond = summary_page.beyond_table(found)
    assert "gpt_shapes" not in set(beyond.index.get_level_values("technique"))
    assert list(beyond.columns) == ["compared with", "published, modern GPU", LIVE_COLUMN, "live verdict", "live peak MiB",
                                    "live TFLOP/s"]
    assert summary_page.transformer_table({"live": pd.concat([LIVE, BEYOND])}).empty
