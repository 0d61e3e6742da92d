"""``optlab tune``: the stack, one step at a time, on a model optlab does not know; every bad input is one line."""
import json
import math
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import optlab
from optlab.commands.cli import main
from optlab.core.machine import compiler
from optlab.core.knobs.config import RunConfig
from optlab.core.errors import OptlabError
from optlab.core.results.store import load_samples
from optlab.studies.tune import NothingRecommended, training as tune_module
from optlab.studies.tune.training import code_lines, decide, loss_change, stack_steps
from tests.helpers import TINY

LABELS = [label for label, _ in stack_steps()]
NO_COMPILE = [label for label in LABELS if label != "+ torch.compile"]


class TinyCNN(nn.Module):
    """A convnet optlab has never seen: 3x8x8 images, 4 classes."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.features(x))


def tiny_mlp() -> nn.Module:
    """No convolutions at all: 12 features, 4 classes."""
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))


def images(count: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(count, 3, 8, 8, generator=generator),
                         torch.randint(0, 4, (count,), generator=generator))


def quick_tune(model_fn, **options):
    return optlab.tune(model_fn, profile=TINY, device="cpu", progress=False, **options)


@pytest.fixture(scope="module")
def loader_result(tmp_path_factory):
    """The API on a tiny convnet with the reader's own DataLoader and loss function, saved to a folder."""
    loader = DataLoader(images(), batch_size=8, shuffle=True)
    out = tmp_path_factory.mktemp("tune")
    return quick_tune(TinyCNN, data=loader, loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1), techniques=NO_COMPILE,
                      out=out), out


def test_every_step_of_the_stack_has_a_row_with_a_decision(loader_result):
    result, _ = loader_result
    table = result.steps.set_index("step")
    assert list(table.index) == LABELS
    assert set(table["decision"]) <= {"kept", "not kept", "not kept: loss changed", "skipped", "failed"}
    measured = table[table["decision"] != "skipped"]
    assert set(measured.index) == {"+ bf16 autocast", "+ channels_last", "+ set_to_none, fused SGD"} - (
        set() if optlab.core.machine.device.native_bf16(optlab.resolve_device("cpu")) else {"+ bf16 autocast"})
    assert (measured["speedup"] > 0).all() and (measured["ci_low"] <= measured["ci_high"]).all()
    assert (measured["loss_change"] >= 0).all()
    assert "keeps its own workers" in table.loc["+ 4 workers, pinned, non_blocking", "reason"]
    assert table.loc["+ data on device", "reason"].startswith("no CUDA")
    assert table.loc["+ torch.compile", "reason"] == "not among the techniques asked for"


def test_samples_and_summary_are_run_experiments_with_the_step_tried(loader_result):
    result, _ = loader_result
    ok = result.samples[result.samples["status"] == "ok"]
    assert set(ok["model"]) == {"TinyCNN"} and set(ok["phase"]) == {"train"}
    assert ok.groupby(["comparison", "variant"]).size().eq(TINY.repeats).all()
    assert (ok["steps"] == TINY.steps).all() and (ok["flops_per_step"] > 0).all()
    assert {"model", "variant", "speedup", "ci_low", "ci_high", "verdict", "comparison"} <= set(result.summary)


def test_the_recommendation_is_the_kept_steps_measured_afresh(loader_result):
    result, _ = loader_result
    kept = list(result.steps.loc[result.steps["decision"] == "kept", "step"])
    assert result.kept == kept
    if kept:
        assert set(result.samples["comparison"]) >= {"recommended"}
        assert result.ci_low <= result.speedup <= result.ci_high and result.code
    else:
        assert (result.speedup, result.recommended, result.code) == (1.0, result.start, [])
        assert "keep your configuration" in result.describe()


