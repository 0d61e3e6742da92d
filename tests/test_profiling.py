"""The profiled breakdown: interval arithmetic, trace events, the profiled loop and trace, the data chapter's sizing."""
import gzip
import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

from optlab.studies import pipeline, profiling
from optlab.core.knobs.config import RunConfig
from optlab.core.cifar.device_data import DeviceResidentLoader
from optlab.core.errors import OptlabError
from optlab.core.techniques.registry import get_experiment
from optlab.studies.profiling import Span
from tests.helpers import TINY

TINY_CONFIG = RunConfig(model="resnet18", width=TINY.width, batch_size=TINY.batch_size, num_workers=0, pin_memory=False)
cuda_only = pytest.mark.cuda


def test_covered_counts_overlaps_once_and_clips_to_the_window():
    assert profiling.covered_us([(0, 10), (5, 15), (20, 30)], 0, 100) == 25
    assert profiling.covered_us([(0, 50), (10, 20)], 0, 100) == 50  # nested
    assert profiling.covered_us([(-10, 10), (90, 120)], 0, 100) == 20  # clipped at both ends
    assert profiling.covered_us([(100, 120)], 0, 100) == 0


@pytest.mark.parametrize("name, category, kind", [
    ("ProfilerStep#7", "user_annotation", "step"), ("ProfilerStep#7", "gpu_user_annotation", None),
    ("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", "user_annotation", "data"),
    ("enumerate(DeviceResidentLoader)#__next__", "user_annotation", "data"),
    ("cudaLaunchKernel", "cuda_runtime", "launch"), ("cuLaunchKernelEx", "cuda_driver", "launch"),
    ("cudaGraphLaunch", "cuda_runtime", "launch"), ("cudaMemcpyAsync", "cuda_runtime", "launch"),
    ("cudaStreamSynchronize", "cuda_runtime", "sync"), ("cudaMemcpy", "cuda_runtime", "sync"),
    ("aten::conv2d", "cpu_op", None), ("void cudnn::conv_kernel<float>", "kernel", "device"),
    ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", "device"), ("Memset (Device)", "gpu_memset", "device"),
])
def test_classify(name, category, kind):
    assert profiling.classify(name, category) == kind


def test_spans_from_trace_reads_complete_events_only():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 10.0, "dur": 5.5},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 11, "dur": 2},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 11, "dur": 1},
        {"ph": "f", "cat": "ac2g", "name": "cudaLaunchKernel", "ts": 12},
        {"ph": "M", "name": "process_name"},
    ]}
    assert profiling.spans_from_trace(trace) == [Span("step", 10.0, 15.5), Span("device", 11.0, 13.0)]


def test_step_breakdown_of_a_gpu_profile():
    spans = [Span("step", 0, 100), Span("step", 100, 200),
             Span("data", 0, 30), Span("launch", 20, 40), Span("launch", 50, 60), Span("sync", 80, 100),
             Span("device", 10, 50), Span("device", 40, 70), Span("device", 95, 110),
             Span("data", 100, 105), Span("launch", 150, 160), Span("sync", 155, 165), Span("device", 190, 230)]
    steps = profiling.step_breakdown(spans, device_intervals=True)
    expected = {"wall_ms": [0.1, 0.1], "data_wait_ms": [0.03, 0.005], "launch_ms": [0.02, 0.01],
                "sync_ms": [0.02, 0.005], "cpu_other_ms": [0.03, 0.08], "device_busy_ms": [0.065, 0.02]}
    for column, values in expected.items():
        assert steps[column].tolist() == pytest.approx(values), column


def _event(name, category, start, duration):
    return {"ph": "X", "cat": category, "name": name, "ts": start, "dur": duration}


