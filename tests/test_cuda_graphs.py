"""CUDA graphs by hand: the eager sweep and input checks on any machine, capture and replay where CUDA exists."""
import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from optlab.studies.kernels import cuda_graphs
from optlab.book import report
from optlab.core.results import store
from optlab.core.machine.device import DeviceInfo
from optlab.core.errors import OptlabError
from optlab.core.measuring.loops import make_optimizer
from optlab.core.cifar.models import build_model

needs_cuda = pytest.mark.cuda
FAKE_GPU = DeviceInfo(torch.device("cuda", 0), "fake gpu", ("none", "fp16", "bf16"))  # run_reference reads is_cuda
TINY_WIDTH = 0.125


@pytest.fixture(scope="module")
def cpu_sweep() -> pd.DataFrame:
    return cuda_graphs.sweep("resnet18", TINY_WIDTH, batch_sizes=(1, 8), device="cpu", min_run_time=0.01)


def test_cpu_sweep_times_eager_steps_only(cpu_sweep):
    assert set(cpu_sweep["execution"]) == {"eager"}
    assert sorted(zip(cpu_sweep["mode"], cpu_sweep["batch_size"])) == [
        ("inference", 1), ("inference", 8), ("training", 1), ("training", 8)]
    assert (cpu_sweep["median_s"] > 0).all() and (cpu_sweep["blocks"] >= 2).all()  # an IQR needs blocks


def test_a_step_slower_than_the_time_allowed_still_gets_two_blocks():
    """A machine slow enough that one block spends ``max_run_time`` still gives an interquartile range."""
    import time
    calls = []
    step = lambda inputs, targets: calls.append(time.sleep(0.02))  # noqa: E731
    measurement = cuda_graphs._time_step(step, [(None, None)], min_run_time=0.001, max_run_time=0.001)
    assert len(measurement.times) >= cuda_graphs.MIN_BLOCKS and measurement.median >= 0.02
    assert len(calls) >= cuda_graphs.WARMUP_ITERS + cuda_graphs.MIN_BLOCKS


def test_sweep_rates_come_from_the_timers_median(monkeypatch):
    fake = SimpleNamespace(median=0.004, iqr=0.001, times=[0.003, 0.004, 0.005])
    monkeypatch.setattr(cuda_graphs, "_time_step", lambda *args: fake)
    frame = cuda_graphs.sweep("resnet18", TINY_WIDTH, batch_sizes=(1, 8), device="cpu").set_index(["mode", "batch_size"])
    assert frame.loc[("training", 8), "per_image_us"] == pytest.approx(500.0)
    assert frame.loc[("inference", 1), "per_image_us"] == pytest.approx(4000.0)
    assert frame.loc[("training", 8), "median_s"] == 0.004


def test_sweep_table_leaves_graphed_columns_empty_without_a_gpu(cpu_sweep):
    table = cuda_graphs.sweep_table(cpu_sweep)
    assert table[("step_ms", "CUDA graph")].isna().all() and table[("graph speed-up", "")].isna().all()
    assert table[("step_ms", "eager")].notna().all()


def test_sweep_table_speed_up_is_eager_over_graphed():
    frame = pd.DataFrame([
        {"mode": "inference", "batch_size": 1, "execution": "eager", "median_s": 0.004, "iqr_s": 0.0,
         "per_image_us": 4000.0},
        {"mode": "inference", "batch_size": 1, "execution": "CUDA graph", "median_s": 0.001, "iqr_s": 0.0,
         "per_image_us": 1000.0},
    ])
    table = cuda_graphs.sweep_table(frame)
    assert table.loc[("inference", 1), ("graph speed-up", "")] == pytest.approx(4.0)


def test_plot_sweep_draws_step_and_image_panels_per_mode(cpu_sweep):
    grid = report.plot_sweep(cpu_sweep)
    assert grid.axes.shape == (2, 2) and all(ax.get_xscale() == "log" for ax in grid.axes.flat)


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_sizes": (0, 4)}, "batch_sizes must be a non-empty list of positive integers"),
    ({"modes": ("train",)}, "unknown sweep mode 'train'; choose one of: inference, training"),
    ({"model": "vgg16"}, "unknown model 'vgg16'"),
])
def test_sweep_rejects_bad_input(kwargs, message):
    with pytest.raises(OptlabError, match=message):
        cuda_graphs.sweep(**{"device": "cpu", **kwargs})


