"""``optlab tune --inference``: the inference stack on a model optlab does not know, the output check, the batch-size
sweep with its out-of-memory point and plateau, and every bad input as one line."""
import json
import math
import time
import warnings

import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import optlab
from optlab.commands.cli import main
from optlab.core.machine import compiler, machine_load
from optlab.core.errors import OptlabError
from optlab.core.results.store import load_samples
from optlab.studies.tune import batch_sweep, inference, inputs, training as tune_module
from optlab.core.measuring.memory import is_out_of_memory
from optlab.studies.tune.batch_sweep import SweepTarget, doubling_series, sweep
from optlab.studies.tune.output_check import output_change, within_tolerance
from optlab.studies.tune.inference import (
    AUTOCAST, CHANNELS_LAST, COMPILE, CUDA_GRAPHS, INFERENCE_MODE, STEP_LABELS, code_lines,
)
from tests.helpers import TINY

NO_COMPILE = [label for label in STEP_LABELS if label not in (COMPILE, CUDA_GRAPHS)]


class TinyCNN(nn.Module):
    """A convnet with batch norm and dropout (eval mode matters): 3x8x8 images, 4 classes."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5))
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.features(x))


class DictModel(nn.Module):
    """Returns a dict, as many Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 4)

    def forward(self, x):
        return {"logits": self.body(x), "hidden": x}


