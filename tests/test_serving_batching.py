"""The serving chapter's parts: the request stream, its latency statistics, static and continuous batching."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from optlab.core.errors import OptlabError
from optlab.core.gpt.transformer import GPT, GPTConfig
from optlab.studies.serving import batching, generation
from optlab.studies.serving import requests as rq
from optlab.studies.serving import scheduler


class HashEngine:
    """A stand-in model whose next token is a hash of everything its row holds: a row that is not emptied between
    two requests, or a token fed to the wrong row, changes the tokens."""

    def __init__(self, slots: int, max_len: int = 64, vocab: int = 97) -> None:
        self.slots, self.max_len, self.vocab, self.device = slots, max_len, vocab, torch.device("cpu")
        self.rows: list[list[int]] = [[] for _ in range(slots)]

    def _next(self, slot: int) -> int:
        value = 7
        for token in self.rows[slot]:
            value = (value * 31 + token) % 1_000_003
        return value % self.vocab

    def prefill(self, slot: int, prompt: tuple[int, ...]) -> int:
        self.rows[slot] = list(prompt)
        return self._next(slot)

    def decode(self, tokens: list[int], occupied: list[bool]) -> list[int]:
        assert len(tokens) == len(occupied) == self.slots
        for slot, token in enumerate(tokens):
            self.rows[slot].append(token)
            assert len(self.rows[slot]) <= self.max_len, "a row outgrew the cache"
        outputs = [self._next(slot) for slot in range(self.slots)]
        for slot in range(self.slots):
            if not occupied[slot]:
                self.rows[slot].pop()  # computed, then rolled back
        return outputs

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self.rows[slot] = []


def fixed_cost(function):
    """A timer that charges every prefill or decode step 10 ms: the schedule, not the machine, sets the clock."""
    return function(), 0.01


def alone(request: rq.Request) -> list[int]:
    """The request's tokens served by itself, one slot."""
    run = scheduler.serve([rq.Request(0, 0.0, request.prompt, request.output_len)], HashEngine(1), "continuous",
                          fixed_cost)
    return run.served[0].tokens


@pytest.mark.parametrize("name", scheduler.SCHEDULERS)
@pytest.mark.parametrize("rate", [5.0, 50.0, 500.0])
def test_every_request_served_once_with_its_own_tokens(name: str, rate: float) -> None:
    stream = rq.poisson_stream(rate, 40, prompt_lengths=(2, 12), output_lengths=(1, 20), vocab_size=97, seed=3)
    engine = HashEngine(4)
    run = scheduler.serve(stream, engine, name, fixed_cost)
    assert [item.request.index for item in run.served] == list(range(40))
    assert engine.rows == [[]] * 4  # every request left its row empty
    for item in run.served:
        assert item.tokens == alone(item.request), item.request.index
        assert all(item.request.arrival_s <= t for t in item.token_times_s)
        assert item.token_times_s == sorted(item.token_times_s)
    assert max(run.occupancy) <= 4


def test_continuous_batching_waits_less_than_static_under_load() -> None:
    stream = rq.poisson_stream(200.0, 60, output_lengths=(2, 30), seed=1)
    latency = {name: rq.latency_frame(scheduler.serve(stream, HashEngine(4), name, fixed_cost).served)
               for name in scheduler.SCHEDULERS}
    assert latency["continuous"]["e2e_s"].mean() < latency["static"]["e2e_s"].mean()
    assert latency["continuous"]["ttft_s"].median() < latency["static"]["ttft_s"].median()


def test_static_batch_holds_its_slots_until_its_longest_request_ends() -> None:
    stream = [rq.Request(0, 0.0, (1, 2), 10), rq.Request(1, 0.0, (3,), 2), rq.Request(2, 0.001, (4,), 2)]
    static = scheduler.serve(stream, HashEngine(2), "static", fixed_cost).served
    continuous = scheduler.serve(stream, HashEngine(2), "continuous", fixed_cost).served
    # static: request 2 is prefilled after request 0's nine decode steps; continuous: as soon as request 1 leaves
    assert static[2].token_times_s[0] == pytest.approx(0.01 * (2 + 9 + 1))
    assert continuous[2].token_times_s[0] == pytest.approx(0.01 * (2 + 1 + 1))


