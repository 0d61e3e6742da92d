"""The tunes on a model as it is served: inputs of any kind (token ids with a mask, keyword tensors, an example
batch), request latency apart from throughput, memory that counts CUDA graphs' pool, an out-of-memory point that is
the model's own, and code lines that run as printed."""
import math
import textwrap
import weakref
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import optlab
from optlab.commands.cli import main
from optlab.core.machine import compiler
from optlab.core.measuring import loops, memory
from optlab.core.knobs.config import RunConfig
from optlab.core.errors import OptlabError
from optlab.core.measuring.memory import is_out_of_memory
from optlab.studies.tune import batch_sweep, inference, training
from optlab.studies.tune.batch_sweep import Served, SweepTarget, request_latency, sweep
from optlab.studies.tune.examples import IGNORE, examples_from, next_tokens, parse_input
from optlab.studies.tune.output_check import output_change
from tests.helpers import TINY
from tests.lm_fixture import LENGTH, VOCAB, TinyCausalLM, example_tokens, keyword_lm

SMALL = ["--profile", "smoke", "--device", "cpu", "--quiet", "--steps", "1", "--repeats", "2", "--max-repeats", "2",
         "--batch-size", "4"]
SERVE = ["tune", "--inference", *SMALL, "--max-batch", "4", "--request-seconds", "0.05", "--dtype", "none"]


def cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def printed_code(out: str) -> str:
    """The lines a reader copies from ``describe()``, as printed, without the block's own indent."""
    block = out.split("the lines to add", 1)[1].split("\n", 1)[1]
    return textwrap.dedent(block)


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.setattr(compiler, "find_cxx", lambda: None)  # the compile steps are skipped, with their reason


# --- inputs of any kind ---------------------------------------------------------------------------------------


