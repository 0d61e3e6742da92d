"""The shape sweep: one row per shape, first call against later calls, the benchmark flag, fresh processes, errors."""
import os

import pytest
import torch

from optlab.studies.kernels import autotune
from optlab.core.errors import OptlabError

needs_cuda = pytest.mark.cuda
TINY = {"width": 0.125, "calls": 3}


def test_sweep_has_one_row_per_shape_in_order_with_raw_times():
    shapes = [(4, 16), (2, 24), (4, 24)]
    table = autotune.shape_sweep("resnet18", shapes, "cpu", **TINY)
    assert list(zip(table["batch"], table["image_size"])) == shapes
    assert set(table["device"]) == {"cpu"} and set(table["pid"]) == {os.getpid()}
    assert all(len(times) == TINY["calls"] for times in table["times_s"])
    assert (table["first_call_s"] >= 0).all() and (table["steady_s"] > 0).all()
    assert table["first_call_s"].tolist() == [times[0] for times in table["times_s"]]


def test_steady_time_is_the_median_of_the_later_calls(monkeypatch):
    times = iter([0.0, 3.0, 1.0, 2.0, 5.0])  # the warm-up pass, then the four calls of the one shape
    monkeypatch.setattr(autotune, "_timed_pass", lambda model, inputs, targets: next(times))
    row = autotune.shape_sweep("mobilenet_v2", [(2, 16)], "cpu", calls=4, width=0.125).iloc[0]
    assert (row["first_call_s"], row["steady_s"], row["setup_s"]) == (3.0, 2.0, 1.0)
    assert row["times_s"] == [3.0, 1.0, 2.0, 5.0]


def test_the_warm_up_and_every_shape_run_with_the_requested_flag_which_is_then_restored(monkeypatch):
    seen = []

    def fake_pass(model, inputs, targets):
        seen.append((tuple(inputs.shape), torch.backends.cudnn.benchmark))
        return 1.0

    monkeypatch.setattr(autotune, "_timed_pass", fake_pass)
    before = torch.backends.cudnn.benchmark
    table = autotune.shape_sweep("resnet18", [(3, 16)], "cpu", benchmark=not before, calls=2, width=0.125)
    assert seen == [((2, 3, 8, 8), not before), ((3, 3, 16, 16), not before), ((3, 3, 16, 16), not before)]
    assert torch.backends.cudnn.benchmark == before
    assert table["benchmark"].tolist() == [not before]


def test_compare_modes_runs_false_then_true_in_one_new_process_and_true_alone_in_another():
    table = autotune.compare_modes("resnet18", [(2, 16)], "cpu", calls=2, width=0.125)
    assert table["mode"].tolist() == list(autotune.MODES)
    assert table["benchmark"].tolist() == [False, True, True]
    first, after, fresh = table["pid"]
    assert first == after and fresh != first and os.getpid() not in (first, fresh)
    assert (table["first_call_s"] >= 0).all()


@pytest.mark.parametrize("shapes, message", [
    ([], "shapes is empty"),
    ([(4, 8)], "image size >= 16"),
    ([(0, 32)], "batch >= 1"),
    ([(4, 32.0)], "two integers"),
    ([(4, 32, 1)], "two integers"),
    ([(True, 32)], "two integers"),
    ([(4, 32), (2, 32), (4, 32)], r"\[\(4, 32\)\] appear more than once"),
])
def test_bad_shapes_say_what_is_wrong(shapes, message):
    with pytest.raises(OptlabError, match=message):
        autotune.shape_sweep("resnet18", shapes, "cpu")


def test_bad_model_and_call_count_are_refused_before_any_process_starts():
    with pytest.raises(OptlabError, match="unknown model 'resnet9'; choose one of: resnet18"):
        autotune.compare_modes("resnet9", [(2, 16)], "cpu")
    with pytest.raises(OptlabError, match="calls must be an integer >= 2"):
        autotune.compare_modes("resnet18", [(2, 16)], "cpu", calls=1)


@needs_cuda
def test_sweep_on_cuda_times_every_shape_and_restores_the_flag():
    before = torch.backends.cudnn.benchmark
    table = autotune.shape_sweep("resnet18", [(8, 32), (4, 32)], "cuda", benchmark=True, **TINY)
    assert set(table["device"]) == {"cuda"} and len(table) == 2
    assert (table["first_call_s"] > 0).all() and (table["steady_s"] > 0).all()
    assert torch.backends.cudnn.benchmark == before
