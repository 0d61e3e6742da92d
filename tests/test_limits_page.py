"""The summary page's kept tables and against the limit: the serving and
memory tables read by their columns, a step's counts and bound, and the roofline figure."""
import matplotlib

matplotlib.use("Agg")

import math  # noqa: E402
from dataclasses import replace  # noqa: E402

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from optlab.book import glance, limits  # noqa: E402
from optlab.book.downloads import PAGE_RUNS  # noqa: E402
from optlab.book.report.roofline import plot_roofline  # noqa: E402
from optlab.book.report.tables import html_table  # noqa: E402
from optlab.core.knobs.config import RunConfig  # noqa: E402
from optlab.core.results import store  # noqa: E402
from optlab.core.workload import get_workload  # noqa: E402
from optlab.studies.limits import roofline  # noqa: E402
from optlab.studies.limits.ceilings import Roofs  # noqa: E402

def test_serving_and_memory_tables_are_read_by_their_columns_and_missing_ones_say_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "LIVE_DIR", tmp_path)
    (tmp_path / PAGE_RUNS).mkdir()
    pd.DataFrame({"variant": ["static cache"], "device": ["cpu"], "tokens/s": [900.0], "TPOT ms": [1.1],
                  "steps": [64]}).to_csv(tmp_path / PAGE_RUNS / "kv-cache-and-compiled-decoding-timings.csv",
                                         index=False)
    found = glance.serving()
    table = found["decoding with a KV cache, compiled (chapter 30)"]
    assert list(table.columns) == ["variant", "device", "tokens/s", "TPOT ms"]  # the step count is left out
    assert found["serving latency (chapter 33)"].startswith("not run: chapter 33 keeps")
    assert all(isinstance(v, str) for v in glance.memory().values())
    pd.DataFrame({"rate": [191.4], "scheduler": ["static"], "span_s": [0.19], "tokens_per_s": [1386.7],
                  "requests_per_s": [155.8], "goodput_per_s": [155.8], "met_share": [1.0]}).to_csv(
        tmp_path / PAGE_RUNS / "serving-throughput.csv", index=False)
    throughput = glance.serving()["serving throughput (chapter 33)"]
    assert list(throughput.columns) == ["rate", "scheduler", "tokens_per_s", "requests_per_s", "goodput_per_s"]
    pd.DataFrame({"rate": [10.0], "scheduler": ["static"], "metric": ["TTFT"], "values": [40], "rounds": [3],
                  "p50 ms": [5.0], "p50 low": [4.0], "p50 high": [6.0], "pooled p50 ms": [5.1], "p99 ms": [9.0],
                  "p99 low": [8.0], "p99 high": [10.0], "pooled p99 ms": [9.2]}).to_csv(
        tmp_path / PAGE_RUNS / "serving-latency.csv", index=False)
    latency = glance.serving()["serving latency (chapter 33)"]  # the percentiles; their intervals stay in chapter 33
    assert list(latency.columns) == ["rate", "scheduler", "metric", "p50 ms", "pooled p50 ms", "p99 ms",
                                     "pooled p99 ms"]
    assert all(table.startswith("not run: chapter 3") for table in glance.first_step().values())
    pd.DataFrame({"start": ["whole, warm caches"], "against": ["whole, cold caches"], "first step s": [2.5],
                  "against s": [20.5], "times shorter": [8.2], "low": [5.9], "high": [11.7],
                  "verdict": ["faster"]}).to_csv(tmp_path / PAGE_RUNS / "compile-start-verdicts.csv", index=False)
    starts = next(iter(glance.first_step().values()))
    assert list(starts.columns) == ["start", "against", "times shorter", "verdict"]


CONFIG = RunConfig(model="resnet18", width=0.125, batch_size=8)
GPT = RunConfig(workload="gpt", model="gpt_tiny", batch_size=4, optimizer="adamw")


def test_a_step_s_bytes_follow_the_stated_model_and_scale_with_the_batch():
    cost, double = roofline.step_cost(CONFIG), roofline.step_cost(replace(CONFIG, batch_size=16))
    parameters = sum(p.numel() for p in get_workload("cifar").build(CONFIG).parameters())
    assert cost.weight_bytes == parameters * 4 * (3 + 2 + 2 * 1)  # SGD with momentum: one state
    adamw = roofline.step_cost(GPT)
    gpt_parameters = sum(p.numel() for p in {id(p): p for p in get_workload("gpt").build(GPT).parameters()}.values())
    assert adamw.weight_bytes == gpt_parameters * 4 * (3 + 2 + 2 * 2)  # AdamW: two
    assert double.activation_bytes == 2 * cost.activation_bytes and double.input_bytes == 2 * cost.input_bytes
    assert cost.input_bytes == 8 * (3 * 32 * 32 * 4 + 8) // 1  # images in fp32 and their int64 labels
    assert double.flops == 2 * cost.flops and double.ops == cost.ops
    assert cost.intensity == pytest.approx(cost.flops / cost.bytes)
    bf16 = roofline.step_cost(replace(CONFIG, amp_dtype="bf16"))
    assert bf16.precision == "bf16" and bf16.activation_bytes < cost.activation_bytes  # autocast's 16-bit outputs


def test_activations_are_what_autograd_saves_written_once_and_read_once():
    from optlab.studies.memory.breakdown import saved_activation_bytes

    model = get_workload("cifar").build(CONFIG)
    batch = (get_workload("cifar").input_for(8, CONFIG), torch.zeros(8, dtype=torch.long))
    counted = saved_activation_bytes(model, batch, get_workload("cifar").loss, None)  # the memory chapter's count
    assert roofline.step_cost(CONFIG).activation_bytes == pytest.approx(2 * counted, rel=0.02)