@pytest.fixture(scope="module")
def kept_result():
    """Every measured step kept whatever its verdict (a CPU rarely finds one clearly faster at this size), so the
    recommended configuration, its afresh comparison and the code lines are exercised on every machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tune_module, "decide", lambda verdict, change, tolerance, *failed: ("kept", ""))
        return quick_tune(TinyCNN, input_shape=(3, 8, 8), num_classes=4, techniques=["+ channels_last",
                                                                                     "+ set_to_none, fused SGD"])


def test_kept_steps_are_measured_afresh_all_together_against_the_start(kept_result):
    result = kept_result
    assert result.kept == ["+ channels_last", "+ set_to_none, fused SGD"]
    afresh = result.samples[result.samples["comparison"] == tune_module.FINAL]
    assert set(afresh["variant"]) == {tune_module.START, tune_module.FINAL}
    assert result.recommended.channels_last and result.recommended.set_to_none
    assert result.recommended.optimizer_impl == "fused" and not result.start.channels_last
    assert result.ci_low <= result.speedup <= result.ci_high
    assert list(result.speedups()["step"])[-1] == tune_module.AFRESH
    assert any("channels_last" in line for line in result.code) and any("fused" in line for line in result.code)
    assert "the lines to add to your training:" in result.describe()


def test_speedups_are_each_measured_step_then_the_kept_ones_afresh(loader_result):
    result, _ = loader_result
    speedups = result.speedups()
    measured = result.steps.dropna(subset=["speedup"])
    assert list(speedups["step"]) == list(measured["step"]) + ([tune_module.AFRESH] if result.kept else [])
    assert set(speedups["model"]) == {"TinyCNN"}


def test_the_record_is_written_whole_and_reads_back(loader_result):
    result, out = loader_result
    (path,) = out.glob("tune-*.json")
    assert path == result.path
    record = json.loads(path.read_text())
    assert record["model"] == "TinyCNN" and len(record["steps"]) == len(LABELS)
    assert "model" not in record["start"]  # optlab's own model fields are not the reader's
    assert set(load_samples(path)["comparison"]) == set(result.samples["comparison"])


def test_a_map_style_dataset_times_loader_workers():
    result = quick_tune(TinyCNN, data=images(), batch_size=8, techniques=["+ 4 workers, pinned, non_blocking"])
    row = result.steps.set_index("step").loc["+ 4 workers, pinned, non_blocking"]
    assert row["decision"] != "skipped" and row["speedup"] > 0


def test_steps_that_do_not_apply_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(tune_module, "native_bf16", lambda info: False)
    monkeypatch.setattr(compiler, "find_cxx", lambda: None)
    result = quick_tune(tiny_mlp, input_shape=(12,), num_classes=4, techniques=LABELS[:3] + LABELS[-1:])
    reasons = result.steps.set_index("step")["reason"]
    assert reasons["+ 4 workers, pinned, non_blocking"].startswith("synthetic batches are made once")
    assert reasons["+ bf16 autocast"].startswith("no native bf16 on ")
    assert reasons["+ channels_last"].startswith("the model has no 2-D convolutions")
    assert "needs a C++ compiler" in reasons["+ torch.compile"]
    assert reasons["+ set_to_none, fused SGD"] == "not among the techniques asked for"
    assert result.samples.empty and result.kept == []


CUDA_OOM = (torch.OutOfMemoryError, "CUDA out of memory. Tried to allocate 1 PiB")
CPU_OOM = (RuntimeError, "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: you tried "
                         "to allocate 1125899906842624 bytes")


@pytest.mark.parametrize("error", [CUDA_OOM, CPU_OOM], ids=["cuda", "cpu"])
def test_out_of_memory_is_recorded_and_the_run_goes_on(monkeypatch, error):
    class OutOfMemoryInBf16(TinyCNN):
        def forward(self, x):
            if torch.is_autocast_enabled("cpu"):
                raise error[0](error[1])
            return super().forward(x)

    monkeypatch.setattr(tune_module, "native_bf16", lambda info: True)
    result = quick_tune(OutOfMemoryInBf16, input_shape=(3, 8, 8), num_classes=4,
                        techniques=["+ bf16 autocast", "+ channels_last"])
    table = result.steps.set_index("step")
    assert tuple(table.loc["+ bf16 autocast", ["decision", "verdict"]]) == ("failed", "out of memory")
    assert table.loc["+ channels_last", "decision"] in ("kept", "not kept", "not kept: loss changed")


class OutOfMemoryAbove(nn.Module):
    """Runs out of memory on a batch of more than ``most`` samples, with the exception ``error`` (type, message)."""

    def __init__(self, error: tuple = CPU_OOM, most: int = 8) -> None:
        super().__init__()
        self.body, self.error, self.most = nn.Linear(12, 4), error, most

    def forward(self, x):
        if len(x) > self.most:
            raise self.error[0](self.error[1])
        return self.body(x)


@pytest.mark.parametrize("error", [CUDA_OOM, CPU_OOM], ids=["cuda", "cpu"])
def test_a_batch_that_does_not_fit_ends_the_tune_in_one_line_with_the_limit(error, tmp_path):
    with pytest.raises(OptlabError) as ended:
        quick_tune(lambda: OutOfMemoryAbove(error), input_shape=(12,), num_classes=4, batch_size=16,
                   techniques=NO_COMPILE, out=tmp_path)
    message = str(ended.value)
    assert message.startswith("the starting point runs out of memory at batch 16 on cpu (") and "\n" not in message
    assert "GiB): pass a smaller batch size" in message  # the device's memory, as the limit
    assert not list(tmp_path.iterdir()), "a record was written"


class FailsToTrain(nn.Module):
    """Trains on the probe's two samples, then fails on every real batch: no configuration runs a step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 4)

    def forward(self, x):
        if len(x) > 2:
            raise RuntimeError("this model trains on two samples at most")
        return self.body(x)


