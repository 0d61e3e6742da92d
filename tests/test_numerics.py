"""Precision numerics: the variants compared, the errors measured, fp16's loss-scale back-off, the stored table."""
from dataclasses import replace

import pandas as pd
import pytest
import torch
from torch import nn

from optlab.studies.kernels import numerics
from optlab.core.results import store
from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import DeviceInfo, resolve_device
from optlab.core.errors import OptlabError
from optlab.studies.limits.peaks import has_tf32
from tests.helpers import TINY

needs_cuda = pytest.mark.cuda
SMALL = replace(TINY, batch_size=4)
FAKE_GPU = DeviceInfo(torch.device("cuda"), "fake gpu", ("none", "fp16", "bf16"))  # effective_config only reads it


def test_cpu_leaves_tf32_out_with_a_note_and_keeps_the_rest():
    reference, variants, notes = numerics.variant_configs("resnet18", TINY, resolve_device("cpu"))
    assert list(variants) == [numerics.REPEAT_LABEL, "fp16 autocast", "bf16 autocast"]
    assert variants[numerics.REPEAT_LABEL] == reference and not reference.matmul_tf32
    assert [c.amp_dtype for c in variants.values()] == ["none", "fp16", "bf16"]
    assert len(notes) == 2 and notes[0].startswith("fp32 with TF32: left out on cpu") and "tensor-core" in notes[0]
    assert notes[1].startswith("fp16 autocast, fused SGD: left out, it computes what fp16 autocast computes")


def test_cuda_compares_tf32_on_both_switches_and_each_alone():
    reference, variants, notes = numerics.variant_configs("resnet18", TINY, FAKE_GPU)
    assert [note.split(":")[0] for note in notes] == ["fp16 autocast, fused SGD"]  # an optimizer kernel, not a precision
    assert (reference.matmul_tf32, reference.cudnn_tf32) == (False, False)
    switches = {label: (c.matmul_tf32, c.cudnn_tf32) for label, c in variants.items() if c.amp_dtype == "none"}
    assert switches == {numerics.REPEAT_LABEL: (False, False), "fp32 with TF32": (True, True),
                        "TF32 matmul only": (True, False), "TF32 cuDNN only": (False, True)}


def test_errors_against_fp32_on_the_cpu():
    result = numerics.precision_numerics(profile=SMALL, device="cpu", steps=1)
    table = result.table.set_index("variant")
    assert list(table.index) == [numerics.YARDSTICK_LABEL, numerics.REPEAT_LABEL, "fp16 autocast", "bf16 autocast"]
    assert len(result.notes) == 2
    again, fp64 = table.loc[numerics.REPEAT_LABEL], table.loc[numerics.YARDSTICK_LABEL]
    assert again["logits_rel_err"] == 0 and again["grad_rel_err"] == 0 and again["grad_cosine"] == pytest.approx(1)
    assert 0 < fp64["logits_rel_err"] < 1e-5 and pd.isna(fp64["drift"])  # fp32 itself: about 1e-7 per operation
    half = table.loc[["fp16 autocast", "bf16 autocast"]]
    assert half["finite"].all() and (half["logits_rel_err"] > 100 * fp64["logits_rel_err"]).all()
    assert (half["logits_rel_err"] < 0.1).all()
    assert table.loc["bf16 autocast", "logits_rel_err"] > table.loc["fp16 autocast", "logits_rel_err"]  # 8 vs 11 bits
    assert (half["grad_cosine"] > 0.8).all() and (half["drift"] >= 0).all()
    assert table.loc["bf16 autocast", "loss_scale"] == 1.0 and table.loc["fp16 autocast", "loss_scale"] > 1


def test_fp16_halves_the_loss_scale_until_the_gradients_are_finite():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 10))
    nn.init.normal_(model[1].weight, std=100.0)  # the loss scale 65536 times these weights overflows fp16 in backward
    inputs, targets = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    config = RunConfig(amp_dtype="fp16")
    _, _, grads, scale = numerics.forward_backward(model, inputs, targets, config, torch.device("cpu"))
    _, _, exact, _ = numerics.forward_backward(model, inputs, targets, RunConfig(), torch.device("cpu"))
    assert 1 <= scale < 65536 and torch.isfinite(grads).all()
    assert torch.nn.functional.cosine_similarity(grads, exact, dim=0) > 0.99


def test_bad_steps_are_refused():
    with pytest.raises(OptlabError, match="steps must be an integer >= 1, got 0"):
        numerics.precision_numerics(profile=TINY, device="cpu", steps=0)


def test_run_reference_saves_the_table_where_the_book_reads_it(tmp_path, monkeypatch):
    table = pd.DataFrame({"model": ["resnet18"], "variant": ["bf16 autocast"], "logits_rel_err": [0.01]})
    monkeypatch.setattr(numerics, "precision_numerics", lambda **kwargs: numerics.NumericsResult(table, []))
    paths = numerics.run_reference(tmp_path / "gpu", device="cpu")
    assert paths == [tmp_path / "gpu" / "precision_numerics.csv"]
    stored = store.reference_tables("precision_numerics", tmp_path)
    pd.testing.assert_frame_equal(stored, table.assign(machine="gpu"))


@needs_cuda
def test_tf32_rows_on_cuda():
    table = numerics.precision_numerics(profile=SMALL, device="cuda", steps=1).table.set_index("variant")
    assert {"fp32 with TF32", "TF32 matmul only", "TF32 cuDNN only", "fp16 autocast"} <= set(table.index)
    assert table["finite"].all() and (table["grad_cosine"] > 0.8).all()
    if has_tf32(resolve_device("cuda")):
        assert table.loc["TF32 cuDNN only", "logits_rel_err"] > table.loc[numerics.REPEAT_LABEL, "logits_rel_err"]