def test_the_operator_count_is_what_the_step_dispatches():
    counter = roofline.OpCounter()
    with counter:
        x = torch.ones(3)
        (x + 1).mul_(2).sum()
    assert sum(counter.counts.values()) == 4 and counter.counts["aten.add"] == 1
    foreach, loop = (roofline.step_cost(replace(GPT, optimizer_impl=impl)) for impl in ("foreach", "default"))
    assert loop.ops > foreach.ops  # the for-loop optimizer launches per parameter


ROOFS = Roofs({"fp32": 1e11, "bf16": 2e11}, 1e10, 1e-5, "a test CPU")
COST = roofline.StepCost(flops=10**9, weight_bytes=10**7, activation_bytes=2 * 10**7, input_bytes=10**6, ops=600,
                         precision="fp32")


@pytest.mark.parametrize("step_ms, bound", [(11.0, "launch"), (13.0, "compute"), (40.0, "compute")])
def test_each_bound_is_its_count_over_its_ceiling_and_the_rule_names_the_bound(step_ms, bound):
    row = roofline.limit_row(COST, step_ms / 1e3, ROOFS)
    assert row["MFU % of measured MAMF"] == pytest.approx(100 * (1e9 / 1e11) / (step_ms / 1e3))
    assert row["MBU % of measured"] == pytest.approx(100 * (3.1e7 / 1e10) / (step_ms / 1e3))
    assert row["operators x launch ms"] == pytest.approx(6.0)  # 600 x 10 µs
    assert row["bound"] == bound
    assert row["% of that ceiling"] == pytest.approx(100 * {"launch": 6.0, "compute": 10.0}[bound] / step_ms)
    assert math.isnan(row["MFU % of datasheet"]) and math.isnan(row["MBU % of datasheet"])


def test_memory_bound_and_a_datasheet_peak_where_the_gpu_is_known():
    heavy = replace(COST, activation_bytes=10**9)
    row = roofline.limit_row(heavy, 0.2, ROOFS, gpu_name="NVIDIA H100 80GB HBM3")
    assert row["bound"] == "memory" and row["% of that ceiling"] == pytest.approx(100 * 1.011e9 / 1e10 / 0.2)
    assert row["MFU % of datasheet"] == pytest.approx(100 * 1e9 / 0.2 / 67e12)  # H100 SXM fp32, dense
    assert row["MBU % of datasheet"] == pytest.approx(100 * 1.011e9 / 0.2 / 3.35e12)  # its HBM3
    assert "above its measured ceiling" in roofline.limit_row(COST, 0.005, ROOFS)["note"]
    assert roofline.limit_row(COST, 0.039, ROOFS)["note"] == ""  # compute explains 26 %
    assert roofline.limit_row(COST, 0.041, ROOFS)["note"] == roofline.UNEXPLAINED  # 24 %


def test_the_limits_table_keeps_each_workload_s_fastest_variant(tmp_path):
    points = pd.DataFrame([
        {"workload": "cifar", "model": "resnet18", "technique": "a", "variant": "slow", "config": CONFIG,
         "step_ms": 50.0, "items_per_s": 100.0, "unit": "images", "gpu_name": ""},
        {"workload": "cifar", "model": "resnet18", "technique": "a", "variant": "fast", "config": CONFIG,
         "step_ms": 25.0, "items_per_s": 200.0, "unit": "images", "gpu_name": ""},
    ])
    table = pd.DataFrame([
        {"ceiling": "matmul", "dtype": "fp32", "detail": "8x8x8", "value": 0.1, "device": "cpu"},
        {"ceiling": "copy", "dtype": "fp32", "detail": "", "value": 10.0, "device": "cpu"},
        {"ceiling": "read", "dtype": "fp32", "detail": "", "value": 12.0, "device": "cpu"},
        {"ceiling": "launch", "dtype": "fp32", "detail": "eager: one add", "value": 5.0, "device": "cpu"},
    ])
    found = limits.limits_table({"live": (points, table), "h200": (points, None)})
    assert list(found["best"]) == ["a: fast"] and found.index.tolist() == [("live", "cifar", "resnet18")]
    assert found["step ms"].iloc[0] == 25.0
    figure = plot_roofline(limits.roofline_points(points, Roofs.from_table(table), "cifar"), Roofs.from_table(table))
    assert figure.get_figwidth() == pytest.approx(7.0)
    ax = figure.axes[0]
    assert ax.get_xscale() == "log" and len(ax.collections) >= 2  # the points and their launch roofs
    assert any("MAMF 0.1 TFLOP/s" in t.get_text() for t in figure.axes[1].get_legend().get_texts())
    assert figure.axes[2].texts[0].get_text().startswith("1. resnet18, a: slow\n2. resnet18, a: fast")
    page = html_table(found)  # the page shows the bound first; the rest of the columns is one click away
    shown, more = page.split("<details", 1)
    assert all(f"<th>{name}</th>" in shown for name in ("source", "best", "bound", "MFU % of measured MAMF"))
    assert "datasheet" not in shown and "TFLOP/s" not in shown, shown
    assert all(f"<th>{name}</th>" in more for name in ("source", "model", "TFLOP/s", "MBU % of datasheet")), more


def test_the_published_ceilings_link_their_sources_and_keep_the_shape_one_click_away():
    table = limits.published_ceilings()
    page = html_table(table)
    shown, more = page.split("<details", 1)
    assert "url" not in table and table["source"].str.fullmatch(r"\[.+\]\(https://.+\)").all(), table["source"]
    assert '<a href="https://' in shown and "best_shape" not in shown and "<th>best_shape</th>" in more