def test_a_tune_whose_every_step_failed_recommends_nothing(tmp_path):
    with pytest.raises(NothingRecommended) as ended:
        quick_tune(FailsToTrain, input_shape=(12,), num_classes=4, techniques=["+ set_to_none, fused SGD"],
                   out=tmp_path)
    assert str(ended.value) == ("every step tried failed, so nothing is recommended (starting point, + set_to_none, "
                                "fused SGD: failed: RuntimeError: this model trains on two samples at most)")
    steps = ended.value.result.steps.set_index("step")
    assert steps.loc["+ set_to_none, fused SGD", "decision"] == "not decided"
    assert not list(tmp_path.iterdir()), "a record of a recommendation was written"


def test_the_cli_shows_what_failed_then_one_line_and_a_non_zero_exit(capsys):
    argv = ["tune", "--model", "tests.test_tune:FailsToTrain", "--input-shape", "12", "--num-classes", "4",
            "--profile", "smoke", "--device", "cpu", "--steps", "1", "--repeats", "2", "--max-repeats", "2"]
    assert cli(argv) == 2
    captured = capsys.readouterr()
    assert "+ set_to_none, fused SGD" in captured.out and "the configuration before it failed" in captured.out
    assert "recommendation" not in captured.out
    last = captured.err.splitlines()[-1]  # as a terminal shows it: the progress bar cleared its line ("\r")
    assert last.startswith("optlab: error: every step tried failed, so nothing is recommended (")
    assert "Traceback" not in captured.err


class Unbuilt(nn.Module):
    """A model that must never be built: the sizes are refused before."""

    def __init__(self) -> None:
        raise AssertionError("the model was built before the sizes were checked")


@pytest.mark.parametrize("options, message", [
    ({"input_shape": (65_536, 65_536)},
     "one sample of 4,294,967,296 input values (16 GiB) is more than one batch may hold on cpu: at most "
     "1,073,741,824 input values a batch"),
    ({"inputs": "tokens:32000:65536:mask", "batch_size": 16_384},
     "batch_size 16384 is more than this run can use: at most 8192 (1,073,741,824 input values a batch: 8192 "
     "inputs of 131,072 values (1 MiB))"),
])
def test_a_size_beyond_the_limits_is_refused_before_any_model_is_built(options, message, monkeypatch):
    from optlab.studies.tune import inputs as tune_inputs

    monkeypatch.setattr(tune_inputs, "device_memory_bytes", lambda device: 2**40)  # memory is not the bound here
    with pytest.raises(OptlabError) as refused:
        quick_tune(Unbuilt, num_classes=4, **options)
    assert str(refused.value) == message