class DictWithoutLogits(nn.Module):
    """Returns a dict of two tensors, neither named logits: which one to compare is the reader's to say."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 4)

    def forward(self, x):
        return {"scores": self.body(x), "hidden": x}


def logits(output):
    return output["logits"]


class SlowWithAutograd(nn.Module):
    """3 ms slower with autograd on (so inference_mode is clearly faster), and under inference_mode its outputs move by
    ``shift`` of their scale: a step that is faster and, with a shift, changes the outputs."""

    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        self.body, self.shift = nn.Linear(12, 4), shift

    def forward(self, x):
        out = self.body(x)
        if torch.is_grad_enabled():
            time.sleep(0.003)
        elif torch.is_inference_mode_enabled():
            out = out + self.shift * out.abs().amax(dim=1, keepdim=True)
        return out


class OutOfMemoryAbove8(nn.Module):
    """A forward that runs out of memory above 8 samples a batch (``error`` is what the device raises)."""

    def __init__(self, error: type = torch.OutOfMemoryError) -> None:
        super().__init__()
        self.body, self.error = nn.Linear(12, 4), error

    def forward(self, x):
        if len(x) > 8:
            raise self.error("CUDA out of memory. Tried to allocate 1 PiB" if self.error is torch.OutOfMemoryError
                             else "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory")
        return self.body(x)


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))


def quick(model_fn, **options):
    options = {"input_shape": (12,), "max_batch": 8, "request_seconds": 0.05, **options}
    return optlab.tune(model_fn, inference=True, profile=TINY, device="cpu", progress=False, **options)


@pytest.fixture(scope="module")
def cnn_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune-inference")
    return quick(TinyCNN, input_shape=(3, 8, 8), num_classes=4, techniques=NO_COMPILE, max_batch=16, out=out,
                 request_batches=[8, 1]), out


def test_every_step_has_a_row_with_its_precision_and_output_check(cnn_result):
    result, _ = cnn_result
    table = result.steps.set_index("step")
    assert list(table.index) == list(STEP_LABELS)
    measured = table[table["decision"] != "skipped"]
    native = optlab.core.machine.device.native_bf16(optlab.resolve_device("cpu")) or \
        optlab.core.machine.device.native_fp16(optlab.resolve_device("cpu"))
    assert set(measured.index) == {INFERENCE_MODE, CHANNELS_LAST} | ({AUTOCAST} if native else set())
    assert set(measured["decision"]) <= {"kept", "not kept", "not kept: outputs changed"}
    assert (measured["speedup"] > 0).all() and (measured["max_error"] >= 0).all()
    assert (measured["top1_agreement"] <= 1).all() and (measured["first_call_s"] >= 0).all()
    assert table.loc[INFERENCE_MODE, "precision"] == "fp32" and table.loc[INFERENCE_MODE, "tolerance"] == 1e-4
    assert table.loc[COMPILE, "reason"] == "not among the techniques asked for"
    assert table.loc[CUDA_GRAPHS, "reason"] == "not among the techniques asked for"
    assert {"precision", "max error", "tolerance", "top-1", "first call s"} <= set(result.table().columns)


def test_the_comparisons_are_the_training_tunes_samples_and_summaries(cnn_result):
    result, _ = cnn_result
    ok = result.samples[result.samples["status"] == "ok"]
    assert set(ok["phase"]) == {"test"} and (ok["steps"] == TINY.steps).all()
    assert ok.groupby(["comparison", "variant"]).size().eq(TINY.repeats).all()
    assert {"speedup", "ci_low", "ci_high", "verdict", "comparison"} <= set(result.summary)
    measured = list(result.steps.dropna(subset=["speedup"])["step"])
    assert list(result.speedups()["step"]) == measured + ([inference.AFRESH] if result.kept else [])


def test_the_sweep_doubles_the_batch_for_both_configurations(cnn_result):
    result, _ = cnn_result
    sweep_rows = result.sweep
    assert set(sweep_rows["config"]) == set(result.sweep_ends) and "starting point" in result.sweep_ends
    for label, rows in sweep_rows.groupby("config"):
        assert list(rows["batch"]) == doubling_series(16)[:len(rows)]
        ok = rows[rows["status"] == "ok"]
        assert (ok["call_ms"] > 0).all()
        assert list(ok["samples_per_s"]) == pytest.approx(list(ok["batch"] / ok["call_ms"] * 1e3))
        assert (ok["calls"] >= batch_sweep.MIN_CALLS).all()
    assert "throughput across batch sizes, starting point: " in result.describe()
    assert "model.eval()" in result.describe()


def test_request_latency_is_timed_one_request_at_a_time_at_the_batch_sizes_asked_for(cnn_result):
    result, _ = cnn_result
    latency = result.latency
    assert set(latency["config"]) == set(result.sweep_ends)
    for _, rows in latency.groupby("config"):
        assert list(rows["batch"]) == [1, 8] and (rows["status"] == "ok").all()
    assert (latency["requests"] >= batch_sweep.MIN_REQUESTS).all() and (latency["seconds"] >= 0.05).all()
    assert (latency["p50_ms"] <= latency["p90_ms"]).all() and (latency["p90_ms"] <= latency["p99_ms"]).all()
    assert (latency["iqr_ms"] >= 0).all()
    assert {"request p50 ms", "request p90 ms", "request p99 ms", "spread (IQR) ms"} <= set(result.latency_table())
    assert "request latency at batch 1, starting point: p50 " in result.describe()


def test_the_record_keeps_device_state_data_and_sweep(cnn_result):
    result, out = cnn_result
    (path,) = out.glob("tune-inference-*.json")
    record = json.loads(path.read_text())
    assert record["technique"] == "tune-inference" and len(record["steps"]) == len(STEP_LABELS)
    assert "synthetic inputs" in record["environment"]["data_source"]
    assert record["device_state"]["torch_threads"] >= 1 and record["output_tolerance"]["16-bit"] == 0.05
    assert len(record["sweep"]["rows"]) == len(result.sweep) and record["sweep"]["ends"] == result.sweep_ends
    assert set(load_samples(path)["comparison"]) == set(result.samples["comparison"])


def test_a_faster_step_that_changes_the_outputs_is_not_kept(monkeypatch):
    """Every step's verdict read as "faster" (a timing outcome is noise, not a test), so the output check alone
    decides: the unchanged model's step is kept, the shifted one's is not."""
    decide = inference.decide
    monkeypatch.setattr(inference, "decide", lambda verdict, *rest: decide("faster", *rest))
    kept = quick(SlowWithAutograd, techniques=[INFERENCE_MODE]).steps.set_index("step").loc[INFERENCE_MODE]
    moved = quick(lambda: SlowWithAutograd(shift=0.01), techniques=[INFERENCE_MODE]).steps.set_index("step")
    moved = moved.loc[INFERENCE_MODE]
    assert kept["decision"] == "kept" and kept["max_error"] <= 1e-4
    assert moved["decision"] == "not kept: outputs changed" and moved["max_error"] == pytest.approx(0.01, rel=0.2)
    assert "beyond the 0.0001 tolerance" in moved["reason"]


def test_the_output_check_reads_relative_error_and_top1():
    reference = torch.tensor([[4.0, 1.0, 0.0], [0.0, 2.0, 1.9]])
    assert output_change(reference, reference) == (0.0, 1.0)
    error, top1 = output_change(reference, reference + torch.tensor([[0.04, 0, 0], [0, 0, 0.2]]))
    assert error == pytest.approx(0.1) and top1 == 0.5  # 0.2 over the second sample's 2.0; its class flipped
    assert within_tolerance(0.01, 1.0, 0.05) and not within_tolerance(0.06, 1.0, 0.05)
    assert not within_tolerance(0.0, 0.9, 0.05)  # a tenth of the classes changed
    assert output_change(reference, reference[:, :2])[0] == math.inf
    assert output_change(reference, reference * math.nan)[0] == math.inf
    assert output_change(torch.ones(2, 3, 4, 5), torch.ones(2, 3, 4, 5))[1] is None  # not scores over classes


def test_out_of_memory_is_the_sweeps_end_not_a_crash():
    for error in (torch.OutOfMemoryError, RuntimeError):
        result = quick(lambda: OutOfMemoryAbove8(error), batch_size=4, max_batch=64, techniques=[])
        rows = result.sweep.set_index("batch")
        assert list(rows.index) == [1, 2, 4, 8, 16] and rows.loc[16, "status"] == "out of memory"
        assert (rows.loc[[1, 2, 4, 8], "status"] == "ok").all()
        assert result.sweep_ends["starting point"] == "out of memory at batch 16"
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


CPU_OUT_OF_MEMORY = "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory"


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError], ids=["cuda", "cpu"])
def test_a_batch_that_does_not_fit_ends_the_tune_in_one_line_with_the_limit(error, tmp_path):
    with pytest.raises(OptlabError) as ended:
        quick(lambda: OutOfMemoryAbove8(error), batch_size=16, out=tmp_path)
    message = str(ended.value)
    assert message.startswith("the starting point runs out of memory at batch 16 on cpu (") and "\n" not in message
    assert "GiB): pass a smaller batch size" in message
    assert not list(tmp_path.iterdir()), "a record was written"


def test_the_cli_ends_a_batch_that_does_not_fit_in_one_line_not_a_traceback(capsys):
    argv = [*CLI, "--model", "tests.test_tune_inference:OutOfMemoryOnTheCpuAbove8", "--batch-size", "16"]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("optlab: error: the starting point runs out of memory at batch 16 on cpu")
    assert "\n" not in err.strip() and "Traceback" not in err


class OutOfMemoryOnTheCpuAbove8(OutOfMemoryAbove8):
    def __init__(self) -> None:
        super().__init__(RuntimeError)


class FailsAbove8(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 4)

    def forward(self, x):
        if len(x) > 8:
            raise ValueError("this model takes 8 samples at most\nand a second line")
        return self.body(x)


def test_a_model_that_fails_at_the_batch_size_ends_the_tune_in_one_line():
    with pytest.raises(OptlabError) as ended:
        quick(FailsAbove8, batch_size=16)
    assert str(ended.value) == "the starting point failed at batch 16: ValueError: this model takes 8 samples at most"


class OutOfMemoryInInferenceMode(nn.Module):
    """Runs out of memory (the CPU allocator's error) under inference_mode only, past the probe's two samples."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 4)

    def forward(self, x):
        if torch.is_inference_mode_enabled() and len(x) > 2:
            raise RuntimeError(CPU_OUT_OF_MEMORY)
        return self.body(x)


def test_a_step_that_runs_out_of_memory_is_recorded_and_the_tune_goes_on():
    result = quick(OutOfMemoryInInferenceMode, techniques=[INFERENCE_MODE], max_batch=2)
    row = result.steps.set_index("step").loc[INFERENCE_MODE]
    assert (row["decision"], row["verdict"], row["reason"]) == ("failed", "out of memory", "out of memory")
    assert list(result.sweep["batch"]) == [1, 2] and (result.sweep["status"] == "ok").all()


class Unbuilt(nn.Module):
    def __init__(self) -> None:
        raise AssertionError("the model was built before the sizes were checked")


def test_a_size_beyond_the_limits_is_refused_before_any_model_is_built(monkeypatch):
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda device: 2**40)
    with pytest.raises(OptlabError) as refused:  # not "math domain error"
        quick(Unbuilt, input_shape=(65_536, 65_536))
    assert str(refused.value) == ("one sample of 4,294,967,296 input values (16 GiB) is more than one batch may hold "
                                  "on cpu: at most 1,073,741,824 input values a batch")
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda device: 2**20)  # a device of 1 MiB
    with pytest.raises(OptlabError) as refused:
        quick(Unbuilt, input_shape=(1024,), max_batch=512)
    assert str(refused.value) == ("max_batch 512 is more than this run can use: at most 256 (the 1 MiB of memory of "
                                  "cpu: 256 inputs of 1,024 values (4 KiB))")
    with pytest.raises(OptlabError, match="each request batch size 512 is more than this run can use: at most 256"):
        quick(Unbuilt, input_shape=(1024,), max_batch=1, request_batches=[512])


