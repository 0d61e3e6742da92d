"""The all-together chapter's pieces: the step-by-step table, the waterfall, device peaks and MFU, the learning check."""
import math

import matplotlib
import pandas as pd
import pytest

from optlab.studies.limits import ceilings, peaks
from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import resolve_device
from optlab.core.errors import OptlabError
from optlab.core.knobs.profiles import get_profile
from optlab.core.techniques.registry import get_experiment
from optlab.studies.learning import learning_curves
from optlab.book.report import plot_waterfall
from optlab.core.stats.summary import NOT_WAITED, step_by_step
from tests.helpers import TINY

matplotlib.use("Agg")


def _samples(times: dict[str, list[float]]) -> pd.DataFrame:
    """Tidy samples of one model and phase: each variant's repeats with the given per-step times."""
    rows = []
    for variant, steps in times.items():
        for repeat, step in enumerate(steps):
            rows.append({"model": "m", "phase": "train", "variant": variant, "repeat": repeat, "status": "ok",
                         "epoch_images": 1000, "images_per_step": 10, "startup_s": 0.0, "step_times_s": [step] * 4,
                         "step_median_s": step, "epoch_equiv_s": 100 * step, "images_per_s": 10 / step,
                         "peak_mem_mb": 1.0, "tflops": 1.0 / step})
    return pd.DataFrame(rows)


def test_step_by_step_compares_each_step_with_the_one_before():
    samples = _samples({"a": [1.0, 1.01, 0.99], "b": [0.5, 0.51, 0.49], "c": [0.5, 0.506, 0.494]})
    table = step_by_step(samples, ["a", "b", "c"], {"b": "a", "c": "b"}).set_index("step")
    assert list(table.index) == ["b", "c"]
    assert table.loc["b", "vs previous"] == pytest.approx(2.0, rel=0.02) and table.loc["b", "verdict"] == "faster"
    assert table.loc["c", "vs previous"] == pytest.approx(1.0, rel=0.02)
    assert table.loc["c", "verdict"] == "can't tell yet" and table.loc["c", "baseline_verdict"] == NOT_WAITED
    assert table.loc["c", "vs baseline"] == pytest.approx(2.0, rel=0.02) and table.loc["c", "baseline_low"] < 2.0
    assert table.loc["b", "baseline_verdict"] == "faster"  # the first step's two comparisons are one
    assert (table["baseline_epoch_s"] == 100.0).all()


def test_step_by_step_reads_a_failed_step_s_status_and_the_step_after_it_as_not_compared():
    samples = _samples({"a": [1.0, 1.01, 0.99], "b": [0.5, 0.51, 0.49], "c": [0.5, 0.506, 0.494]})
    samples.loc[samples["variant"] == "b", "status"] = "failed: out of memory"
    table = step_by_step(samples, ["a", "b", "c"], {"b": "a", "c": "b"}).set_index("step")
    assert table.loc["b", "verdict"] == "failed: out of memory"
    assert table.loc["c", "verdict"] == "not compared: b failed: out of memory"


def waterfall_steps(verdicts: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"model": "m", "phase": "train", "step": ["b", "c"], "vs previous": [2.0, 0.8],
                         "verdict": verdicts, "baseline_epoch_s": 10.0})


def test_waterfall_draws_one_bar_per_step_from_the_step_before():
    figure = plot_waterfall(waterfall_steps(["faster", "slower"]), ["a", "b", "c"])
    bars = figure.axes[0].patches
    assert [(b.get_y(), b.get_y() + b.get_height()) for b in bars] == [(0.0, 10.0), (10.0, 5.0), (5.0, 6.25)]
    assert bars[1].get_facecolor() != bars[2].get_facecolor()  # faster and slower differ


def test_waterfall_colours_a_step_by_the_verdict_the_rule_waited_for():
    waited = plot_waterfall(waterfall_steps(["faster", "faster"]), ["a", "b", "c"]).axes[0].patches
    not_waited = plot_waterfall(waterfall_steps(["faster", NOT_WAITED]), ["a", "b", "c"]).axes[0].patches
    assert waited[2].get_facecolor() == waited[1].get_facecolor() != not_waited[2].get_facecolor()