def test_parts_of_a_trace_whose_ranges_overlap_on_purpose():
    """From trace events to parts, each range overlapping another: a copy's sync inside the loader's range, a launch
    and a sync that start before the previous one ends, a launch inside the device-resident loader's range, device
    work across the step boundary, and ranges the breakdown must not count (CPU ops, the GPU's copy of the steps)."""
    trace = {"traceEvents": [
        _event("ProfilerStep#1", "user_annotation", 1000, 100), _event("ProfilerStep#2", "user_annotation", 1100, 60),
        _event("ProfilerStep#1", "gpu_user_annotation", 1000, 100), _event("aten::conv2d", "cpu_op", 1000, 160),
        _event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", 1000, 30),
        _event("cudaMemcpy", "cuda_runtime", 1010, 10),  # inside the data wait: data, not sync
        _event("cudaLaunchKernel", "cuda_runtime", 1025, 10),  # 5 us of it after the data wait
        _event("cudaStreamSynchronize", "cuda_runtime", 1032, 18),  # 15 us of it after the launch
        _event("cudaLaunchKernel", "cuda_runtime", 1060, 10),
        _event("gemm", "kernel", 1040, 80), _event("Memcpy HtoD", "gpu_memcpy", 1030, 20),  # union 1030-1120
        {"ph": "f", "cat": "ac2g", "name": "cudaLaunchKernel", "ts": 1061},
        _event("enumerate(DeviceResidentLoader)#__next__", "user_annotation", 1100, 10),
        _event("cuLaunchKernel", "cuda_driver", 1102, 2),  # the loader's own launch: data
        _event("cudaLaunchKernel", "cuda_runtime", 1105, 10),  # 5 us of it after the data wait
        _event("cudaDeviceSynchronize", "cuda_runtime", 1150, 20),  # the last step ends at 1160
        _event("Memset (Device)", "gpu_memset", 1110, 5),
    ]}
    steps = profiling.step_breakdown(profiling.spans_from_trace(trace), device_intervals=True)
    expected = {"wall_ms": [0.1, 0.06], "data_wait_ms": [0.03, 0.01], "launch_ms": [0.015, 0.005],
                "sync_ms": [0.015, 0.01], "cpu_other_ms": [0.04, 0.035], "device_busy_ms": [0.07, 0.02]}
    pd.testing.assert_frame_equal(steps[list(expected)], pd.DataFrame(expected))


def _data_wait_per_step_us(events: list[dict]) -> list[float]:
    """Each recorded step's data wait summed straight from the trace's loader ranges: they run one after another on
    the training thread, so their plain sum is their union."""
    on_cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    starts = sorted(e["ts"] for e in on_cpu if e["name"].startswith("ProfilerStep#"))
    loads = [e for e in on_cpu if e["name"].startswith(profiling.DATA_RANGE)]
    return [sum(e["dur"] for e in loads if start <= e["ts"] < end)
            for start, end in zip(starts, starts[1:] + [math.inf])]


def test_step_breakdown_without_device_intervals_and_without_steps():
    steps = profiling.step_breakdown([Span("step", 0, 10), Span("device", 0, 5)], device_intervals=False)
    assert math.isnan(steps["device_busy_ms"].iloc[0])
    with pytest.raises(OptlabError, match="no ProfilerStep ranges"):
        profiling.step_breakdown([Span("data", 0, 5)], device_intervals=False)


def test_summary_row_means_add_up_and_shares():
    steps = profiling.step_breakdown([Span("step", 0, 100), Span("step", 100, 300), Span("data", 0, 50),
                                      Span("device", 100, 200)], device_intervals=True)
    row = profiling.summary_row(steps, "a", TINY_CONFIG, "test gpu", profiling.UNION).iloc[0]
    assert row["wall_ms"] == pytest.approx(0.15) and row["data_wait_ms"] == pytest.approx(0.025)
    assert row["device_busy_share"] == pytest.approx(0.05 / 0.15)
    assert row["steps"] == 2 and row["wall_iqr_ms"] == pytest.approx(0.05)


def _average(key, device, cpu_us, device_us, count=4):
    return SimpleNamespace(key=key, count=count, device_type=device, self_cpu_time_total=cpu_us,
                           self_device_time_total=device_us)