def test_the_largest_batch_by_default_is_the_largest_power_of_two_within_the_limits(monkeypatch, capsys):
    monkeypatch.setattr(inputs, "device_memory_bytes", lambda device: 300 * 4 * 16)  # 300 inputs of 16 values
    quick(lambda: nn.Linear(16, 4), input_shape=(16,), max_batch=None, techniques=[])
    assert "at batch sizes 1, 2, 4, ... up to 256, until memory runs out" in capsys.readouterr().out


def test_the_sweep_stops_after_two_doublings_without_a_gain(monkeypatch):
    throughput = {1: 100.0, 2: 200.0, 4: 390.0, 8: 420.0, 16: 450.0, 32: 900.0}  # +8 %, then +7 % over the best

    def fake_measure(served, inputs, device, calls, warmup, budget_s):
        return {"status": "ok", "calls": calls, "samples_per_s": throughput[len(inputs)]}

    monkeypatch.setattr(batch_sweep, "measure", fake_measure)
    target = SweepTarget(lambda: batch_sweep.Served(lambda x: x, lambda x: x), lambda batch: torch.zeros(batch))
    rows, ends, _ = sweep({"a": target}, torch.device("cpu"), 32, 10, 1)
    assert list(rows["batch"]) == [1, 2, 4, 8, 16]
    assert ends["a"] == "throughput stopped rising: the 2 doublings after batch 4 each gained 10 % or less"
    rows, ends, _ = sweep({"a": target}, torch.device("cpu"), 4, 10, 1)
    assert list(rows["batch"]) == [1, 2, 4] and ends["a"] == "reached the largest batch asked for (4)"


