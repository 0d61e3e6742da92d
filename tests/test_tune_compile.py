"""``optlab tune --compile`` and the graph-break and recompile studies behind it (chapter 35): each break found on
its own line and named, each recompile reported with the guard that failed, the recompile limit's fall-back
detected, and the command's bad inputs one line each."""
import logging
import os

import numpy as np
import pytest
import torch

from optlab.commands.cli import main
from optlab.studies.first_step import breaks, dynamo_log, recompiles
from optlab.studies.tune import CompileResult, tune

from tests import compile_subjects

MARKS = {"item": ".item()", "branch": "if x.mean() > 0", "print": "print(", "numpy": "np.", "builtin": "perf_counter"}
TOKENS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", breaks.BREAKS)
def test_each_break_alone_is_found_once_on_its_line(kind):
    found = breaks.find_breaks(breaks.TokenModel(64, 16, 2, breaks=(kind,)), TOKENS)
    assert (found.count, found.graphs) == (1, 2), found.table
    row = found.table.iloc[0]
    assert row["break"] == kind and MARKS[kind] in row["line"], row
    path, line = row["where"].rsplit(":", 1)
    assert path.endswith("first_step/breaks.py") and MARKS[kind] in open(path).read().splitlines()[int(line) - 1]


def test_all_five_breaks_in_order_and_none_without_them():
    found = breaks.find_breaks(breaks.TokenModel(64, 16, 2), TOKENS)
    clean = breaks.find_breaks(breaks.TokenModel(64, 16, 2, breaks=()), TOKENS)
    assert found.table["break"].tolist() == ["print", "item", "branch", "numpy", "builtin"]
    assert found.graphs == 6 and (clean.count, clean.graphs) == (0, 1)
    assert set(found.table["reason"]) <= set(breaks.counted_breaks())


def test_the_breaks_change_nothing_but_the_graphs():
    torch.manual_seed(0)
    model = breaks.TokenModel(64, 16, 2)
    clean = breaks.TokenModel(64, 16, 2, breaks=())
    clean.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(TOKENS), clean(TOKENS), rtol=1e-4, atol=1e-5)


class CudaLike(torch.Tensor):
    """A CPU tensor that refuses NumPy as a CUDA tensor does (``Tensor.__array__`` calls ``numpy()``, which raises for
    a tensor off the host); ``.cpu()`` gives a plain host tensor."""

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    def __array__(self, dtype=None, copy=None):
        return self.numpy()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if func is torch.Tensor.cpu else out


def test_the_numpy_break_runs_in_eager_on_a_device_tensor():
    model = breaks.TokenModel(64, 16, 2, breaks=("numpy",))
    clean = breaks.TokenModel(64, 16, 2, breaks=())
    clean.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS.as_subclass(CudaLike)).as_subclass(torch.Tensor), clean(TOKENS),
                                   rtol=1e-4, atol=1e-5)


def test_a_graph_break_message_gives_its_line_and_reason():
    message = ("Graph break in user code at /a/model.py:42\nGraph Break Reason: Encountered graph break when "
               "attempting to trace CALL: a function call, e.g. f(x, y):\n\nData dependent operator\n  Explanation: ..")
    assert dynamo_log.parse_break(message) == dynamo_log.GraphBreak("/a/model.py", 42, "Data dependent operator")
    assert dynamo_log.parse_break("Recompiling function f") is None


def test_past_the_limit_every_recompile_is_reported_and_the_fall_back_named():
    limit = torch._dynamo.config.recompile_limit
    lengths = list(range(5, 5 + 3 * (limit + 3), 3))
    stream = recompiles.sequence_lengths(lengths, batch=2, vocab=64)
    static = recompiles.watch(breaks.TokenModel(64, 16, 1, breaks=()), stream, dynamic=False)
    assert static.count == limit - 1 and static.fell_back, static.calls  # 8 graphs: the first and 7 recompiles
    assert static.calls["graphs so far"].tolist() == [*range(1, limit + 1), *[limit] * (len(lengths) - limit)]
    assert static.calls["recompiled"].tolist() == [False, *[True] * (limit - 1), *[False] * (len(lengths) - limit)]
    for before, now, guard in zip(lengths, lengths[1:limit + 1], static.calls["guard that failed"][1:limit + 1]):
        assert f"expected {before}, actual {now}" in guard and not guard.startswith("0/"), guard
    assert static.calls["ran"].tolist()[limit - 1:] == ["compiled", recompiles.REFUSED,
                                                        *[recompiles.EAGER_PAST] * (len(lengths) - limit - 1)]
    assert f"{limit} graphs compiled, {limit - 1} recompiles; call {limit} failed" in static.describe()
    automatic = recompiles.watch(breaks.TokenModel(64, 16, 1, breaks=()), stream)
    assert (automatic.count, automatic.fell_back) == (1, False), automatic.calls