def test_a_batch_beyond_the_devices_memory_is_refused_with_that_limit(monkeypatch):
    from optlab.studies.tune import inputs as tune_inputs

    monkeypatch.setattr(tune_inputs, "device_memory_bytes", lambda device: 2**20)  # a device of 1 MiB
    with pytest.raises(OptlabError) as refused:
        quick_tune(Unbuilt, input_shape=(1024,), num_classes=4, batch_size=512)
    assert str(refused.value) == ("batch_size 512 is more than this run can use: at most 256 (the 1 MiB of memory of "
                                  "cpu: 256 inputs of 1,024 values (4 KiB))")
    with pytest.raises(OptlabError, match=r"one sample of 524,288 input values \(2 MiB\) is more than one batch may "
                                          r"hold on cpu: at most the 1 MiB of memory of cpu"):
        quick_tune(Unbuilt, input_shape=(512, 1024), num_classes=4)


def test_a_compile_that_fails_is_one_line_and_the_run_goes_on(monkeypatch):
    class Broken(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            raise RuntimeError("Inductor could not build the kernel\n  a long compiler log")

    monkeypatch.setattr(torch, "compile", lambda model, mode=None: Broken(model))
    result = quick_tune(TinyCNN, input_shape=(3, 8, 8), num_classes=4,
                        techniques=["+ set_to_none, fused SGD", "+ torch.compile"])
    row = result.steps.set_index("step").loc["+ torch.compile"]
    assert row["decision"] == "failed"
    assert row["reason"] == "failed: RuntimeError: Inductor could not build the kernel"


def test_a_faster_step_that_moves_the_loss_is_marked_and_not_kept():
    assert decide("faster", 0.001, 0.05) == ("kept", "")
    decision, reason = decide("faster", 0.2, 0.05)
    assert decision == "not kept: loss changed" and "20 %" in reason and "5 % tolerance" in reason
    assert decide("faster", math.nan, 0.05)[0] == "not kept: loss changed"
    assert decide("no clear difference", 0.0, 0.05) == ("not kept", "")
    assert decide("faster", 0.0, 0.05, after_failed="out of memory") == ("failed", "out of memory")
    assert decide("faster", 0.0, 0.05, before_failed="out of memory")[0] == "not decided"


def test_the_loss_check_reads_the_first_two_losses_only():
    assert loss_change([2.3, 2.2, 9.0], [2.3, 2.2, 1.0]) == 0.0  # the third has drifted: not read
    assert loss_change([2.3, 2.0], [2.3, 2.2]) == pytest.approx(0.1)  # a zero head: only the second shows it
    assert math.isnan(loss_change([math.nan, 1.0], [1.0, 1.0])) and math.isnan(loss_change([], []))


def test_the_recommendation_is_the_lines_of_code_to_add():
    start = RunConfig(set_to_none=False)
    best = RunConfig(amp_dtype="bf16", channels_last=True, optimizer_impl="fused")
    lines = code_lines(start, best, torch.device("cuda"))
    assert "model = model.to(memory_format=torch.channels_last)" in lines
    assert ('with torch.autocast("cuda", dtype=torch.bfloat16):  # the forward and the loss',
            "    loss = loss_fn(model(inputs), targets)") == tuple(lines[-2:])  # backward and step stay as they were
    assert "optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, fused=True)  " \
           "# or your own settings, fused" in lines
    assert "optimizer.zero_grad(set_to_none=True)" in lines
    assert code_lines(start, start, torch.device("cpu")) == []


class Stream(IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(3), 0)])