def test_top_ops_picks_kernels_on_a_gpu_and_cpu_ops_otherwise():
    averages = [_average("ProfilerStep*", DeviceType.CPU, 900, 0), _average("aten::mm", DeviceType.CPU, 300, 50),
                _average("aten::add_", DeviceType.CPU, 500, 0), _average("gemm_kernel", DeviceType.CUDA, 0, 400),
                _average("elementwise_kernel", DeviceType.CUDA, 0, 800)]
    gpu = profiling.top_table(averages, on_device=True, steps=2, wall_ms=1.0)
    assert gpu["op"].tolist() == ["elementwise_kernel", "gemm_kernel"]
    assert gpu["self_ms_per_step"].tolist() == pytest.approx([0.4, 0.2]) and gpu["calls_per_step"].iloc[0] == 2
    assert (gpu["measure"] == "self device time").all() and gpu["share_of_wall"].iloc[0] == pytest.approx(0.4)
    cpu = profiling.top_table(averages, on_device=False, steps=2, wall_ms=1.0, limit=1)
    assert cpu["op"].tolist() == ["aten::add_"] and cpu["measure"].iloc[0] == "self CPU time"


def _data_spans(loader, count, path):
    stream = profiling.batches(loader)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(count):
            next(stream)
    prof.export_chrome_trace(str(path))
    return [s for s in profiling.spans_from_trace(profiling.read_trace(path)) if s.kind == "data"]


def test_every_loader_shows_one_data_range_per_batch(tmp_path):
    dataset = SimpleNamespace(data=np.zeros((32, 32, 32, 3), dtype=np.uint8), targets=list(range(32)))
    resident = DeviceResidentLoader(dataset, 8, torch.device("cpu"), train=True)
    assert len(_data_spans(resident, 3, tmp_path / "resident.json")) == 3
    assert len(_data_spans(DataLoader(TensorDataset(torch.zeros(32, 2)), batch_size=8), 3, tmp_path / "dl.json")) == 3


def test_profile_training_on_cpu(tmp_path):
    trace = tmp_path / "traces" / "tiny.json.gz"
    result = profiling.profile_training(TINY_CONFIG, device="cpu", steps=2, warmup=1, trace=trace, label="tiny")
    steps = result.steps
    assert len(steps) == 2 and (steps["data_wait_ms"] > 0).all(), "the DataLoader's __next__ ranges were not found"
    assert (steps[["launch_ms", "sync_ms"]] == 0).all().all(), "CUDA calls counted on a CPU"
    row = result.breakdown.iloc[0]
    assert row["config"] == "tiny" and row["device_busy_method"] == profiling.NO_GPU
    assert math.isnan(row["device_busy_ms"])
    top = result.top_ops()
    assert top["self_ms_per_step"].is_monotonic_decreasing and (top["measure"] == "self CPU time").all()
    assert any("conv" in op for op in top["op"]) and not top["op"].str.startswith("ProfilerStep").any()
    with gzip.open(trace, "rt") as handle:  # a gzipped JSON trace, as Perfetto and chrome://tracing read it
        events = json.load(handle)["traceEvents"]
    assert (steps["data_wait_ms"] * 1e3).tolist() == pytest.approx(_data_wait_per_step_us(events))


def test_profile_training_rejects_bad_sizes_and_trace_names():
    with pytest.raises(OptlabError, match="steps must be an integer >= 1, got 0"):
        profiling.profile_training(TINY_CONFIG, device="cpu", steps=0)
    with pytest.raises(OptlabError, match=r"trace 'profile.txt' must end with one of: \.json, \.json\.gz"):
        profiling.profile_training(TINY_CONFIG, device="cpu", trace="profile.txt")


def test_before_and_after_are_the_ends_of_the_all_together_stack():
    configs = profiling.before_after("resnet18", TINY)
    stack = list(get_experiment("all_together").configs("resnet18", TINY).values())
    assert configs == {"before": stack[0], "after": stack[-1]}
    assert configs["after"].compile_mode == "default" and configs["after"].data_on_device


def test_with_workers_resizes_and_relabels_only_the_loader_variants():
    sized = pipeline.with_workers(get_experiment("data_pipeline"), 2)
    assert sized.labels == ["2 workers", "2 persistent workers, prefetch 4", "data on device"]
    configs = sized.configs("resnet18", TINY)
    assert [c.num_workers for c in configs.values()] == [2, 2, 0]
    assert configs["2 persistent workers, prefetch 4"].persistent_workers and configs["data on device"].data_on_device
    unnamed = get_experiment("data_pipeline").with_variants(("loader", {"num_workers": 4}),
                                                            ("main", {"num_workers": 0}))
    assert pipeline.with_workers(unnamed, 2).labels == ["loader (2 workers)", "main"]
    with pytest.raises(OptlabError, match="workers must be an integer >= 1, got 0"):
        pipeline.with_workers(sized, 0)