def test_the_stance_fails_on_a_recompile_and_only_then():
    model = breaks.TokenModel(64, 16, 1, breaks=())
    short, long = recompiles.sequence_lengths([6, 9], batch=2, vocab=64)
    assert "fail_on_recompile" in recompiles.recompile_error(model, short, long)
    assert recompiles.recompile_error(model, short, short) == ""


def test_catching_dynamo_s_messages_leaves_its_loggers_as_they_were():
    from torch._logging._internal import log_state

    loggers = [logging.getLogger(name) for name in (dynamo_log.BREAKS_LOGGER, dynamo_log.RECOMPILES_LOGGER)]
    before = [(logger.level, logger.propagate, list(logger.handlers)) for logger in loggers]
    artifacts = set(log_state.artifact_names)
    with dynamo_log.caught() as log:
        recompiles.watch(breaks.TokenModel(64, 16, 1, breaks=()), recompiles.sequence_lengths([4, 7], 2, 64))
    assert len(log.recompiles) == 1 and set(log_state.artifact_names) == artifacts, log
    assert [(logger.level, logger.propagate, list(logger.handlers)) for logger in loggers] == before


COMPILE = ["tune", "--inference", "--compile", "--quiet", "--profile", "smoke", "--input", "tokens:64:16", "--model"]
SUBJECTS = "tests.compile_subjects:"


@pytest.mark.parametrize("argv, message", [
    (["tune", "--model", f"{SUBJECTS}TrimmedTagger", "--input", "tokens:64:16", "--shapes", "12"],
     "--shapes goes with --compile"),
    (["tune", "--model", f"{SUBJECTS}TrimmedTagger", "--input", "tokens:64:16", "--compile", "--memory"], "not both"),
    ([*COMPILE, f"{SUBJECTS}TrimmedTagger", "--shapes", "12,x"], "whole numbers"),
    ([*COMPILE, f"{SUBJECTS}TrimmedTagger", "--shapes", *map(str, range(1, 70))], "at most 64"),
    ([*COMPILE[:-3], "--input", "float:8", "--model", f"{SUBJECTS}Untraceable"], "could not trace any of"),
    ([*COMPILE, f"{SUBJECTS}PerPosition", "--shapes", *map(str, range(4, 16))], "pass the recompile limit"),
    ([*COMPILE[:-3], "--input", "ids=tokens:64:16", "--model", f"{SUBJECTS}PerPosition", "--shapes",
      *map(str, range(4, 16))], "pass the recompile limit"),  # one keyword input is one input
    ([*COMPILE, f"{SUBJECTS}Counting"], "recompiles at every call on the same batch (seen by Dynamo alone"),
])
def test_bad_input_untraceable_models_and_the_limit_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optlab: error: ") and "\n" not in err and message in err, err


def test_the_recompile_error_names_the_guard_its_line_and_whole_file_without_dynamo_s_hint(capsys):
    assert main([*COMPILE, f"{SUBJECTS}Counting"]) == 2
    err = capsys.readouterr().err.strip()
    lines = open(compile_subjects.__file__).read().splitlines()
    line = next(number for number, text in enumerate(lines, 1) if "self.calls += 1" in text)
    assert f"self.calls == 3 (`self.calls += 1` at {os.path.relpath(compile_subjects.__file__)}:{line})" in err, err
    assert "HINT" not in err and "0/1" not in err and "allow_unspec_int_on_nn_module" not in err, err


def item_line() -> int:
    """The line of ``TrimmedTagger.forward`` that calls ``.item()``."""
    lines = open(compile_subjects.__file__).read().splitlines()
    return next(number for number, line in enumerate(lines, 1) if ".item()" in line and "longest" in line)


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
def test_tune_compile_names_the_break_times_cold_and_warm_and_gives_the_break_even():
    result = tune(compile_subjects.TrimmedTagger, inputs="tokens:64:16", inference=True, compile=True,
                  shapes=[(16,), (11,), (7,)], profile="smoke", progress=False)
    assert isinstance(result, CompileResult)
    assert result.breaks.table["where"].tolist() == [f"{os.path.relpath(compile_subjects.__file__)}:{item_line()}"]
    assert result.recompiles is not None and result.recompiles.count >= 1 and result.varying_dims == [1]
    assert result.cold.cache_misses > 0 and result.cold.cache_hits == 0, result.cold  # cold means cold
    assert result.warm.cache_hits > 0 and result.warm.cache_misses == 0, result.warm
    assert result.cold.compile_s > result.warm.compile_s > 0
    gain, (steps, _, _) = result.speed_up(), result.break_even()
    saving = float(np.median(result.timings.seconds["eager"])) * (1 - 1 / gain.ratio)
    assert steps == pytest.approx(result.cold.compile_s / saving if saving > 0 else float("inf"))
    text = result.report()
    assert f"compile_subjects.py:{item_line()}" in text and "break-even" in text and gain.verdict in text
    assert ("torch._dynamo.mark_dynamic(inputs, 1)" in text) == ("model = torch.compile(model)" in text) == \
        (gain.verdict == "faster"), text  # the lines to add follow the verdict
    assert result.setup.first_compile_s > 0 and "the machine's setup, paid before" in text