def test_described_inputs_scale_the_first_dimension_and_give_next_token_targets():
    examples = examples_from(["input_ids=tokens:48:12:mask", "pixels=float:3,4,4"], None, None, None, seed=0)
    for n in (1, 5):
        inputs, targets = examples.make(n, 0)
        assert set(inputs) == {"input_ids", "attention_mask", "pixels"}
        assert inputs["input_ids"].shape == (n, 12) and inputs["input_ids"].dtype == torch.int64
        assert inputs["pixels"].shape == (n, 3, 4, 4) and inputs["pixels"].is_floating_point()
        assert targets.shape == (n, 12) and (targets[:, -1] == IGNORE).all()
    ids = torch.tensor([[5, 6, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert next_tokens(ids, mask).tolist() == [[6, 7, IGNORE, IGNORE]]
    assert examples.classes == 48 and examples.values_per_sample == 12 * 2 + 48
    given = examples_from(example_tokens(), None, None, None, seed=0)
    rows, _ = given.make(7, 0)
    assert rows["input_ids"].shape == (7, LENGTH)
    assert torch.equal(rows["input_ids"][3], example_tokens()["input_ids"][0])  # the example's rows, in turn


def test_inference_takes_the_inputs_of_the_datas_first_batch():
    from torch.utils.data import DataLoader, TensorDataset

    from optlab.studies.tune.inputs import first_inputs
    ids = torch.randint(0, VOCAB, (6, LENGTH))
    pairs = TensorDataset(ids, torch.zeros(6, dtype=torch.long))
    assert torch.equal(first_inputs(DataLoader(pairs, batch_size=4), 8), ids[:4])  # (inputs, targets): the inputs
    assert torch.equal(first_inputs(pairs, 8), ids)  # a dataset: its first samples, collated
    keyword = [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]
    assert set(first_inputs(DataLoader(keyword, batch_size=2), 8)) == {"input_ids", "attention_mask"}


def test_the_output_check_reads_a_token_models_outputs_per_token():
    reference = torch.zeros(2, 3, 5)
    reference[..., 0] = 1.0  # every token's top-1 is 0
    reference[1, 0, 0] = 10.0  # a token of larger scores: it does not set the scale of the others
    moved = reference.clone()
    moved[1, 2] = torch.tensor([0.0, 2.0, 0, 0, 0])  # one token of six changes its top-1, by twice its own scale
    error, top1 = output_change(reference, moved)
    assert top1 == pytest.approx(5 / 6) and error == pytest.approx(2.0)


@pytest.mark.parametrize("text, message", [
    ("tokens:48", "is not an input description"),
    ("tokens:48:12:pad", "is not an input description"),
    ("tokens:1:12", "the vocabulary size must be at least 2"),
    ("tokens:48:0", "each input dimension must be at least 1"),
    ("float:3,x", "is not an input description"),
    ("2x=float:3", "'2x' is not a keyword name"),
])
def test_a_bad_description_is_one_error(text, message):
    with pytest.raises(OptlabError, match=message):
        parse_input(text)


def test_inference_runs_a_causal_language_model_on_token_ids_with_a_mask(capsys, no_compiler):
    assert cli([*SERVE, "--model", "tests.lm_fixture:TinyCausalLM", "--input", f"tokens:{VOCAB}:{LENGTH}:mask"]) == 0
    out = capsys.readouterr().out
    assert f"token ids of length {LENGTH} below {VOCAB}, with a mask" in out
    assert f"outputs of [{LENGTH}, {VOCAB}] per sample" in out
    assert "request p50 ms" in out and "throughput, samples/s" in out
    assert "request latency at batch 1, starting point: p50 " in out
    model, (ids, mask) = TinyCausalLM(), (torch.randint(0, VOCAB, (2, LENGTH)), torch.ones(2, LENGTH, dtype=torch.long))
    scope = {"torch": torch, "model": model, "inputs": (ids, mask)}
    exec(printed_code(out), scope)  # the lines to add, as printed
    assert torch.allclose(scope["outputs"], model(ids, mask), atol=1e-5)


def test_inference_runs_a_model_of_keyword_tensors_that_returns_a_dict(capsys, no_compiler):
    argv = [*SERVE, "--model", "tests.lm_fixture:keyword_lm"]
    assert cli([*argv, "--input", f"input_ids=tokens:{VOCAB}:{LENGTH}:mask"]) == 0
    out = capsys.readouterr().out
    assert "input_ids=token ids" in out and "outputs = model(**inputs)" in out
    scope = {"torch": torch, "model": keyword_lm(), "inputs": example_tokens()}
    exec(printed_code(out), scope)
    assert scope["outputs"]["logits"].shape == (3, LENGTH, VOCAB)
    assert cli([*argv, "--example-batch", "tests.lm_fixture:example_tokens"]) == 0
    assert "your example batch (input_ids [3, 12] int64, attention_mask [3, 12] int64)" in capsys.readouterr().out


def test_training_runs_the_language_model_with_cross_entropy_over_tokens(capsys, no_compiler):
    argv = ["tune", *SMALL, "--model", "tests.lm_fixture:TinyCausalLM", "--input", f"tokens:{VOCAB}:{LENGTH}:mask",
            "--optimizer", "adam"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert f"token ids of length {LENGTH} below {VOCAB}" in out and f"{VOCAB} classes" in out
    assert "recommendation" in out
    assert cli(["tune", *SMALL, "--model", "tests.lm_fixture:TinyCausalLM", "--example-batch",
                "tests.lm_fixture:example_training_batch"]) == 0


@pytest.mark.parametrize("inference", [False, True], ids=["training", "inference"])
def test_tune_runs_the_books_gpt_on_token_ids(inference, capsys, no_compiler):
    """The transformer track's GPT through both tunes: [N, T] ids in, [N, T, V] logits checked per token."""
    argv = ["--model", "optlab.core.gpt:build_gpt", "--kwargs", '{"model": "gpt_tiny"}', "--input", "tokens:65:32"]
    assert cli([*SERVE, *argv] if inference else ["tune", *SMALL, *argv, "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "token ids of length 32 below 65" in out and "recommendation" in out
    assert "outputs of [32, 65] per sample" in out if inference else "65 classes" in out


def test_the_default_loss_is_cross_entropy_over_every_token():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, 2, IGNORE], [0, IGNORE, IGNORE]])
    from optlab.studies.tune.inputs import cross_entropy
    picked = logits[[0, 0, 1], [0, 1, 0]]
    expected = torch.nn.functional.cross_entropy(picked, torch.tensor([1, 2, 0]))
    assert torch.allclose(cross_entropy({"logits": logits}, targets), expected)


@pytest.mark.parametrize("argv, message", [
    (["--input", "tokens:48"], "--input 'tokens:48' is not an input description; the forms are"),
    (["--input", "tokens:48:12", "--input", "mask=float:12"], "name every input (NAME=..., keyword inputs) or none"),
    (["--input", "tokens:48:99999999"], "each input dimension 99999999 is more"),
    (["--input-shape", "12", "--input", "tokens:48:12"], "give one of --input-shape, --input or --example-batch (got "
                                                         "--input-shape, --input)"),
    ([], "give one of --input-shape, --input or --example-batch (got none)"),
    (["--example-batch", "tests.lm_fixture:VOCAB"], "is a int, not a callable that returns an example batch"),
    (["--example-batch", "tests.lm_fixture:nothing"], "'tests.lm_fixture' has no attribute 'nothing'"),
    (["--input", "tokens:48:12", "--request-seconds", "0"], "request_seconds must be a number of seconds above 0"),
])
def test_bad_input_descriptions_end_in_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert cli(["tune", "--inference", "--model", "tests.lm_fixture:TinyCausalLM", "--device", "cpu", *argv,
                "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optlab: error: ") and message in err and "\n" not in err
    assert not list(tmp_path.iterdir())


def test_a_training_example_batch_must_hold_targets(capsys):
    argv = ["tune", "--model", "tests.lm_fixture:TinyCausalLM", "--device", "cpu", "--example-batch",
            "tests.lm_fixture:example_tokens"]
    assert cli(argv) == 2
    assert "for training, --example-batch tests.lm_fixture:example_tokens must return (inputs, targets)" in \
        capsys.readouterr().err


# --- request latency and throughput, named apart ---------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_request_latency_includes_the_copies_and_a_synchronisation_per_request(monkeypatch):
    """On a fake clock a copy in costs 2 ms, a call 1 ms, a copy out 3 ms: a request is 6 ms, a back-to-back call
    1 ms; every request ends with its own synchronisation, after its copy out."""
    clock, events = FakeClock(), []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and args[0] == "cpu":
            clock.now += 0.003
            events.append("out")
            return self
        return real_to(self, *args, **kwargs)

    def to_device(inputs):
        clock.now += 0.002
        events.append("in")
        return inputs

    def forward(inputs):
        clock.now += 0.001
        events.append("call")
        return {"logits": inputs}

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(batch_sweep.time, "perf_counter", clock)
    monkeypatch.setattr(batch_sweep, "synchronize", lambda device: events.append("sync"))
    served = Served(forward, to_device)
    row = request_latency(served, torch.zeros(1, 4), torch.device("cuda"), seconds=0.5, min_requests=30, warmup=10)
    assert row["p50_ms"] == pytest.approx(6.0) and row["p99_ms"] == pytest.approx(6.0) and row["iqr_ms"] == 0
    assert row["requests"] == math.ceil(0.5 / 0.006) and row["seconds"] >= 0.5  # at least the count and the time
    assert events == ["in", "call", "out", "sync"] * (10 + row["requests"])  # the warm-up, untimed, first
    short = request_latency(served, torch.zeros(1, 4), torch.device("cuda"), seconds=0.01, min_requests=30)
    assert short["requests"] == 30  # the count, when the time is short
    events.clear()
    point = batch_sweep.measure(served, torch.zeros(2, 4), torch.device("cpu"), calls=10, warmup=2)
    assert point["call_ms"] == pytest.approx(1.0) and point["samples_per_s"] == pytest.approx(2000)
    assert events.count("in") == 1 and "out" not in events  # throughput: inputs already there, outputs left there


# --- memory and the out-of-memory point ------------------------------------------------------------------------


def test_the_graph_pool_is_counted_in_the_inference_peak(monkeypatch):
    """A fake CUDA device whose private pools already hold 500 MiB of other configurations' graphs: a
    reduce-overhead configuration's comparison repeats and its sweep points each count what its own first calls
    recorded (64 MiB a shape), not the device's total nor what another recorded between its repeats; an eager one's
    count none."""
    pools = {"mb": 500.0}
    monkeypatch.setattr(memory, "graph_pool_mb", lambda device: pools["mb"])
    monkeypatch.setattr(memory, "phase_peak_mb", lambda device, start, resident, *increase: 10.0)
    monkeypatch.setattr(memory, "phase_start", lambda device: 0)
    cuda = torch.device("cuda")
    recorded: set = set()

    def record(key) -> None:  # a first call records the graphs for this model and shape
        if key not in recorded:
            recorded.add(key)
            pools["mb"] += 64.0

    def timed(step, calls, device, steps, warmup, resident):
        record(id(resident[0]))
        return loops.PhaseResult(0.0, [0.001], 0.01, 10.0), []

    monkeypatch.setattr(loops, "run_timed", timed)
    prepared = inference._Prepared(nn.Linear(2, 2), lambda x: x, [torch.zeros(1, 2)])
    graphs, eager = RunConfig(compile_mode="reduce-overhead"), RunConfig()
    assert inference._runner(prepared, graphs, cuda)("test", TINY, 0).peak_mem_mb == 74.0
    pools["mb"] += 30.0  # another configuration records its graphs between the repeats
    again = inference._runner(prepared, graphs, cuda)("test", TINY, 1)
    assert again.peak_mem_mb == 74.0 and again.graph_pool_mb == 64.0
    plain = inference._Prepared(nn.Linear(2, 2), lambda x: x, [torch.zeros(1, 2)])
    assert inference._runner(plain, eager, cuda)("test", TINY, 0).peak_mem_mb == 10.0
    # the first calls, before any repeat, record the graphs: they are the configuration's too
    monkeypatch.setattr(loops, "prepare_model", lambda model, config, device: model)
    monkeypatch.setattr(inference, "_on_device", lambda inputs, config, device: inputs)
    monkeypatch.setattr(inference, "_forward", lambda model, config, device: lambda x: record(id(model)) or x)
    run = SimpleNamespace(info=SimpleNamespace(device=cuda), model_fn=lambda: nn.Linear(2, 2), seed=0,
                          inputs=[torch.zeros(1, 2)], output_fn=None)
    first = inference._prepare(run, graphs)
    assert inference._runner(first, graphs, cuda)("test", TINY, 0).graph_pool_mb == 64.0  # the repeat replays them

    class Timer:
        def __init__(self, device):
            self.marks = 0

        def start(self):
            pass

        def mark(self):
            self.marks += 1

        def finish(self):
            return [0.001] * self.marks, 0.001 * self.marks

    monkeypatch.setattr(batch_sweep, "StepTimer", Timer)
    monkeypatch.setattr(batch_sweep, "synchronize", lambda device: None)

    def forward(inputs):
        record(tuple(inputs.shape))

    served = Served(forward, lambda x: x, uses_graphs=True)
    point = batch_sweep.measure(served, torch.zeros(2, 4), cuda, calls=5, warmup=1)
    assert point["graph_pool_mb"] == 64.0 and point["peak_mem_mb"] == 74.0
    bigger = batch_sweep.measure(served, torch.zeros(4, 4), cuda, calls=5, warmup=1)
    assert bigger["graph_pool_mb"] == 128.0  # the smaller batch's graphs are still its own
    eager_served = Served(forward, lambda x: x)
    assert batch_sweep.measure(eager_served, torch.zeros(8, 4), cuda, calls=5, warmup=1)["peak_mem_mb"] == 10.0


class FakeDevice:
    """A device of 100 units: each loaded configuration holds its weights there until it is released, and a call
    needs 10 units a sample on top of what is loaded."""

    def __init__(self) -> None:
        self.loaded: dict[int, int] = {}
        self.most_loaded = 0

    def target(self, weights: int) -> SweepTarget:
        def load() -> Served:
            holder = nn.Module()
            key = id(holder)
            self.loaded[key] = weights
            self.most_loaded = max(self.most_loaded, len(self.loaded))
            weakref.finalize(holder, self.loaded.pop, key)

            def forward(inputs):
                self.most_loaded = max(self.most_loaded, len(self.loaded))
                if sum(self.loaded.values()) + 10 * len(inputs) > 100:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 unit")
                return inputs
            return Served(forward, lambda x: x, (holder,))
        return SweepTarget(load, lambda batch: torch.zeros(batch, 1))


def test_the_out_of_memory_point_is_taken_with_one_configuration_on_the_device():
    device = FakeDevice()
    rows, ends, _ = sweep({"big": device.target(50), "small": device.target(20)}, torch.device("cpu"), 64, 5, 1)
    assert ends == {"big": "out of memory at batch 8", "small": "out of memory at batch 16"}  # 70 + 40 > 100 both
    assert device.most_loaded == 1 and not device.loaded  # one at a time, and all released at the end
    assert list(rows.loc[rows["config"] == "small", "status"]) == ["ok"] * 4 + ["out of memory"]


def test_the_failed_calls_tensors_are_released_before_the_cache_is_emptied(monkeypatch):
    alive = []

    def forward(inputs):
        scratch = torch.zeros(1000)  # what the failed call had allocated
        alive.append(weakref.ref(scratch))
        raise torch.OutOfMemoryError("CUDA out of memory")

    seen = []
    monkeypatch.setattr(memory, "resident_mb", lambda holds, device: 0.0)
    monkeypatch.setattr(memory, "phase_start", lambda device: 0)
    monkeypatch.setattr(batch_sweep, "synchronize", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append([ref() is None for ref in alive]))
    target = SweepTarget(lambda: Served(forward, lambda x: x), lambda batch: torch.zeros(batch, 1))
    _, ends, _ = sweep({"a": target}, torch.device("cuda"), 4, 5, 1)
    assert ends["a"] == "out of memory at batch 1" and seen and seen[0] == [True]


class CaptureFailed(Exception):
    """What a compiler raises around an error inside it (as Dynamo's BackendCompilerFailed keeps it)."""

    def __init__(self, inner: BaseException) -> None:
        super().__init__(f"backend failed: {type(inner).__name__}")
        self.inner_exception = inner


def test_out_of_memory_inside_graph_capture_is_the_out_of_memory_point():
    def chained_above_2(inputs):  # an error raised while handling the out-of-memory, from it
        if len(inputs) > 2:
            try:
                raise torch.OutOfMemoryError("CUDA out of memory during graph capture")
            except torch.OutOfMemoryError as error:
                raise RuntimeError("cudagraph capture failed") from error
        return inputs

    def wrapped_above_2(inputs):  # a compiler's error that keeps the out-of-memory inside it
        if len(inputs) > 2:
            raise CaptureFailed(torch.OutOfMemoryError("CUDA out of memory"))
        return inputs

    for forward in (chained_above_2, wrapped_above_2):
        target = SweepTarget(lambda: Served(forward, lambda x: x), lambda batch: torch.zeros(batch, 1))
        _, ends, _ = sweep({"graphs": target}, torch.device("cpu"), 16, 5, 1)
        assert ends["graphs"] == "out of memory at batch 4", forward.__name__
    assert not is_out_of_memory(CaptureFailed(ValueError("a shape the compiler refused")))


# --- the code a reader copies ----------------------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))


@pytest.mark.parametrize("grad", ["grad", "inference_mode"])
@pytest.mark.parametrize("amp", ["none", "bf16"])
@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("compiled", ["none", "default", "reduce-overhead"])
def test_the_serving_lines_run_as_printed(grad, amp, layout, compiled, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)  # the line runs; compiling is not the test
    config = RunConfig(eval_grad_mode=grad, amp_dtype=amp, channels_last=layout, compile_mode=compiled)
    result = optlab.InferenceResult(
        model="m", steps=None, samples=None, summary=None, kept=["x"], start=config, recommended=config, speedup=1.0,
        ci_low=1.0, ci_high=1.0, verdict="faster", sweep=None, sweep_ends={},
        code=inference.code_lines(config, torch.device("cpu")))
    printed = "\n".join(result.code_block("the lines to add:"))
    model, images = SmallCNN(), torch.randn(2, 3, 6, 6)
    scope = {"torch": torch, "model": model, "inputs": images}
    exec(printed_code(printed), scope)
    assert scope["outputs"].shape == (2, 5)
    assert torch.allclose(scope["outputs"].float(), model(images), atol=0.1)


@pytest.mark.parametrize("best", [
    RunConfig(amp_dtype="bf16", channels_last=True, optimizer_impl="fused", set_to_none=True, non_blocking=True),
    RunConfig(amp_dtype="fp16", compile_mode="default", num_workers=2, pin_memory=True, data_on_device=True),
])
def test_the_training_lines_run_as_printed(best, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)
    start = RunConfig(set_to_none=False, num_workers=0, pin_memory=False)
    result = training.TuneResult(model="m", steps=None, samples=None, summary=None, kept=["x"], start=start,
                                 recommended=best, speedup=1.0, ci_low=1.0, ci_high=1.0, verdict="faster",
                                 code=training.code_lines(start, best, torch.device("cpu")))
    model = SmallCNN()
    before = [p.detach().clone() for p in model.parameters()]
    scope = {"torch": torch, "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
             "loss_fn": torch.nn.functional.cross_entropy, "device": torch.device("cpu"),
             "inputs": torch.randn(4, 3, 6, 6), "targets": torch.tensor([0, 1, 2, 3]),
             "dataset": torch.utils.data.TensorDataset(torch.randn(8, 3, 6, 6), torch.zeros(8, dtype=torch.long)),
             "images": torch.randn(8, 3, 6, 6), "labels": torch.zeros(8, dtype=torch.long)}
    added = printed_code("\n".join(result.code_block("the lines to add to your training:")))
    assert "set_to_none=False" not in added, added  # the starting point's own line is not one to add
    unchanged = ([] if "loss = " in added else ["loss = loss_fn(model(inputs), targets)"]) + \
        ([] if "backward()" in added else ["loss.backward()", "optimizer.step()"])  # the reader's step, as before
    exec("\n".join([added, *unchanged]), scope)
    assert any(not torch.equal(a, b) for a, b in zip(before, scope["model"].parameters())), "no training step ran"