def test_idle_server_jumps_to_the_next_arrival() -> None:
    stream = [rq.Request(0, 5.0, (1,), 3)]
    run = scheduler.serve(stream, HashEngine(2), "continuous", fixed_cost)
    assert run.served[0].token_times_s == pytest.approx([5.01, 5.02, 5.03])
    assert run.compute_s == pytest.approx(0.03)


def test_stream_is_seeded_poisson_with_lengths_in_range() -> None:
    stream = rq.poisson_stream(20.0, 2000, prompt_lengths=(3, 9), output_lengths=(2, 5), seed=7)
    assert stream == rq.poisson_stream(20.0, 2000, prompt_lengths=(3, 9), output_lengths=(2, 5), seed=7)
    gaps = np.diff([0.0] + [request.arrival_s for request in stream])
    assert gaps.min() > 0 and abs(gaps.mean() - 1 / 20) < 0.005  # mean gap 1/rate (sd of the mean 0.0011)
    assert abs(np.std(gaps) / np.mean(gaps) - 1) < 0.1  # exponential gaps: sd equals the mean
    assert {len(r.prompt) for r in stream} == set(range(3, 10)) and {r.output_len for r in stream} == set(range(2, 6))
    text = torch.arange(100)
    windowed = rq.poisson_stream(1.0, 20, prompt_lengths=(3, 9), text=text, seed=0)
    assert all(np.all(np.diff(r.prompt) == 1) for r in windowed)  # consecutive windows of the text


@pytest.mark.parametrize("kwargs, message", [({"rate": 0}, "rate"), ({"count": 0}, "count"),
                                             ({"count": rq.MAX_REQUESTS + 1}, "at most"),
                                             ({"prompt_lengths": (5, 4)}, "prompt_lengths"),
                                             ({"output_lengths": (1,)}, "pair")])
def test_stream_rejects_bad_input(kwargs: dict, message: str) -> None:
    arguments = {"rate": 1.0, "count": 5} | kwargs
    with pytest.raises(OptlabError, match=message):
        rq.poisson_stream(**arguments)


def served(arrival: float, times: list[float]) -> rq.Served:
    item = rq.Served(rq.Request(0, arrival, (1, 2), len(times)))
    for time in times:
        item.emit(1, time)
    return item


def test_latencies_of_one_request() -> None:
    frame = rq.latency_frame([served(1.0, [1.5, 1.7, 2.1]), served(2.0, [2.25])])
    assert frame["ttft_s"].tolist() == pytest.approx([0.5, 0.25])
    assert frame["tpot_s"].iloc[0] == pytest.approx(0.3) and math.isnan(frame["tpot_s"].iloc[1])
    assert frame["e2e_s"].tolist() == pytest.approx([1.1, 0.25])
    with pytest.raises(OptlabError, match="output tokens"):
        rq.latency_frame([rq.Served(rq.Request(0, 0.0, (1,), 3))])


def one_round(ttfts: list[float], gaps: list[list[float]]) -> list[rq.Served]:
    """Requests arriving at 1 s intervals, each with its TTFT and the gaps between its later tokens."""
    rounds = []
    for index, (ttft, request_gaps) in enumerate(zip(ttfts, gaps)):
        times = list(np.cumsum([index + ttft, *request_gaps]))
        item = rq.Served(rq.Request(index, float(index), (1, 2), len(times)))
        for time in times:
            item.emit(1, time)
        rounds.append(item)
    return rounds