@pytest.mark.parametrize("model_fn, options, message", [
    (TinyCNN(), {"input_shape": (3, 8, 8), "num_classes": 4}, "not a model"),
    (lambda: torch.zeros(2), {"input_shape": (3, 8, 8), "num_classes": 4}, "returned a Tensor, not a torch.nn.Module"),
    (lambda: TinyCNN(classes="four"), {"input_shape": (3, 8, 8), "num_classes": 4}, "building the model with"),
    (TinyCNN, {"input_shape": (5, 8, 8), "num_classes": 4},
     "the model rejected inputs of shape [2, 5, 8, 8]: RuntimeError: Given groups=1"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 10}, "the model gives 4 outputs per sample, but the labels"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 4, "batch_size": 0}, "batch_size must be at least 1"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 4, "batch_size": 10**9}, "batch_size 1000000000 is more"),
    (TinyCNN, {"input_shape": (3, 224, 224), "num_classes": 4, "batch_size": 65_536},
     "batch_size 65536 is more than this run can use: at most 7133 (1,073,741,824 input values a batch"),
    (TinyCNN, {"input_shape": (3, 0, 8), "num_classes": 4}, "each input dimension must be at least 1"),
    (TinyCNN, {"input_shape": (1, 1, 1, 1, 1), "num_classes": 4}, "input shape must have 1 to 4 dimensions"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 1}, "num_classes must be at least 2"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 10**9}, "num_classes 1000000000 is more"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 4, "steps": 0}, "steps must be at least 1"),
    (TinyCNN, {"input_shape": (3, 8, 8)}, "training needs targets: give num_classes (random class labels)"),
    (TinyCNN, {}, "give input_shape (one input's shape, such as (3, 224, 224)), inputs (an example batch"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 4, "data": images()},
     "give either data= or input_shape, num_classes, not both"),
    (TinyCNN, {"inputs": torch.zeros(4, 3, 8, 8), "targets": torch.zeros(3, dtype=torch.long)},
     "the targets must be a tensor with the example's 4 rows first"),
    (TinyCNN, {"inputs": "images:3,8,8", "num_classes": 4}, "--input 'images:3,8,8' is not an input description"),
    (TinyCNN, {"inputs": ["x=float:3,8,8", "float:3,8,8"], "num_classes": 4},
     "name every input (NAME=..., keyword inputs) or none"),
    (TinyCNN, {"data": Stream()}, "a DataLoader or a map-style dataset"),
    (TinyCNN, {"data": images(16), "batch_size": 8}, "make 2 full batches of 8; each timed run needs 4"),
    (TinyCNN, {"data": DataLoader(images(), batch_size=8), "batch_size": 4}, "the DataLoader's batch_size is 8"),
    (TinyCNN, {"data": TensorDataset(torch.zeros(64, 3, 8, 8))}, "each batch must be (inputs, targets), the targets"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 4, "techniques": ["+ turbo"]}, "unknown stack step '+ turbo'"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 4, "loss_tolerance": -1}, "loss_tolerance must be a number"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 4, "optimizer": "lion"}, "unknown optimizer 'lion'"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 4, "loss_fn": lambda out, y: out}, "must be a single number"),
    (TinyCNN, {"input_shape": (3, 8, 8), "num_classes": 4, "loss_fn": lambda out, y: out.view(3, 5)},
     "the loss failed on the model's output ([2, 4]) for inputs of shape [2, 3, 8, 8]: RuntimeError:"),
])
def test_bad_input_is_one_error_before_any_timing(model_fn, options, message, tmp_path):
    started = time.perf_counter()
    with pytest.raises(OptlabError) as error:
        quick_tune(model_fn, out=tmp_path / "out", **options)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert time.perf_counter() - started < 10, "refused only after work"
    assert not list(tmp_path.rglob("*.json")), "a record was written"


def test_the_full_profile_needs_a_step_count():
    with pytest.raises(OptlabError, match="profile full times whole epochs"):
        optlab.tune(TinyCNN, input_shape=(3, 8, 8), num_classes=4, profile="full", device="cpu")