def test_a_model_returning_a_dict_runs_with_an_output_function():
    result = quick(DictModel, output_fn=logits, techniques=[INFERENCE_MODE])
    row = result.steps.set_index("step").loc[INFERENCE_MODE]
    assert row["max_error"] == 0 and row["top1_agreement"] == 1.0


def test_the_code_lines_are_the_serving_code():
    start = optlab.RunConfig(eval_grad_mode="grad")
    assert code_lines(start, torch.device("cpu")) == ["# once, where the model is made:",
                                                      "model.eval()  # always: dropout off, batch-norm statistics frozen",
                                                      "# every forward:", "outputs = model(inputs)"]
    best = optlab.RunConfig(eval_grad_mode="inference_mode", amp_dtype="bf16", channels_last=True,
                            compile_mode="reduce-overhead")
    lines = code_lines(best, torch.device("cuda"), "model(**inputs)")
    assert 'model = torch.compile(model, mode="reduce-overhead")  # CUDA graphs' in lines
    assert lines[lines.index("# every forward:") + 1:] == [
        "with torch.inference_mode():",
        '    with torch.autocast("cuda", dtype=torch.bfloat16):',
        "        inputs = inputs.contiguous(memory_format=torch.channels_last)",
        "        outputs = model(**inputs).clone()  # a CUDA graph reuses its output memory on the next call"]