def test_capture_refuses_what_cannot_be_captured():
    model = build_model("resnet18", width=TINY_WIDTH)
    inputs, targets = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    with pytest.raises(OptlabError, match="needs model.eval"):
        cuda_graphs.capture_inference(model.train(), inputs)
    with pytest.raises(OptlabError, match="needs tensors on a CUDA device, got cpu"):
        cuda_graphs.capture_inference(model.eval(), inputs)
    with pytest.raises(OptlabError, match="needs tensors on a CUDA device"):
        cuda_graphs.capture_training(model, make_optimizer(model), inputs, targets)
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(OptlabError, match="Adam must be built with capturable=True"):
        cuda_graphs.capture_training(model, adam, inputs, targets)
    used = make_optimizer(model)
    cuda_graphs.eager_training(model, used)(inputs, targets)
    with pytest.raises(OptlabError, match="needs a fresh optimizer"):
        cuda_graphs.capture_training(model, used, inputs, targets)


def test_eager_training_step_trains():
    torch.manual_seed(0)
    model = build_model("resnet18", width=TINY_WIDTH)
    step = cuda_graphs.eager_training(model, torch.optim.SGD(model.parameters(), lr=0.05))
    inputs, targets = torch.randn(8, 3, 32, 32), torch.arange(8) % 10
    losses = [float(step(inputs, targets)) for _ in range(5)]
    assert losses[-1] < losses[0]


def test_gpu_only_entry_points_say_so_on_cpu(tmp_path, no_cuda):
    with pytest.raises(OptlabError, match="needs a CUDA device"):
        cuda_graphs.agreement(device="cpu")
    with pytest.raises(OptlabError, match="needs a CUDA device"):
        cuda_graphs.run_reference(tmp_path, device="cpu")


@needs_cuda
def test_graphed_inference_and_training_match_eager():
    agreement = cuda_graphs.agreement("resnet18", TINY_WIDTH, batch_size=4, steps=3)
    assert len(agreement) == 4 and (agreement["abs_diff"] <= agreement["tolerance"]).all(), agreement
    losses = agreement[agreement["what"] == "training loss"]
    assert losses["graphed"].nunique() == 3  # every replay trained on new data: three different losses


@needs_cuda
def test_graphed_training_updates_the_weights_and_replays_new_data():
    torch.manual_seed(0)
    model = build_model("resnet18", width=TINY_WIDTH).cuda()
    before = [p.detach().clone() for p in model.parameters()]
    inputs, targets = torch.randn(4, 3, 32, 32, device="cuda"), torch.arange(4, device="cuda")
    step = cuda_graphs.capture_training(model, make_optimizer(model), inputs, targets)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the warm-up steps were undone
    step(inputs, targets)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@needs_cuda
def test_gpu_sweep_times_eager_and_graphed_steps():
    frame = cuda_graphs.sweep("resnet18", TINY_WIDTH, batch_sizes=(1, 2), device="cuda", min_run_time=0.01,
                              max_run_time=0.05)
    assert set(frame["execution"]) == set(cuda_graphs.EXECUTIONS) and len(frame) == 8
    assert not math.isnan(cuda_graphs.sweep_table(frame)[("graph speed-up", "")].iloc[0])


def test_run_reference_saves_the_sweep_where_the_chapter_reads_it(tmp_path, monkeypatch):
    """The reference run's save and read-back, on any machine: the device is faked and the sweep made up."""
    frame = pd.DataFrame([
        {"device": "fake gpu", "model": "resnet18", "width": 1.0, "mode": mode, "batch_size": 1, "execution": execution,
         "median_s": median_s, "iqr_s": 0.0001, "blocks": 5, "per_image_us": 1e6 * median_s}
        for mode in cuda_graphs.MODES for execution, median_s in zip(cuda_graphs.EXECUTIONS, (0.004, 0.001))])
    asked = []
    monkeypatch.setattr(cuda_graphs, "resolve_device", lambda device: FAKE_GPU)
    monkeypatch.setattr(cuda_graphs, "sweep", lambda model, width, **kwargs: asked.append((model, width)) or frame)
    paths = cuda_graphs.run_reference(tmp_path / "h200", device="cuda")
    assert paths == [tmp_path / "h200" / f"{cuda_graphs.REFERENCE_TABLE}.csv"] and asked == [("resnet18", 1.0)]
    stored = store.reference_tables(cuda_graphs.REFERENCE_TABLE, tmp_path)
    pd.testing.assert_frame_equal(stored, frame.assign(machine="h200"))
    assert cuda_graphs.sweep_table(stored)[("graph speed-up", "")].tolist() == pytest.approx([4.0, 4.0])


def test_reference_note_names_the_set_that_measures_the_technique(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path)
    assert "`python -m optlab reference --set compile`" in report.reference_note("cuda_graphs")
    assert "`python -m optlab reference --set beyond`" in report.reference_note("precision")