def test_percentiles_are_taken_over_each_round_s_requests_then_the_median_over_rounds() -> None:
    quiet = [0.01 * (i + 1) for i in range(10)]  # 10 .. 100 ms
    slow = quiet[:9] + [2.0]  # one request waited 2 s in this round
    gaps = [[0.001, 0.003]] * 9 + [[0.002]]
    rounds = [one_round(quiet, gaps), one_round(slow, gaps), one_round(slow, gaps)]
    table = rq.round_percentiles(rounds).set_index("metric")
    each = [1e3 * np.percentile(values, 99) for values in (quiet, slow, slow)]
    assert table.loc["TTFT", "p99 ms"] == pytest.approx(np.median(each))  # 1,811 ms, not the quiet round's 99
    assert table.loc["TTFT", ["p99 low", "p99 high"]].tolist() == pytest.approx([min(each), max(each)])
    assert table.loc["TTFT", "pooled p99 ms"] == pytest.approx(1e3 * np.percentile(quiet + slow + slow, 99))
    # ITL: every gap of every request pooled (19 gaps a round), not a request's mean
    itl = [0.001, 0.003] * 9 + [0.002]
    assert table.loc["ITL", "values"] == 19
    assert table.loc["ITL", "p90 ms"] == pytest.approx(1e3 * np.percentile(itl, 90))
    assert table.loc["TPOT", "p50 ms"] == pytest.approx(2.0)  # every request's mean gap is 2 ms
    assert table.loc["E2E", "rounds"] == 3 and table.loc["TTFT", "values"] == 10
    with pytest.raises(OptlabError, match="at least one round"):
        rq.round_percentiles([])


def test_the_rounds_range_covers_the_median_at_its_stated_rate() -> None:
    assert rq.range_coverage(4) == pytest.approx(0.875) and rq.range_coverage(6) == pytest.approx(1 - 1 / 32)
    rng = np.random.default_rng(1)
    for rounds in (3, 4, 6):  # over many draws, not one: a rate within the binomial noise of 4000 draws
        draws = rng.standard_normal((4000, rounds))
        covered = np.mean((draws.min(axis=1) <= 0) & (0 <= draws.max(axis=1)))
        assert abs(covered - rq.range_coverage(rounds)) < 0.025, (rounds, covered)


def test_throughput_counts_from_the_first_arrival_of_a_stream_that_starts_late() -> None:
    frame = rq.latency_frame([served(100.0, [100.1, 100.2, 100.3]), served(100.5, [100.9, 101.0]),
                              served(101.0, [101.1, 101.2])])
    result = rq.throughput(frame, rq.Objective(ttft_s=0.2, tpot_s=0.15))
    assert result["span_s"] == pytest.approx(1.2)  # 100.0 to 101.2, not 0 to 101.2
    assert result["tokens_per_s"] == pytest.approx(7 / 1.2) and result["requests_per_s"] == pytest.approx(3 / 1.2)
    assert result["goodput_per_s"] == pytest.approx(2 / 1.2)  # the second request's TTFT (0.4 s) misses


def test_throughput_and_goodput() -> None:
    frame = rq.latency_frame([served(0.0, [0.1, 0.2, 0.3]), served(0.5, [0.9, 1.0]), served(1.0, [1.2])])
    objective = rq.Objective(ttft_s=0.2, tpot_s=0.15)
    result = rq.throughput(frame, objective)
    assert result["span_s"] == pytest.approx(1.2) and result["tokens_per_s"] == pytest.approx(6 / 1.2)
    assert result["goodput_per_s"] == pytest.approx(2 / 1.2)  # the second request's TTFT (0.4 s) misses
    assert result["met_share"] == pytest.approx(2 / 3)
    with pytest.raises(OptlabError, match="ttft_s"):
        rq.Objective(ttft_s=0, tpot_s=1.0)


def test_same_seed_same_requests_at_every_rate() -> None:
    slow, fast = (rq.poisson_stream(rate, 50, seed=2) for rate in (1.0, 4.0))
    assert [(r.prompt, r.output_len) for r in slow] == [(r.prompt, r.output_len) for r in fast]
    assert [4 * r.arrival_s for r in fast] == pytest.approx([r.arrival_s for r in slow])