def test_steps_that_do_not_apply_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(inference, "native_bf16", lambda info: False)
    monkeypatch.setattr(inference, "native_fp16", lambda info: False)
    monkeypatch.setattr(compiler, "find_cxx", lambda: None)
    reasons = quick(tiny_mlp, max_batch=2).steps.set_index("step")["reason"]
    assert reasons[AUTOCAST].startswith("no native bf16 or fp16 on ")
    assert reasons[CHANNELS_LAST].startswith("the model has no 2-D convolutions")
    assert "needs a C++ compiler" in reasons[COMPILE]
    assert reasons[CUDA_GRAPHS] == "CUDA graphs exist only on CUDA"


class RefusesEval(nn.Module):
    def train(self, mode: bool = True):
        if not mode:
            raise NotImplementedError("this model has no eval mode")
        return super().train(mode)


class TrainOnly(TinyCNN):
    def forward(self, x):
        if not self.training:
            raise RuntimeError("running statistics were never computed")
        return super().forward(x)


CNN = {"input_shape": (3, 8, 8)}


@pytest.mark.parametrize("model_fn, options, message", [
    (TinyCNN(), CNN, "not a model"),
    (RefusesEval, CNN, "the model cannot run in eval mode: model.eval() failed: NotImplementedError: this model has"),
    (TrainOnly, CNN, "the model failed a forward pass in eval mode on inputs of shape [2, 3, 8, 8]: RuntimeError:"),
    (TinyCNN, {"input_shape": (5, 8, 8)}, "the model failed a forward pass in eval mode on inputs of shape [2, 5, 8"),
    (DictWithoutLogits, {}, "the model returned a dict without 'logits' or a single tensor: pass output_fn"),
    (DictModel, {"output_fn": lambda out: out["nope"]}, "output_fn failed on the model's output (a dict): KeyError"),
    (DictModel, {"output_fn": lambda out: out["logits"].tolist()}, "output_fn returned a list, not a tensor"),
    (DictModel, {"output_fn": lambda out: out["logits"].argmax(1)}, "the output to compare is a tensor of torch.int64"),
    (DictModel, {"output_fn": lambda out: out["logits"].sum()}, "the output's first dimension must be the batch"),
    (DictModel, {"output_fn": "logits"}, "output_fn must be a function of the model's output, got a str"),
    (tiny_mlp, {"num_classes": 10}, "the model gives 4 outputs per sample, but num_classes is 10"),
    (tiny_mlp, {"max_batch": 0}, "max_batch must be at least 1"),
    (tiny_mlp, {"max_batch": 10**6}, "max_batch 1000000 is more than this run can use: at most 65536"),
    (TinyCNN, {"input_shape": (3, 1024, 1024), "max_batch": 1024},
     "max_batch 1024 is more than this run can use: at most 341 (1,073,741,824 input values a batch"),
    (tiny_mlp, {"batch_size": 0}, "batch_size must be at least 1"),
    (tiny_mlp, {"steps": 0}, "steps must be at least 1"),
    (tiny_mlp, {"techniques": ["+ turbo"]}, "unknown inference step '+ turbo'"),
    (tiny_mlp, {"amp_dtype": "fp8"}, "unknown autocast dtype 'fp8'; choose one of: auto, bf16, fp16, none"),
    (tiny_mlp, {"input_shape": None}, "give input_shape"),
    (tiny_mlp, {"input_shape": (0,)}, "each input dimension must be at least 1"),
    (tiny_mlp, {"targets": torch.zeros(8)}, "targets is for training"),
    (tiny_mlp, {"input_shape": None, "inputs": "tokens:0:12"}, "the vocabulary size must be at least 2"),
    (tiny_mlp, {"input_shape": None, "inputs": {"x": torch.zeros(2, 12), "y": torch.zeros(3, 12)}},
     "must have the same first (batch) dimension"),
    (tiny_mlp, {"request_seconds": 0}, "request_seconds must be a number of seconds above 0"),
    (tiny_mlp, {"request_batches": [1, 10**9]}, "each request batch size 1000000000 is more"),
    (tiny_mlp, {"request_batches": []}, "request_batches must name 1 to 8 batch sizes, got 0"),
    (tiny_mlp, {"loss_tolerance": 0.1}, "loss_tolerance is for training"),
])
def test_bad_input_is_one_error_before_any_timing(model_fn, options, message, tmp_path):
    started = time.perf_counter()
    with pytest.raises(OptlabError) as error:
        quick(model_fn, out=tmp_path / "out", **options)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert time.perf_counter() - started < 10, "refused only after work"
    assert not list(tmp_path.rglob("*.json")), "a record was written"


