"""Guards on what the inference tune reports: request latency's percentiles are the requests' own (p90 is not p50),
a request of batch B takes the whole batch's time (never divided by B), and an example batch of several tensors
reaches the model whole. The clock is a fake one that only the model's calls move, so nothing here depends on the
machine's speed."""
import random

import numpy as np
import pytest
import torch
from torch import nn

import optlab
from optlab.commands.cli import main
from optlab.core.machine import compiler
from optlab.studies.tune import batch_sweep

ROWS, FEATURES, EXTRA, CLASSES = 6, 4, 2, 3


class FakeClock:
    """``time.perf_counter`` for the test: it moves only when a model call says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RowsTakeTime(nn.Module):
    """A linear model whose every call takes ``rows x a skewed draw`` ms on the fake clock (a few calls far slower
    than most, as a server's requests are); each call's batch and duration are logged."""

    def __init__(self, clock: FakeClock, log: list, draws: random.Random) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, CLASSES)
        self.clock, self.log, self.draws = clock, log, draws

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        duration = len(x) * 1e-3 * self.draws.lognormvariate(0.0, 1.0)
        self.clock.now += duration
        self.log.append((len(x), duration))
        return self.linear(x)


@pytest.fixture(scope="module")
def timed_requests():
    """The inference tune with no step to try (only its batch-size sweep and request latency, at batch 1 and 4) on
    the fake clock: the result, and every model call's batch and duration."""
    clock, log, draws = FakeClock(), [], random.Random(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_sweep.time, "perf_counter", clock)
        result = optlab.tune(lambda: RowsTakeTime(clock, log, draws), input_shape=(FEATURES,), inference=True,
                             techniques=(), batch_size=2, max_batch=1, request_batches=(1, 4), request_seconds=0.05,
                             device="cpu", profile="smoke", steps=1, progress=False)
    return result, log


def expected_ms(log: list, batch: int, requests: int) -> np.ndarray:
    """p50, p90, p99 and the interquartile range of the last ``requests`` calls at ``batch`` (the timed requests come
    after their warm-up), in ms."""
    times = [duration for rows, duration in log if rows == batch][-requests:]
    p25, p50, p75, p90, p99 = 1e3 * np.percentile(times, [25, 50, 75, 90, 99])
    return np.array([p50, p90, p99, p75 - p25])


def test_request_latency_reports_each_percentile_of_the_requests_own_times(timed_requests):
    result, log = timed_requests
    latency = result.latency.set_index("batch")
    assert list(latency.index) == [1, 4] and (latency["status"] == "ok").all()
    for batch, row in latency.iterrows():
        want = expected_ms(log, batch, int(row["requests"]))
        assert want[1] > 1.5 * want[0], "the draws are skewed: p90 and p50 must differ for this test to see a swap"
        assert row[["p50_ms", "p90_ms", "p99_ms", "iqr_ms"]].to_numpy(float) == pytest.approx(want)
    table = result.latency_table().set_index("batch")
    for column, key in (("request p50 ms", "p50_ms"), ("request p90 ms", "p90_ms"), ("request p99 ms", "p99_ms")):
        assert table[column].to_numpy(float) == pytest.approx(latency[key].to_numpy(float), abs=1e-3)
    single = latency.loc[1]
    assert (f"request latency at batch 1, starting point: p50 {single.p50_ms:.3g} ms, p90 {single.p90_ms:.3g} ms, "
            f"p99 {single.p99_ms:.3g} ms") in result.describe()


def test_a_request_of_a_batch_takes_the_whole_batchs_time(timed_requests):
    """Latency is per request: a request of 4 rows is 4 rows' time (this model's calls scale with the rows), never
    that divided by 4."""
    result, log = timed_requests
    row = result.latency.set_index("batch").loc[4]
    assert row["p50_ms"] == pytest.approx(expected_ms(log, 4, int(row["requests"]))[0])


class TwoInputNet(nn.Module):
    """``forward(x, y)``: both tensors are needed (a linear map of each, summed). Each call's input shapes are logged
    on the class, whichever instance made it."""

    calls: list = []

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(FEATURES, CLASSES), nn.Linear(EXTRA, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        TwoInputNet.calls.append((tuple(x.shape), tuple(y.shape)))
        return self.first(x) + self.second(y)


def two_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """An example batch of two positional tensors, ``ROWS`` rows each."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, FEATURES, generator=generator), torch.randn(ROWS, EXTRA, generator=generator)


def two_inputs_and_targets() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The same inputs for training, with class labels as targets."""
    return two_inputs(), torch.arange(ROWS) % CLASSES


SMALL = ["--profile", "smoke", "--device", "cpu", "--quiet", "--steps", "1", "--repeats", "2", "--max-repeats", "2",
         "--batch-size", "4", "--model", f"{__name__}:TwoInputNet"]  # this module, as imported: its class logs the calls


@pytest.mark.parametrize("argv, example", [
    (["--inference", "--max-batch", "2", "--request-seconds", "0.01", "--dtype", "none"], "two_inputs"),
    ([], "two_inputs_and_targets"),
], ids=["inference", "training"])
def test_an_example_batch_of_two_tensors_reaches_the_model_whole(argv, example, capsys, monkeypatch):
    monkeypatch.setattr(compiler, "find_cxx", lambda: None)  # the compile steps are skipped, with their reason
    monkeypatch.setattr(TwoInputNet, "calls", [])
    assert main(["tune", *SMALL, *argv, "--example-batch", f"{__name__}:{example}"]) == 0
    out = capsys.readouterr().out
    assert f"your example batch ([{ROWS}, {FEATURES}] float32, [{ROWS}, {EXTRA}] float32)" in out
    if "--inference" in argv:
        assert "outputs = model(*inputs)" in out  # the serving lines call it with both
    assert TwoInputNet.calls, "the model was never called"
    assert all(x[0] == y[0] and x[1:] == (FEATURES,) and y[1:] == (EXTRA,) for x, y in TwoInputNet.calls)