def test_waterfall_stops_where_a_step_has_no_speed_up():
    steps = waterfall_steps(["failed: out of memory", "can't tell yet"])  # c's ratio against b, read before b failed
    steps.loc[0, "vs previous"] = float("nan")
    assert len(plot_waterfall(steps, ["a", "b", "c"]).axes[0].patches) == 1


@pytest.mark.parametrize("name, precision, expected", [
    ("NVIDIA H200", "bf16", 989.5), ("NVIDIA H100 80GB HBM3", "tf32", 494.5), ("NVIDIA H100 PCIe", "fp16", 756.5),
    ("NVIDIA H100 NVL", "bf16", 835.5), ("NVIDIA H100 NVL", "fp32", 60.0), ("NVIDIA H100 NVL", "fp8", 1670.5),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5), ("Tesla V100-SXM2-16GB", "fp16", 125.0),
])
def test_datasheet_peaks_are_found_by_device_name(name, precision, expected):
    peak = peaks.datasheet_peak(name, precision)
    assert peak.tflops == expected and "datasheet" in peak.source


def test_a_precision_the_device_lacks_or_an_unknown_device_has_no_datasheet_peak():
    assert peaks.datasheet_peak("Tesla V100-SXM2-16GB", "bf16") is None
    assert peaks.datasheet_peak("Some Future GPU", "bf16") is None


def test_cpu_peak_is_a_measured_matmul_ceiling_and_named_so(tmp_path, monkeypatch):
    from optlab.core.results import store
    info = resolve_device("cpu")
    monkeypatch.setattr(store, "LIVE_DIR", tmp_path)
    ceilings.save(pd.DataFrame([{"ceiling": "matmul", "dtype": "fp32", "detail": "4x4x4", "value": 0.02,
                                 "device": info.name}]))
    assert peaks.precision_of(RunConfig(amp_dtype="bf16"), peaks.has_tf32(info)) == "bf16"
    assert peaks.precision_of(RunConfig(cudnn_tf32=True), peaks.has_tf32(info)) == "fp32"  # no TF32 on a CPU
    assert peaks.precision_of(RunConfig(cudnn_tf32=True), tf32=True) == "tf32"
    peak = peaks.peak_for(RunConfig(), info)
    assert peak.tflops == 0.02 and peak.source.startswith("measured MAMF")


def test_mfu_is_achieved_over_peak(monkeypatch):
    info = resolve_device("cpu")
    summary = pd.DataFrame({"model": ["resnet18"], "phase": ["train"], "variant": ["v"], "tflops": [0.01]})
    monkeypatch.setattr(peaks, "peak_for", lambda config, info: peaks.Peak("fp32", 0.04, "a made-up peak"))
    table = peaks.mfu_table(summary, {"resnet18": {"v": RunConfig().to_dict()}}, info)
    row = table.iloc[0]
    assert row["MFU %"] == pytest.approx(25.0) and row["peak source"] == "a made-up peak"


def test_learning_curves_record_loss_and_accuracy_from_the_same_start():
    stack = get_experiment("all_together").configs("resnet18", TINY)
    first = next(iter(stack))
    curves = learning_curves({first: stack[first], "again": stack[first]}, resolve_device("cpu"), steps=4,
                             eval_every=2, eval_images=16, progress=False)
    assert list(curves["step"]) == [2, 4, 2, 4]
    assert curves["test_accuracy"].between(0, 1).all() and (curves["train_loss"] > 0).all()
    by_variant = curves.set_index(["variant", "step"])
    assert by_variant.loc[(first, 4), "train_loss"] == pytest.approx(by_variant.loc[("again", 4), "train_loss"])
    assert all(math.isfinite(v) for v in curves["train_s"])


def test_learning_curves_refuse_zero_steps():
    with pytest.raises(OptlabError, match="must be positive"):
        learning_curves({"a": RunConfig()}, resolve_device("cpu"), steps=0, eval_every=1, eval_images=1)