def test_starvation_has_one_row_per_variant():
    experiment = get_experiment("data_pipeline").with_variants(
        ("main process", {"num_workers": 0, "pin_memory": False}), ("1 worker", {"num_workers": 1}))
    frame = pipeline.starvation(experiment, device="cpu", profile=TINY)
    assert frame["config"].tolist() == ["main process", "1 worker"]
    assert (frame["data_wait_share"].between(0, 1)).all() and frame["device_busy_share"].isna().all()


@cuda_only
@pytest.mark.parametrize("on_device", [False, True])
def test_profile_training_on_cuda(on_device):
    config = RunConfig(model="resnet18", width=0.25, batch_size=32, num_workers=0, pin_memory=False,
                       data_on_device=on_device)
    result = profiling.profile_training(config, device="cuda", steps=3, warmup=2)
    row = result.breakdown.iloc[0]
    assert row["device_busy_method"] == profiling.UNION
    assert 0 < row["device_busy_ms"] <= row["wall_ms"] * 1.001 and row["launch_ms"] > 0
    assert (result.steps["data_wait_ms"] > 0).all()
    top = result.top_ops()
    assert (top["measure"] == "self device time").all() and len(top) > 0


def _fake_profiles(requested: dict):
    """Stand-ins for profile_configs: a real breakdown of made-up spans, and made-up kernel averages."""
    def fake(configs, device="auto", *args, **kwargs):
        requested.update(configs)
        steps = profiling.step_breakdown([Span("step", 0, 100), Span("device", 0, 60)], device_intervals=True)
        kernels = SimpleNamespace(key_averages=lambda: [_average("gemm_kernel", DeviceType.CUDA, 0, 50)])
        return {label: profiling.ProfileResult(
            label, config, "fake gpu", steps, profiling.summary_row(steps, label, config, "fake gpu", profiling.UNION),
            None, [], kernels) for label, config in configs.items()}
    return fake


def test_run_reference_profiles_the_quick_size_and_saves_named_tables(tmp_path, monkeypatch):
    requested = {}
    monkeypatch.setattr(profiling, "profile_configs", _fake_profiles(requested))
    monkeypatch.setattr(pipeline, "profile_configs", _fake_profiles(requested))
    paths = profiling.run_reference(tmp_path, "cpu") + pipeline.run_reference(tmp_path, "cpu")
    assert [p.name for p in paths] == ["profiling-breakdown.csv", "profiling-top-ops.csv",
                                       "data-pipeline-breakdown.csv"]
    assert {(c.batch_size, c.width) for c in requested.values()} == {(128, 1.0)}
    assert requested["after"].compile_mode == "default" and requested["4 workers"].num_workers == 4
    tables = {p.stem: pd.read_csv(p) for p in paths}
    assert tables["profiling-breakdown"]["config"].tolist() == ["before", "after"]
    assert tables["profiling-top-ops"]["op"].tolist() == ["gemm_kernel"] * 2
    assert tables["data-pipeline-breakdown"]["config"].tolist() == get_experiment("data_pipeline").labels
    assert (tables["data-pipeline-breakdown"]["device_busy_share"] == 0.6).all()

def test_trace_names_are_safe_file_names():
    assert profiling.trace_name("after") == "profile-after.json.gz"
    assert profiling.trace_name("4 persistent workers, prefetch 4") == "profile-4-persistent-workers-prefetch-4.json.gz"


def test_device_measure_says_how_device_time_was_measured():
    never = lambda: pytest.fail("kernel durations read although intervals exist")  # noqa: E731
    assert profiling.device_measure(True, True, never, 5) == (profiling.UNION, None)
    method, busy = profiling.device_measure(False, False, never, 5)
    assert method == profiling.NO_GPU and math.isnan(busy)
    assert profiling.device_measure(False, True, lambda: 2000.0, 4) == (profiling.KERNEL_SUM, 0.5)
    method, busy = profiling.device_measure(False, True, lambda: 0.0, 4)
    assert method == profiling.NO_DEVICE_EVENTS and math.isnan(busy)
