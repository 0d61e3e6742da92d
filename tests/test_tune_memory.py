"""``optlab tune --memory``: one training step's memory on the reader's own model, the largest category and what moves
it, each fix measured, and bad input in one line."""
import dataclasses

import pytest
import torch
from torch import nn

import optlab
from optlab.commands.cli import main
from optlab.core.errors import OptlabError
from optlab.core.gpt import build_gpt
from optlab.studies.memory import CATEGORIES
from optlab.studies.tune import MemoryResult, memory as tune_memory_module
from optlab.core.machine.device import resolve_device
from optlab.studies.tune.examples import examples_from
from optlab.studies.tune.inputs import cross_entropy
from optlab.studies.tune.memory import FIXES, MOVED_BY, Measure, checkpointed, repeated_blocks, search_batch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def stacked() -> nn.Module:
    """Four repeated blocks and a head: 16 features in, 4 classes."""
    return nn.Sequential(nn.Linear(16, 64), nn.Sequential(*[Block() for _ in range(4)]), nn.Linear(64, 4))


def flat() -> nn.Module:
    """Nothing repeated to checkpoint."""
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def memory_tune(model_fn=stacked, **options) -> MemoryResult:
    options = {"input_shape": (16,), "num_classes": 4, "batch_size": 64, "device": "cpu"} | options
    return optlab.tune(model_fn, progress=False, memory=True, **options)


@pytest.fixture(scope="module")
def result() -> MemoryResult:
    return memory_tune()


def rows(result: MemoryResult) -> dict:
    return {row["fix"]: row for row in result.fixes.to_dict(orient="records")}


def test_the_breakdown_names_the_largest_category_and_what_moves_it(result):
    assert isinstance(result, MemoryResult) and list(result.breakdown.categories) == list(CATEGORIES)
    assert result.breakdown.adds_up()
    largest = result.breakdown.largest()
    assert result.describe().startswith(f"largest: {largest}, ") and MOVED_BY[largest] in result.describe()
    assert list(result.table()["moved by"]) == [MOVED_BY[name] for name in CATEGORIES]
    assert "largest batch: not bounded on a CPU" in result.describe() and result.largest_batch is None


def test_every_fix_has_a_row_and_each_moves_its_category(result):
    fixes = rows(result)
    assert len(fixes) == len(FIXES) and all(not row["note"] for row in fixes.values())
    assert fixes["set_to_none"]["after MiB"] == 0 < fixes["set_to_none"]["before MiB"]
    assert fixes["activation checkpointing"]["after MiB"] < 0.5 * fixes["activation checkpointing"]["before MiB"]
    accumulation = next(row for name, row in fixes.items() if name.startswith("gradient accumulation"))
    assert accumulation["after MiB"] < 0.4 * accumulation["before MiB"]
    assert fixes["fused optimizer"]["after MiB"] < fixes["fused optimizer"]["before MiB"]
    assert "largest:" in result.report() and "peak change" in result.report()


def test_the_fixes_are_ranked_by_what_they_do_to_the_peak(result):
    measured = result.fixes.dropna(subset=["peak after MiB"])
    change = list(measured["peak after MiB"] / measured["peak before MiB"])
    assert len(measured) == len(FIXES) and change == sorted(change) and change[0] < change[-1]
    best = measured.iloc[0]
    assert f"lowers the peak most here: {best['fix']}, " in result.describe()
    assert f"it moves {best['moves']}: " in result.describe()
    assert list(result.fixes.columns[:4]) == ["fix", "peak before MiB", "peak after MiB", "peak change"]
    unchanged = result.fixes.assign(**{"peak after MiB": result.fixes["peak before MiB"]})
    none_lower = dataclasses.replace(result, fixes=unchanged)
    assert "no fix lowered the peak here; the closest: " in none_lower.describe()
    assert "lowers the peak most" not in none_lower.describe()


class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x).detach()