def test_reference_mfu_uses_the_datasheet_peak_of_the_stored_machine(tmp_path, monkeypatch):
    from optlab.core.results import store
    record = {"schema_version": store.SCHEMA_VERSION, "technique": "all_together",
              "environment": {"gpu_name": "NVIDIA H200"},
              "effective_configs": {"resnet18": {"v": RunConfig(amp_dtype="bf16").to_dict()}},
              "summary": [{"model": "resnet18", "phase": "train", "variant": "v", "tflops": 98.95}]}
    (tmp_path / "h200").mkdir()
    store.atomic_write_text(tmp_path / "h200" / "all_together.json", __import__("json").dumps(record))
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path)
    row = peaks.reference_mfu().iloc[0]
    assert row["MFU %"] == pytest.approx(10.0) and "H200 SXM datasheet" in row["peak source"]
    assert math.isnan(row["MFU % of MAMF"])  # no ceilings kept with the run
    measured = pd.DataFrame([  # the run's ceilings: bf16's best matmul 791.6 TFLOP/s, fp32's 60
        {"ceiling": "matmul", "dtype": "bf16", "detail": "8192x8192x8192", "value": 791.6, "device": "cuda"},
        {"ceiling": "matmul", "dtype": "bf16", "detail": "4096x4096x4096", "value": 700.0, "device": "cuda"},
        {"ceiling": "matmul", "dtype": "fp32", "detail": "8192x8192x8192", "value": 60.0, "device": "cuda"},
        {"ceiling": "copy", "dtype": "fp32", "detail": "", "value": 4000.0, "device": "cuda"},
        {"ceiling": "launch", "dtype": "fp32", "detail": "eager: one add", "value": 5.0, "device": "cuda"}])
    ceilings.save(measured, tmp_path / "h200")
    row = peaks.reference_mfu().iloc[0]
    assert row["MFU % of MAMF"] == pytest.approx(100 * 98.95 / 791.6) and row["MFU %"] == pytest.approx(10.0)


def test_a_skipped_stack_step_is_left_out_of_every_later_variant():
    from optlab.core.techniques.cnn import all_together

    stack = all_together(skip=("+ bf16 autocast",))
    assert "+ bf16 autocast" not in stack.labels and len(stack.labels) == len(all_together().labels) - 1
    assert all(config.amp_dtype == "none" for config in stack.configs("resnet18", TINY).values())
    with pytest.raises(OptlabError, match="unknown stack step '\\+ fp8'"):
        all_together(skip=("+ fp8",))


def test_without_its_workers_step_the_cpu_stack_runs_in_lockstep_rounds():
    from optlab.core.run import experiments
    from optlab.core.techniques.cnn import COMPILE_STEP, WORKERS_STEP, all_together

    stack = all_together(skip=(WORKERS_STEP, COMPILE_STEP))
    configs = stack.configs("resnet18", TINY)
    assert WORKERS_STEP not in stack.labels and all(config.num_workers == 0 for config in configs.values())
    with_workers = all_together(skip=(COMPILE_STEP,)).configs("resnet18", TINY)
    for stacked, lockstep in ((configs, True), (with_workers, False)):
        variants = {label: object.__new__(experiments.LocalVariant) for label in stacked}
        assert experiments.lockstep_ready(variants, stacked, get_profile("smoke"), resolve_device("cpu")) == lockstep


def test_the_stack_table_shows_the_baseline_verdicts_of_a_record_whose_rule_waited_for_those():
    from optlab.book.report.tables import BASELINE_VERDICT, stack_table

    samples = _samples({"a": [1.0, 1.01, 0.99], "b": [0.5, 0.51, 0.49], "c": [0.5, 0.506, 0.494]})
    chained = stack_table(step_by_step(samples, ["a", "b", "c"], {"b": "a", "c": "b"}))
    old = stack_table(step_by_step(samples, ["a", "b", "c"], {"b": "a", "c": "a"}))
    assert BASELINE_VERDICT not in chained and list(old[BASELINE_VERDICT]) == ["faster", "faster"]
    assert list(old["verdict (vs the step before)"]) == ["faster", NOT_WAITED]