def test_tune_compile_times_a_training_step_of_a_torchvision_model():
    """The default step is training: forward, loss and backward through the compiled model, timed with gradients."""
    from torchvision.ops import MLP

    result = tune(lambda: MLP(12, [16, 4]), input_shape=(12,), num_classes=4, compile=True, profile="smoke",
                  progress=False)
    assert result.step == "training step" and result.breaks.count == 0, result.breaks.table
    assert result.cold.cache_misses > 0 and result.warm.cache_hits > 0 and result.cold.compile_s > 0
    assert set(result.timings.seconds) == {"eager", "compiled"} and result.speed_up().ratio > 0


def test_a_start_kept_in_this_process_points_every_compile_cache_into_its_folder_and_back(tmp_path):
    import tempfile

    from optlab.studies.first_step import fresh
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TMPDIR")
    before = ({name: os.environ.get(name) for name in names}, tempfile.gettempdir())
    cache = fresh.CacheFolder(tmp_path / "cold")
    with fresh.redirected(cache):
        seen = [cache_dir(), os.environ["TRITON_CACHE_DIR"], tempfile.gettempdir(), default_cache_dir()]
    assert all(folder.startswith(str(cache.path)) for folder in seen), seen
    assert ({name: os.environ.get(name) for name in names}, tempfile.gettempdir()) == before


def _result(eager_ms: float, compiled_ms: float, spread: float, breaks_found: int = 0,
            warm_s: float = 0.1) -> CompileResult:
    """A CompileResult over made-up rounds: eager and compiled steps around the given times, ``spread`` apart."""
    import pandas as pd

    from optlab.studies.tune.compile import FirstStep, MachineSetup

    noise = np.random.default_rng(0).normal(0, spread, 8)
    timings = breaks.Timings(seconds={"eager": list(eager_ms * 1e-3 * np.exp(noise)),
                                      "compiled": list(compiled_ms * 1e-3 * np.exp(noise[::-1]))},
                             shifts={"eager": [0, 1] * 4, "compiled": [1, 0] * 4},
                             first_call_s={"eager": 0.01, "compiled": 2.0})
    table = pd.DataFrame([{"break": "item", "reason": "r", "where": "m.py:3", "line": "x.item()"}] * breaks_found,
                         columns=breaks.BREAK_COLUMNS)
    return CompileResult("m", torch.device("cpu"), "training step", "a batch", breaks.Breaks(1, table, 5), None, [],
                         MachineSetup(4.0, 9.0), FirstStep(2.5, 2.0, 0, 12), FirstStep(0.5 + warm_s, warm_s, 12, 0), timings, [])


def test_the_break_even_is_the_model_s_own_cold_compile_over_the_saving_the_setup_left_out():
    result = _result(10.0, 5.0, 0.02)
    saving = float(np.median(result.timings.seconds["eager"])) * (1 - 1 / result.speed_up().ratio)
    assert result.speed_up().verdict == "faster"
    assert result.break_even()[0] == pytest.approx(2.0 / saving)  # 2.0 s the model's; the setup's 13 s apart
    text = result.describe()
    assert f"{2.0 / saving:,.0f} steps of the model's cold compile" in text and "13.0 s (" in text, text
    assert result.code_lines()[0] == "model = torch.compile(model)"


@pytest.mark.parametrize("compiled_ms, spread, words", [(20.0, 0.02, "never: the compiled training step is slower"),
                                                        (10.0, 0.002, "never: the compiled training step is no faster"),
                                                        (9.0, 0.6, "can't tell yet: the interval holds 1")])
def test_the_lines_to_add_follow_the_verdict(compiled_ms, spread, words):
    result = _result(10.0, compiled_ms, spread, breaks_found=2)
    text = result.describe()
    assert f"break-even: {words}" in text, text
    assert "torch.compile(model)" not in text and "set_stance" not in text, text
    assert ("never" in text) != ("can't tell yet" in text), text  # the verdict's own words, not both
    assert "remove the 2 graph break(s)" in text and result.code_lines()[0].startswith("#"), result.code_lines()


@pytest.mark.parametrize("warm_s, kept", [(0.999, True), (1.0, False), (1.5, False)])
def test_keeping_the_caches_is_advised_where_the_warm_compile_is_under_half_the_cold_one(warm_s, kept):
    lines = _result(10.0, 5.0, 0.02, warm_s=warm_s).code_lines()  # the cold compile: 2.0 s
    assert any("TORCHINDUCTOR_CACHE_DIR" in line for line in lines) == kept, lines