CLI = ["--num-classes", "4", "--input-shape", "3,8,8", "--batch-size", "8", "--profile", "smoke", "--device", "cpu"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "nosuch.module:thing"],
     "cannot import 'nosuch.module' for --model 'nosuch.module:thing': ModuleNotFoundError: No module named 'nosuch'"),
    (["--model", "torchvision.models:not_there"], "'torchvision.models' has no attribute 'not_there'"),
    (["--model", "torchvision.models:resnet_18"], "did you mean resnet18"),
    (["--model", "torchvision.models"], "--model must be PACKAGE.MODULE:CALLABLE"),
    (["--model", "torch:float32"], "is a dtype, not a callable that builds a model"),
    (["--model", "torch.nn:Identity"], "the model gives 3 outputs per sample, but the labels go up to 3"),
    (["--model", "tests.test_tune:TinyCNN", "--kwargs", "{bad"], "--kwargs must be a JSON object"),
    (["--model", "tests.test_tune:TinyCNN", "--kwargs", '{"depth": 3}'],
     "building the model with TinyCNN() failed: TypeError:"),
    (["--model", "tests.test_tune:TinyCNN", "--input-shape", "3,x"], "input shape must be whole numbers"),
    (["--model", "tests.test_tune:TinyCNN", "--input-shape", "1,8,8"],
     "the model rejected inputs of shape [2, 1, 8, 8]: RuntimeError:"),
    (["--model", "tests.test_tune:TinyCNN", "--batch-size", "0"], "batch_size must be at least 1"),
    (["--model", "tests.test_tune:TinyCNN", "--batch-size", "99999999999"], "batch_size 99999999999 is more"),
    (["--model", "tests.test_tune:TinyCNN", "--num-classes", "x"], "expected a whole number, got 'x'"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert cli(["tune", *CLI, *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optlab: error: ") and message in err and "\n" not in err
    assert not list(tmp_path.iterdir()), "something was written"


def cli(argv: list[str]) -> int:
    """The exit status of ``python -m optlab ARGV``, run in this process (argparse's own errors exit)."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def test_cli_prints_the_table_and_the_recommendation(monkeypatch, capsys):
    monkeypatch.setattr(compiler, "find_cxx", lambda: None)  # the compile step is skipped, with its reason, in a test
    assert cli(["tune", "--model", "tests.test_tune:TinyCNN", *CLI, "--steps", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("optlab tune tests.test_tune:TinyCNN: ") and "profile smoke" in out and "device: cpu" in out
    assert "speed-up" in out and "99.5 % sequential interval" in out and "decision" in out and "needs a C++ compiler" in out
    assert "recommendation" in out


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_synthetic_batches_on_cuda_are_pinned_once_and_their_copy_is_charged_to_each_step(monkeypatch):
    """With a fake clock: a copy to the GPU costs 2 ms of host time (pinned, non_blocking) and a step 1 ms. Every
    config that copies is timed at 3 ms a step; data on the device at 1 ms: "+ data on device" is credited with
    the pinned copy alone, not with a pageable blocking copy that no real pinned loader would pay."""
    from optlab.core.measuring import loops
    from optlab.core.knobs.config import RunConfig
    from optlab.studies.tune import inputs as tune_inputs

    clock, copies, pins = _FakeClock(), [], []
    real_to, real_pin = torch.Tensor.to, torch.Tensor.pin_memory

    def pin_memory(self):
        pinned = self.clone()
        pins.append(pinned.data_ptr())
        return pinned

    def to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            copies.append((self.untyped_storage().data_ptr() in pins, kwargs.get("non_blocking", False)))
            clock.now += 0.001  # inputs and targets: 2 ms a batch
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(time, "perf_counter", clock)
    from optlab.studies.tune.examples import examples_from
    batches = tune_inputs.synthetic_batches(examples_from(None, None, (3, 4, 4), 10, seed=0), batch_size=2,
                                            steps_per_run=4)
    cuda = torch.device("cuda")

    def step_ms(config):
        def step(batch, index):
            clock.now += 0.001
        result, _ = loops.run_timed(step, batches.loader(config, cuda), torch.device("cpu"), steps=3, warmup=1)
        return [round(1e3 * s, 6) for s in result.step_times_s]

    copying = RunConfig(num_workers=0, pin_memory=False)
    assert step_ms(copying) == [3.0, 3.0, 3.0] and step_ms(copying) == [3.0, 3.0, 3.0]
    assert len(pins) == 2  # inputs and targets, pinned once for every config
    assert copies and all(pinned and non_blocking for pinned, non_blocking in copies)
    copies.clear()
    assert step_ms(RunConfig(num_workers=0, pin_memory=False, data_on_device=True)) == [1.0, 1.0, 1.0]
    assert len(copies) == 2  # the whole pool once, before the timed steps