@pytest.fixture(scope="module")
def model() -> GPT:
    """Weights drawn wider than GPT-2's init, so that the greedy tokens depend on the whole context."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=50, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        for parameter in gpt.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3)
    return gpt


@pytest.mark.parametrize("name", scheduler.SCHEDULERS)
def test_gpt_engine_serves_each_request_its_own_greedy_tokens(model: GPT, name: str) -> None:
    stream = rq.poisson_stream(1e4, 12, prompt_lengths=(3, 10), output_lengths=(1, 12), vocab_size=50, seed=4)
    engine = scheduler.GPTEngine(model, 3, 24)
    run = scheduler.serve(stream, engine, name, fixed_cost)
    assert len(run.served) == 12 and max(run.occupancy) == 3
    assert engine.cache.lengths.tolist() == [0, 0, 0]  # every request left its row empty
    for item in run.served:
        prompt = torch.tensor([item.request.prompt])
        reference = generation.greedy_reference(model, prompt, item.request.output_len)[0, prompt.size(1):]
        assert item.tokens == reference.tolist(), item.request.index


def test_a_request_longer_than_the_cache_is_refused(model: GPT) -> None:
    with pytest.raises(OptlabError, match="more than the engine's cache holds"):
        scheduler.serve([rq.Request(0, 0.0, (1,) * 20, 10)], scheduler.GPTEngine(model, 2, 24), "static")


def test_compare_schedulers_tables(model: GPT) -> None:
    streams = {rate: rq.poisson_stream(rate, 10, prompt_lengths=(3, 8), output_lengths=(2, 8), vocab_size=50)
               for rate in (100.0, 1e4)}
    study = scheduler.compare_schedulers(scheduler.GPTEngine(model, 4, 24), streams, rq.Objective(1.0, 1.0), rounds=2)
    latency = study.latency_table()
    assert len(latency) == 2 * 2 * 4 and (latency.xs("E2E", level="metric")["values"] == 10).all()
    assert (study.throughput_table()["met_share"] == 1.0).all() and study.met_share(100.0, "static") == 1.0
    assert study.capacities == []
    verdicts = study.verdicts()
    assert list(verdicts.index) == [100.0, 1e4] and verdicts["verdict"].isin(
        ["faster", "slower", "same within 2 %", "can't tell yet"]).all()
    assert study.slot_shifts[100.0] == [1, -1]


def test_decode_sweep(model: GPT) -> None:
    sweep = batching.decode_sweep(model, (4, 2), context=8, steps=3, rounds=2)
    table = sweep.table()
    assert list(table.index) == [1, 2, 4] and (table["rounds"] == 2).all()
    assert table.loc[4, "KV cache MiB"] == pytest.approx(4 * table.loc[1, "KV cache MiB"])
    assert table.loc[2, "tokens/s"] == pytest.approx(2 / sweep.step_s(2))
    for batch in (2, 4):  # a step of B rows gives B tokens: throughput is B times the TPOT ratio, round by round
        assert table.loc[batch, "throughput x"] == pytest.approx(batch * table.loc[batch, "TPOT x"])
        assert table.loc[batch, "low"] == pytest.approx(batch * table.loc[batch, "TPOT low"])
    assert set(sweep.speedups()["variant"]) == {"batch 2", "batch 4"}
    with pytest.raises(OptlabError, match="context"):
        batching.decode_sweep(model, (2,), context=45, steps=3)


TINY_SETUP = batching.Setup("gpt_tiny", 1, torch.float32, False, (1, 2), 8, 2, 2, 2, 6, (3, 6), (2, 5), (0.5, 2.0), 2,
                            rq.Objective(1.0, 1.0))


def test_capacity_is_measured_in_every_round_and_a_missed_objective_warns(model: GPT) -> None:
    stream = rq.poisson_stream(5.0, 8, prompt_lengths=(3, 6), output_lengths=(2, 5), vocab_size=50)
    waiting = rq.poisson_stream(1.0, 8, prompt_lengths=(3, 6), output_lengths=(2, 5), vocab_size=50)
    strict = rq.Objective(ttft_s=0.015, tpot_s=1.0)  # a prefill alone takes the fixed timer's 10 ms
    engine = HashEngine(2)
    study = scheduler.compare_schedulers(engine, {5.0: stream, 50.0: stream}, strict, rounds=3, timer=fixed_cost,
                                         capacity_requests=waiting)
    assert len(study.capacities) == 3
    # 8 requests waiting on 2 slots, each step 10 ms: capacity from the fixed clock, the same every round
    at_once = [rq.Request(r.index, 0.0, r.prompt, r.output_len) for r in waiting]
    expected = len(waiting) / scheduler.serve(at_once, engine, "continuous", fixed_cost).compute_s
    assert study.capacities == pytest.approx([expected] * 3)
    streams = batching.StreamStudy(expected, [5.0, 50.0], strict, study, stream)
    met = {name: study.met_share(5.0, name) for name in scheduler.SCHEDULERS}
    assert all(share < batching.MET_WARNING for share in met.values())
    assert "fewer than 90 %" in streams.warning() and "5.0 requests/s" in streams.warning()
    # one request a second meets the objective, all at once misses it: the warning reads the lowest rate only
    spaced = [rq.Request(r.index, float(r.index), r.prompt, r.output_len) for r in waiting]
    both = scheduler.compare_schedulers(engine, {1.0: spaced, 1000.0: at_once}, strict, rounds=2, timer=fixed_cost,
                                        capacity_requests=waiting)
    assert both.met_share(1.0, "continuous") == 1.0 and both.met_share(1000.0, "continuous") < 0.5
    assert batching.StreamStudy(expected, [1.0, 1000.0], strict, both, spaced).warning() is None


def test_run_reference_writes_the_chapter_tables(monkeypatch, tmp_path) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()  # the corpus's 65
    monkeypatch.setattr(batching, "setup_for", lambda device: TINY_SETUP)
    monkeypatch.setattr(batching, "trained_gpt", lambda size, steps, device: model)
    paths = batching.run_reference(tmp_path, "cpu")
    assert sorted(path.name for path in paths) == [f"serving-{name}.csv" for name in
                                                   ("decode-sweep", "latency", "throughput", "verdicts")]
    latency = pd.read_csv(tmp_path / "serving-latency.csv")
    assert len(latency) == 2 * 2 * 4 and set(latency["scheduler"]) == set(scheduler.SCHEDULERS)
    assert (latency.query("metric == 'E2E'")["values"] == 6).all()


def test_stored_summary_reads_the_reference_tables(monkeypatch, tmp_path) -> None:
    assert batching.stored_summary(tmp_path) is None
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    monkeypatch.setattr(batching, "setup_for", lambda device: TINY_SETUP)
    monkeypatch.setattr(batching, "trained_gpt", lambda size, steps, device: model)
    batching.run_reference(tmp_path / "H200", "cpu")
    rows = batching.stored_summary(tmp_path).set_index("figure")
    sweep = pd.read_csv(tmp_path / "H200" / "serving-decode-sweep.csv").set_index("batch")
    latency = pd.read_csv(tmp_path / "H200" / "serving-latency.csv")
    assert rows.loc["decode tokens/s, batch 2", "value"] == pytest.approx(sweep.loc[2, "tokens/s"])
    lowest = latency.query("rate == rate.min() and scheduler == 'continuous' and metric == 'TTFT'")
    assert rows.loc[f"TTFT p99, continuous batching at {lowest['rate'].iloc[0]:g} requests/s", "value"] == \
        pytest.approx(lowest["p99 ms"].iloc[0])
    assert set(rows["machine"]) == {"H200"} and len(rows) == 2 + 4