def test_inference_options_need_inference():
    for options in ({"output_fn": logits}, {"max_batch": 8}, {"amp_dtype": "fp16"}, {"sweep_compile": True},
                    {"request_seconds": 1.0}):
        with pytest.raises(OptlabError, match="only with inference=True"):
            optlab.tune(tiny_mlp, input_shape=(12,), num_classes=4, device="cpu", profile=TINY, **options)


CLI = ["tune", "--inference", "--input-shape", "12", "--profile", "smoke", "--device", "cpu", "--quiet"]


def cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize("argv, message", [
    (["--model", "tests.test_tune_inference:DictWithoutLogits"], "the model returned a dict without 'logits'"),
    (["--model", "tests.test_tune_inference:DictModel", "--output-fn", "nosuch.module:logits"],
     "cannot import 'nosuch.module' for --output-fn 'nosuch.module:logits'"),
    (["--model", "tests.test_tune_inference:DictModel", "--output-fn", "tests.test_tune_inference"],
     "--output-fn must be PACKAGE.MODULE:CALLABLE"),
    (["--model", "tests.test_tune_inference:tiny_mlp", "--max-batch", "0"], "max_batch must be at least 1"),
    (["--model", "tests.test_tune_inference:tiny_mlp", "--max-batch", "99999999"], "max_batch 99999999 is more"),
    (["--model", "tests.test_tune_inference:tiny_mlp", "--max-batch", "x"], "expected a whole number, got 'x'"),
    (["--model", "tests.test_tune_inference:tiny_mlp", "--dtype", "fp8"], "unknown autocast dtype 'fp8'"),
    (["--model", "tests.test_tune_inference:tiny_mlp", "--num-classes", "1000"],
     "the model gives 4 outputs per sample, but num_classes is 1000"),
    (["--model", "tests.test_tune_inference:TrainOnly", "--input-shape", "3,8,8"],
     "the model failed a forward pass in eval mode"),
    (["--model", "tests.test_tune_inference:tiny_mlp", "--optimizer", "adam"], "optimizer is for training"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert cli([*CLI, *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optlab: error: ") and message in err and "\n" not in err
    assert not list(tmp_path.iterdir()), "something was written"


def test_cli_inference_options_need_inference(capsys):
    argv = ["tune", "--model", "tests.test_tune_inference:tiny_mlp", "--input-shape", "12", "--num-classes", "4",
            "--max-batch", "8", "--device", "cpu"]
    assert cli(argv) == 2 and "max_batch: only with inference=True" in capsys.readouterr().err


def test_cli_prints_both_tables_and_the_lines_to_add(monkeypatch, capsys):
    monkeypatch.setattr(compiler, "find_cxx", lambda: None)
    argv = [*CLI, "--model", "tests.test_tune_inference:DictModel", "--output-fn", "tests.test_tune_inference:logits",
            "--max-batch", "4", "--steps", "2"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("optlab tune --inference tests.test_tune_inference:DictModel: ")
    assert "precision" in out and "max error" in out and "p99 ms" in out and "samples/s" in out
    assert "batch sizes, starting point: reached the largest batch asked for (4)" in out
    assert "model.eval()" in out


def test_training_loader_workers_are_sized_by_the_machine(monkeypatch, capsys):
    monkeypatch.setattr(tune_module, "cpu_cores", lambda: 2)
    images = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,)))
    step = "+ 4 workers, pinned, non_blocking"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = optlab.tune(TinyCNN, data=images, batch_size=8, techniques=[step], profile=TINY, device="cpu",
                             progress=False)
    assert not [w for w in caught if "This DataLoader will create" in str(w.message)]
    out = capsys.readouterr().out
    assert out.count("2 loader workers here, one per CPU core") == 1
    workers = pd.DataFrame(result.samples).query("variant == @step")
    assert len(workers) and (workers["status"] == "ok").all()


def test_the_figure_names_throughput_and_request_latency_apart_with_the_out_of_memory_point():
    from optlab.book.report import plot_batch_sizes

    rows = [{"config": config, "batch": batch, "status": "ok", "samples_per_s": gain * min(batch, 4) * 100,
             "call_ms": 10 * batch / min(batch, 4)} for config, gain in (("starting point", 1), ("recommended", 2))
            for batch in (1, 2, 4, 8)] + [{"config": "recommended", "batch": 16, "status": "out of memory"}]
    latency = pd.DataFrame([{"config": config, "batch": batch, "status": "ok", "p50_ms": 20.0 * batch,
                             "p99_ms": 30.0 * batch} for config in ("starting point", "recommended") for batch in (1, 4)])
    grid = plot_batch_sizes(pd.DataFrame(rows), model="tiny", latency=latency)
    throughput, times = grid.axes.flat
    assert [ax.get_xscale() for ax in (throughput, times)] == ["log", "log"]
    assert [ax.get_yscale() for ax in (throughput, times)] == ["log", "log"]
    assert len(throughput.get_lines()) >= 2 and "back-to-back" in throughput.get_title()
    assert "a request one at a time (p50 to p99)" in times.get_title().replace("\n", " ")  # wrapped to the panel
    points = [line for line in times.get_lines() if line.get_marker() == "D"]
    assert sorted(float(line.get_ydata()[0]) for line in points) == [20.0, 20.0, 80.0, 80.0]  # each p50
    crosses = [line for line in times.get_lines() if line.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [16]
    import matplotlib.pyplot as plt
    plt.close(grid.figure)
    plt.close(plot_batch_sizes(pd.DataFrame(rows), model="tiny").figure)  # without request latency, as before


def test_a_model_whose_outputs_are_all_the_same_is_said_to_defeat_the_check(capsys):
    def zero_head():
        model = tiny_mlp()
        nn.init.zeros_(model[2].weight)
        nn.init.zeros_(model[2].bias)
        return model

    quick(zero_head, techniques=[], max_batch=1)
    assert "the starting point gives every input the same output" in capsys.readouterr().out
    quick(tiny_mlp, techniques=[], max_batch=1)
    assert "the same output" not in capsys.readouterr().out


def test_on_a_gpu_fp32_is_held_to_tf32s_tolerance_and_autocast_falls_back_to_fp16(monkeypatch):
    from optlab.core.machine.device import DeviceInfo
    from optlab.studies.tune.output_check import precision, tolerance
    from optlab.studies.tune.inference import autocast_dtype

    gpu, cpu = DeviceInfo(torch.device("cuda", 0), "a GPU", ("none", "fp16")), optlab.resolve_device("cpu")
    assert (precision(optlab.RunConfig(), gpu), tolerance(optlab.RunConfig(), gpu)) == ("fp32 (TF32 convolutions)", 1e-2)
    assert (precision(optlab.RunConfig(), cpu), tolerance(optlab.RunConfig(), cpu)) == ("fp32", 1e-4)
    assert tolerance(optlab.RunConfig(amp_dtype="fp16"), gpu) == 5e-2
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert autocast_dtype("auto", gpu) == ("fp16", None)
    assert autocast_dtype("bf16", gpu)[1].startswith("no native bf16 on a GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert autocast_dtype("auto", gpu) == ("bf16", None) and autocast_dtype("none", gpu)[0] is None


def test_timed_calls_on_a_scheduler_tick_are_named(monkeypatch, capsys):
    seen = []

    def on_a_tick(times):
        seen.append(list(times))
        return (0.008, 0.9)

    monkeypatch.setattr(machine_load, "tick_quantised", on_a_tick)
    quick(tiny_mlp, techniques=NO_COMPILE[:1], max_batch=1)
    assert seen and len(seen[0]) >= 2 * TINY.repeats * TINY.steps  # every timed call of both configurations
    assert "note: 90% of the timed calls took whole multiples of 8.0 ms" in capsys.readouterr().out