class FailsWithGradients(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        if torch.is_grad_enabled():
            raise RuntimeError("this layer is for inference only")
        return self.fc(x)


class BackwardFails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("no backward for this op")


class FailsInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return BackwardFails.apply(self.fc(x))


def detached() -> nn.Module:
    return Detached()


def fails_with_gradients() -> nn.Module:
    return FailsWithGradients()


def fails_in_backward() -> nn.Module:
    return FailsInBackward()


@pytest.mark.parametrize("model, message", [
    ("detached", "optlab: error: the loss does not depend on any trainable parameter, so a training step has nothing "
                 "to do: is the model's output detached"),
    ("fails_with_gradients", "optlab: error: the training step (forward, loss, backward) failed on 2 samples: "
                             "RuntimeError: this layer is for inference only"),
    ("fails_in_backward", "optlab: error: the training step (forward, loss, backward) failed on 2 samples: "
                          "RuntimeError: no backward for this op"),
])
def test_a_model_whose_training_step_fails_is_one_line_and_exit_2(capsys, model, message):
    argv = ["tune", "--memory", "--model", f"tests.test_tune_memory:{model}", "--input-shape", "16",
            "--num-classes", "4", "--device", "cpu", "--quiet"]
    assert cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert "optlab tune --memory" not in captured.out  # refused by the probe, before the breakdown starts


def test_a_batch_that_does_not_fit_says_out_of_memory_in_one_line():
    """The probe's two samples fit; the baseline step's batch of 64 runs out of memory (as a GPU, or the CPU's
    allocator, would say)."""
    def loss(output, targets):
        if len(targets) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return cross_entropy(output, targets)

    with pytest.raises(OptlabError) as error:
        memory_tune(flat, loss_fn=loss)
    assert str(error.value) == ("the training step at batch 64 ran out of memory on cpu: give a smaller batch_size "
                                "(--batch-size)")

    def other(output, targets):
        if len(targets) > 2:
            raise ValueError("labels out of order")
        return cross_entropy(output, targets)

    with pytest.raises(OptlabError, match=r"^the training step at batch 64 could not be broken down: ValueError: "
                                          r"labels out of order$"):
        memory_tune(flat, loss_fn=other)


def test_checkpointing_wraps_the_repeated_blocks_only():
    assert len(repeated_blocks(stacked())) == 4 and repeated_blocks(flat()) == []
    assert len(repeated_blocks(build_gpt("gpt_tiny"))) == 2
    torch.manual_seed(0)
    plain, wrapped = stacked(), checkpointed(stacked())
    wrapped.load_state_dict(plain.state_dict())
    inputs = torch.randn(8, 16)
    torch.testing.assert_close(wrapped(inputs), plain(inputs))


def test_a_fix_that_does_not_apply_says_why():
    fixes = rows(memory_tune(flat, batch_size=2))
    assert "no repeated blocks" in fixes["activation checkpointing"]["note"]
    accumulation = next(row for name, row in fixes.items() if name.startswith("gradient accumulation"))
    assert "a batch of 2 cannot be cut into 4 micro-batches" in accumulation["note"]


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
def test_the_batch_search_finds_where_memory_runs_out():
    """On a CPU, with a loss that runs out of memory above 40 samples as a GPU would: 1, 2, ..., 64, then bisected."""
    def loss(output, targets):
        if len(targets) > 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return cross_entropy(output, targets)

    examples = examples_from(None, None, (16,), 4, 0)
    measure = Measure(flat, examples.make(2, 0), loss, "sgd", resolve_device("cpu"), 0)
    assert search_batch(measure, examples, 1000) == (40, 12)  # 1 to 64 doubling, then 48, 40, 44, 42, 41
    assert search_batch(measure, examples, 32) == (32, 6)


def test_the_readers_own_data_gives_its_first_batch():
    data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    result = memory_tune(flat, data=torch.utils.data.DataLoader(data, batch_size=8), input_shape=None, num_classes=None,
                         batch_size=None)
    assert result.batch_size == 8 and result.breakdown.expected["input"] == 8 * 16 * 4 + 8 * 8


@pytest.mark.parametrize("options, message", [
    ({"steps": 3}, "steps is for the timed tune"), ({"inference": True}, "inference is for the timed tune"),
    ({"techniques": ["+ channels_last"], "out": "x"}, "techniques, out are for the timed tune"),
    ({"batch_size": 0}, "batch_size must be at least 1"), ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
])
def test_bad_input_is_one_line(options, message):
    with pytest.raises(OptlabError, match=message) as error:
        memory_tune(**options)
    assert "\n" not in str(error.value)


def cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def test_the_cli_on_a_token_model(capsys, monkeypatch):
    monkeypatch.setattr(tune_memory_module, "FIXES", FIXES[1:2])  # the breakdown and checkpointing of its blocks
    argv = ["tune", "--memory", "--model", "optlab.core.gpt:build_gpt", "--kwargs", '{"model": "gpt_tiny"}',
            "--input", "tokens:65:16", "--batch-size", "4", "--device", "cpu", "--quiet"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("optlab tune --memory optlab.core.gpt:build_gpt: one training step, batch 4")
    assert "\nlargest: " in out and "not bounded on a CPU" in out
    fix = next(line for line in out.splitlines() if line.strip().startswith("activation checkpointing"))
    cells = fix.split()  # fix, peak before, after, change, then the category at its moment: measured, no note
    assert cells[4].endswith("%") and cells[5:7] == ["activation", "forward's"] and float(cells[-1]) >= 0


def test_the_cli_on_a_torchvision_model(capsys, monkeypatch):
    monkeypatch.setattr(tune_memory_module, "FIXES", FIXES[:1])  # the breakdown and one fix: a quick test
    argv = ["tune", "--memory", "--model", "torchvision.models:resnet18", "--kwargs", '{"num_classes": 4}',
            "--input-shape", "3,16,16", "--num-classes", "4", "--batch-size", "2", "--device", "cpu", "--quiet"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert "\nlargest: " in out and "set_to_none" in out and "gradient accumulation x4" not in out


def test_the_cli_refuses_a_timed_option_in_one_line(capsys):
    argv = ["tune", "--memory", "--inference", "--model", "tests.test_tune_memory:flat", "--input-shape", "16",
            "--device", "cpu"]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == "optlab: error: memory=True (--memory) breaks one training step down; inference is for the timed tune"


@pytest.mark.cuda
def test_on_a_gpu_the_largest_batch_that_fits_is_found():
    found = memory_tune(batch_size=8, device="cuda")
    assert found.largest_batch is not None and found.largest_batch >= 8 and "tries on cuda" in found.batch_note
