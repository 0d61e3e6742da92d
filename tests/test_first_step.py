"""The first-step studies' plumbing: fresh processes with their own caches, break-evens, start tables, streams."""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from optlab.core.errors import OptlabError
from optlab.core.gpt.transformer import GPT, GPTConfig
from optlab.studies.first_step import compile_time, dynamo_log, fresh, recompiles, shapes, starts


@pytest.fixture(scope="module")
def plain_server():
    """One fork server of tests.fresh_probe without a machine folder, for the tests that only start children on it
    (its start is most of their time): each child gets folders of its own, and a failed child leaves the server
    serving as before (checked below), so no test depends on what another started on it."""
    if not fresh.forks_possible():
        pytest.skip("starts are forked on Linux without a GPU only")
    with fresh.ForkServer("tests.fresh_probe") as server:
        yield server


@pytest.mark.parametrize("forked", [False, True], ids=["own process", "forked"])
def test_a_fresh_process_keeps_every_cache_inside_its_folder(request, tmp_path, forked):
    """Started on its own or forked by a server that probed nothing, a start keeps its caches in its own folder and
    does not know the CPU's vector instructions. A fork server's second child gets its own folders too (a second
    process of its own would repeat the first: a new interpreter each time)."""
    server = request.getfixturevalue("plain_server") if forked else None
    for start in ("first", "second") if forked else ("first",):
        cache = fresh.CacheFolder(tmp_path / start, tmp_path / "headers")
        seen = fresh.run_fresh("tests.fresh_probe:where", {}, cache, cold=True, forks=server)
        for name in ("inductor", "triton", "headers", "tmp"):
            assert seen[name].startswith(str(cache.path)), (name, seen[name])
        assert seen["cache_files_before"] == 0 and seen["process_s"] > 0 and seen["pid"] != os.getpid()
        assert not seen["probed"], seen
    if forked:
        assert server.probe_s is None  # no machine folder: nothing probed, none known


def test_a_forked_start_that_fails_says_why_and_the_server_goes_on(plain_server, tmp_path):
    with pytest.raises(OptlabError, match=r"failed \(exit 1\): ValueError: no such start"):
        fresh.run_fresh("tests.fresh_probe:fail", {}, fresh.CacheFolder(tmp_path / "a"), cold=True,
                        forks=plain_server)
    seen = fresh.run_fresh("tests.fresh_probe:where", {}, fresh.CacheFolder(tmp_path / "b"), cold=True,
                           forks=plain_server)
    assert seen["tmp"].startswith(str(tmp_path / "b"))


def test_a_fork_server_refuses_a_module_that_fixes_its_cache_folders_on_import():
    with fresh.ForkServer("torch._inductor.codecache") as server, \
            pytest.raises(OptlabError, match="fork server .* ended .*fixes its cache folders when imported"):
        server.run("tests.fresh_probe:where", {}, dict(os.environ))


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
def test_a_probing_fork_server_s_children_know_the_cpu_and_share_its_headers_and_leave_its_folder_alone(tmp_path):
    """The parent probes the CPU's vector instructions once, in its own folder: each child starts knowing them (it
    builds no probe of its own; a plain server's child knows none: the test above), puts its caches in its own folder
    and its headers in the shared one; a child that writes into the parent's folder is seen."""
    if not fresh.forks_possible():
        pytest.skip("starts are forked on Linux without a GPU only")
    headers = tmp_path / "headers"
    with fresh.ForkServer("tests.fresh_probe", machine=fresh.CacheFolder(tmp_path / "machine", headers)) as server:
        assert server.probe_s > 0 and server.ready()["machine_files"] > 0
        cache = fresh.CacheFolder(tmp_path / "start", headers)
        seen = fresh.run_fresh("tests.fresh_probe:where", {}, cache, cold=True, forks=server)
        assert seen["probed"] and seen["inductor"].startswith(str(cache.path)), seen
        assert Path(seen["headers"]).resolve() == headers.resolve() and seen["cache_files_after"] == 0
        assert server.machine_untouched()
        fresh.run_fresh("tests.fresh_probe:write_into", {"path": str(tmp_path / "machine" / "stray")},
                        fresh.CacheFolder(tmp_path / "stray"), cold=True, forks=server)
        assert not server.machine_untouched()


def test_a_fork_server_s_machine_folder_must_name_the_shared_headers(tmp_path):
    with pytest.raises(OptlabError, match="machine folder .* names no shared headers folder"):
        fresh.ForkServer("tests.fresh_probe", machine=fresh.CacheFolder(tmp_path / "machine"))


def test_shared_headers_are_linked_in_and_not_counted_as_the_folders_files(tmp_path):
    headers = tmp_path / "headers"
    cache = fresh.CacheFolder(tmp_path / "start", headers)
    cache.prepare()
    (headers / "built.h.gch").write_text("a precompiled header")
    (cache.path / "fxgraph").mkdir()
    (cache.path / "fxgraph" / "entry").write_text("a graph")
    links = [path for path in cache.path.rglob("precompiled_headers")]
    assert len(links) == 1 and links[0].resolve() == headers.resolve()
    assert cache.files() == 1


def test_a_cold_start_refuses_a_folder_that_holds_files(tmp_path):
    cache = fresh.CacheFolder(tmp_path / "used")
    (cache.path / "fxgraph").mkdir(parents=True)
    (cache.path / "fxgraph" / "entry").write_text("compiled before")
    assert cache.files() == 1
    with pytest.raises(OptlabError, match="empty cache folder.*1 files"):
        fresh.run_fresh("tests.fresh_probe:where", {}, cache, cold=True)


def test_break_even_is_the_cost_over_the_saving_with_an_interval_around_it():
    extra = np.array([9.0, 10.0, 12.0, 11.0])
    eager = np.array([0.020, 0.021, 0.019, 0.020])
    compiled = np.array([0.010, 0.0102, 0.0097, 0.0101])
    point, low, high = compile_time.break_even(extra, eager, compiled)
    ratio = math.exp(np.mean(np.log(eager / compiled)))
    assert point == pytest.approx(np.median(extra) / (np.median(eager) * (1 - 1 / ratio)), rel=1e-6)
    assert low < point < high < math.inf


def test_a_start_that_is_not_faster_never_breaks_even():
    extra = np.array([9.0, 10.0, 12.0])
    point, low, high = compile_time.break_even(extra, np.array([0.01, 0.011, 0.0105]), np.array([0.012, 0.0125, 0.013]))
    assert point == math.inf and high == math.inf


def _rows() -> pd.DataFrame:
    """Three rounds of the five starts, eager's listed in another order: the tables must pair by round."""
    rows = []
    firsts = {compile_time.EAGER: [1.0, 1.2, 1.1], compile_time.COLD: [40.0, 50.0, 45.0],
              compile_time.WARM: [8.0, 9.5, 8.8], compile_time.PORTABLE: [10.0, 11.0, 10.4],
              compile_time.REGIONAL: [20.0, 26.0, 22.0]}
    for start, values in firsts.items():
        for round_, first in enumerate(values):
            rows.append({"round": round_, "start": start, "first_step_s": first,
                         "step_s": 0.01 * (1 + 0.1 * round_) * (1.0 if start == compile_time.EAGER else 0.8),
                         "graphs": 0 if start == compile_time.EAGER else 1, "cache_hits": 0, "cache_misses": 0})
    frame = pd.DataFrame(rows)
    eager = frame["start"] == compile_time.EAGER
    return pd.concat([frame[~eager], frame[eager].iloc[[2, 0, 1]]])  # eager's rounds in another order


def test_the_start_table_pairs_each_start_with_eager_of_its_own_round():
    table = compile_time.start_table(_rows())
    assert table.loc[compile_time.COLD, "compile s"] == pytest.approx(np.median([39.0, 48.8, 43.9]))
    assert table.loc[compile_time.EAGER, "verdict"] == "baseline"
    assert table.loc[compile_time.REGIONAL, "speed-up"] == pytest.approx(1.25)
    claims = compile_time.start_verdicts(_rows()).set_index("start")
    assert claims.loc[compile_time.REGIONAL, "times shorter"] == pytest.approx(
        math.exp(np.mean(np.log(np.array([40.0, 50.0, 45.0]) / np.array([20.0, 26.0, 22.0])))))
    assert claims.loc[compile_time.WARM, "verdict"] == "faster"


def test_rounds_and_steps_are_bounded():
    with pytest.raises(OptlabError, match="at most 20"):
        compile_time.run_starts("gpt", rounds=21)
    with pytest.raises(OptlabError, match="at least 2"):
        compile_time.run_starts("gpt", rounds=1)
    with pytest.raises(OptlabError, match="unknown model 'bert'"):
        compile_time.run_starts("bert")


def test_a_stream_changes_shape_and_buckets_count_their_padding():
    stream = shapes.Stream(batches=40, max_batch=4, min_len=5, buckets=(8, 16, 32))
    drawn = stream.shapes()
    assert drawn == stream.shapes() and len(set(drawn)) > 10
    assert {n for n, _ in drawn} == {2, 3, 4} and min(t for _, t in drawn) >= 5 and max(t for _, t in drawn) <= 32
    assert [stream.bucket(t) for t in (5, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    with pytest.raises(OptlabError, match="at most 500"):
        shapes.Stream(batches=501)
    with pytest.raises(OptlabError, match="at most 50"):
        shapes.run_shapes(stream, passes=51)


def test_the_cuda_graph_strategy_keeps_each_answer_though_each_replay_reuses_the_output_memory(monkeypatch):
    """CUDA graphs replay a bucket's graph into the same output memory: each batch's answer is copied out before the
    next step (else every kept answer is the last one of its bucket, or cudagraph trees raise on reading it), and
    each call is marked as a new step. Emulated here on the CPU with a model that answers into one buffer a shape."""
    steps = []

    def replaying(forward, dynamic=None, mode=None):
        assert mode == "reduce-overhead" and dynamic is False
        outputs = {}

        def replay(x):
            out = outputs.setdefault(tuple(x.shape), torch.empty(*x.shape, model.config.vocab_size))
            return out.copy_(forward(x))
        return replay

    monkeypatch.setattr(shapes.torch, "compile", replaying)
    monkeypatch.setattr(shapes.torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    stream = shapes.Stream(batches=6, max_batch=3, buckets=(8, 16))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=stream.vocab_size, block_size=16, n_layer=1, n_head=1, n_embd=8)).eval()
    row = shapes.stream_run(model, shapes.GRAPHS, stream, passes=2)
    assert row["max_logit_diff"] < 1e-5 and len(steps) == 3 * stream.batches, (row["max_logit_diff"], len(steps))


def test_the_timed_passes_run_in_rounds_each_timing_every_strategy_after_all_have_compiled(monkeypatch):
    visits = []

    class Visited:
        def __init__(self, model, strategy, setup):
            self.strategy = strategy

        def first_pass(self):
            visits.append(("first", self.strategy))

        def timed_pass(self):
            visits.append(("timed", self.strategy))

        def row(self):
            return {"strategy": self.strategy, "status": "ok"}

    monkeypatch.setattr(shapes, "StreamRun", Visited)
    rows = shapes.run_shapes(shapes.Stream(batches=2, n_layer=1, n_embd=8), passes=4)
    ran = [name for name in shapes.STRATEGIES if name not in shapes.NEEDS_CUDA or torch.cuda.is_available()]
    k = len(ran)
    assert visits[:k] == [("first", name) for name in ran] and rows["strategy"].tolist() == list(shapes.STRATEGIES)
    timed = [name for kind, name in visits[k:]]
    assert len(timed) == 4 * k and all(sorted(timed[i * k:(i + 1) * k]) == sorted(ran) for i in range(4)), timed
    assert timed[:k] != timed[k:2 * k], timed  # the order turns from round to round


def test_the_shape_table_reads_compile_seconds_waste_and_rate_from_the_runs():
    rows = pd.DataFrame([
        {"strategy": shapes.EAGER, "status": "ok", "first_pass_s": 0.5, "pass_times_s": [0.4, 0.42, 0.41],
         "graphs": 0, "tokens": 1000, "padded_tokens": 0},
        {"strategy": shapes.BUCKETS, "status": "ok", "first_pass_s": 10.2, "pass_times_s": [0.2, 0.21, 0.19],
         "graphs": 2, "tokens": 1000, "padded_tokens": 600},
        {"strategy": shapes.GRAPHS, "status": "not run: CUDA graphs need a CUDA GPU"}])
    table = shapes.shape_table(rows)
    assert table.loc[shapes.BUCKETS, "compile s"] == pytest.approx(10.0)
    assert table.loc[shapes.BUCKETS, "wasted %"] == pytest.approx(37.5)
    assert table.loc[shapes.BUCKETS, "tokens/s"] == pytest.approx(5000.0)
    assert table.loc[shapes.GRAPHS, "verdict"].startswith("not run")


def test_rounds_side_by_side_keep_each_round_s_starts_in_order_and_apart(monkeypatch, tmp_path):
    """Two rounds at once: each round's five starts run one after another in its own folders, the cold start's
    artifacts go to its own round's portable start, and the rows come back by round."""
    calls = []

    def fake_run(function, kwargs, cache, cold, settings=None, forks=None, stop=None):
        calls.append((function, kwargs, str(cache.path)))
        return {"headers_s": 1.0} if function.endswith("build_headers") else {"step_times_s": [0.1, 0.3],
                                                                                 "first_step_s": 1.0}

    monkeypatch.setattr(fresh, "run_fresh", fake_run)
    monkeypatch.setattr(fresh, "forks_possible", lambda: False)
    monkeypatch.setattr(compile_time.os, "cpu_count", lambda: 2)
    rows = compile_time.run_starts("gpt", rounds=3, root=tmp_path, rounds_at_once=2)
    assert rows["round"].tolist() == [r for r in range(3) for _ in compile_time.STARTS]
    assert rows["start"].tolist() == list(compile_time.STARTS) * 3
    for round_ in range(3):
        mine = [kwargs for _, kwargs, path in calls if f"round{round_}" in path]
        assert [kwargs["how"] for kwargs in mine] == [how for how, _, _ in compile_time.STARTS.values()]
        saved = {kwargs["save_to"] for kwargs in mine} - {None}
        loaded = {kwargs["artifacts"] for kwargs in mine} - {None}
        assert saved == loaded == {str(tmp_path / f"round{round_}-artifacts.bin")}
    with pytest.raises(OptlabError, match=r"rounds_at_once 3 .* at most 2 \(rounds side by side"):
        compile_time.run_starts("gpt", rounds=3, root=tmp_path, rounds_at_once=3)


@pytest.mark.parametrize("ending", ["finished", "a start failed"])
def test_the_starts_own_temporary_folder_is_removed_when_they_end_and_a_given_one_kept(monkeypatch, tmp_path, ending):
    """Without a ``root`` the starts compile into a temporary folder of their own, gone once the study ends, however
    it ends; a folder the caller gave is the caller's and stays."""
    def fake_run(function, kwargs, cache, cold, settings=None, forks=None, stop=None):
        cache.path.mkdir(parents=True, exist_ok=True)
        (cache.path / "kernel.so").write_bytes(b"compiled")
        if ending != "finished" and kwargs.get("how") == "portable":
            raise OptlabError("the start failed")
        return {"headers_s": 1.0, "first_step_s": 1.0, "step_times_s": [0.1]}

    monkeypatch.setattr(fresh, "run_fresh", fake_run)
    monkeypatch.setattr(fresh, "forks_possible", lambda: False)
    monkeypatch.setattr(compile_time.tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    if ending == "finished":
        rows = compile_time.run_starts("gpt", rounds=2)
        assert rows["cache_folder"].str.startswith(str(tmp_path / "temp" / "optlab-first-step-")).all()
        compile_time.run_starts("gpt", rounds=2, root=tmp_path / "mine")
        folders = {folder for _, folder, _ in compile_time.STARTS.values()}
        assert len(list((tmp_path / "mine").glob("round*/*/kernel.so"))) == 2 * len(folders)
    else:
        with pytest.raises(OptlabError, match="the start failed"):
            compile_time.run_starts("gpt", rounds=2)
    assert list((tmp_path / "temp").iterdir()) == []


def test_starts_that_wrote_into_a_fork_server_s_machine_folder_are_refused(monkeypatch, tmp_path):
    """A fork server's folder changed after its probe: the starts shared a cache, so the rows are not given back."""
    class Touched:
        probe_s, machine = 2.0, fresh.CacheFolder(tmp_path / "machine")

        def __init__(self, module, settings=None, machine=None, stop=None):
            self.machine = machine

        def machine_untouched(self):
            return False

        def close(self):
            pass

    monkeypatch.setattr(fresh, "ForkServer", Touched)
    monkeypatch.setattr(fresh, "forks_possible", lambda: True)
    monkeypatch.setattr(fresh, "run_fresh", lambda function, *args, **kwargs: {"headers_s": 1.0, "first_step_s": 1.0,
                                                                               "step_times_s": [0.1]})
    with pytest.raises(OptlabError, match=r"wrote into the fork server's machine folder .*/machine: .* none was cold"):
        compile_time.run_starts("gpt", rounds=2, root=tmp_path)


def test_rounds_side_by_side_probe_the_cpu_once_their_second_fork_server_starting_after_the_first_has(monkeypatch,
                                                                                                      tmp_path):
    """Each sequence of rounds has a fork server; they share one machine folder, and the second starts only once the
    first has answered (its probe done), so it finds the CPU's answer there instead of building it again."""
    events = []

    class Server:
        probe_s = 1.0

        def __init__(self, module, settings=None, machine=None, stop=None):
            self.machine, self.number = machine, len([kind for kind, _ in events if kind == "start"])
            events.append(("start", self.number))

        def ready(self):
            events.append(("ready", self.number))

        def machine_untouched(self):
            return True

        def close(self):
            pass

    servers = []
    monkeypatch.setattr(fresh, "ForkServer", lambda *args, **kwargs: servers.append(Server(*args, **kwargs))
                        or servers[-1])
    monkeypatch.setattr(fresh, "forks_possible", lambda: True)
    monkeypatch.setattr(compile_time.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(fresh, "run_fresh", lambda function, *args, **kwargs: {"headers_s": 1.0, "first_step_s": 1.0,
                                                                               "step_times_s": [0.1]})
    rows = compile_time.run_starts("gpt", rounds=2, root=tmp_path, rounds_at_once=2)
    assert len(servers) == 2 and servers[0].machine.path == servers[1].machine.path == tmp_path / "machine"
    assert events[:3] == [("start", 0), ("ready", 0), ("start", 1)], events
    assert rows["forked"].all() and len(rows) == 2 * len(compile_time.STARTS)


def test_dynamo_s_messages_name_files_relative_to_the_working_folder(tmp_path, monkeypatch):
    model = tmp_path / "pkg" / "model.py"
    model.parent.mkdir()
    model.write_text("")
    monkeypatch.chdir(tmp_path)
    message = f"function: 'forward' ({model}:73) last reason: 0/7: size 36/40, gone: /no/such/file.py"
    assert dynamo_log.relative_paths(message) == \
        "function: 'forward' (pkg/model.py:73) last reason: 0/7: size 36/40, gone: /no/such/file.py"


def test_the_recompile_stance_s_error_names_no_absolute_path():
    import torch

    error = recompiles.recompile_error(lambda x: x * 2, torch.ones(3), torch.ones(5))
    assert error.startswith("RuntimeError") and "recompile" in error, error
    assert __file__ not in error and os.path.relpath(__file__) in error, error


def test_the_chapters_check_a_gpu_s_path_small_and_end_within_minutes_on_a_reader_s_gpu(monkeypatch):
    """gpu-check runs chapters 34 and 36 in the smoke profile on a GPU: a small GPT, two rounds, no ResNet18; a
    reader's GPU (any other profile) gets the small GPT within a deadline of minutes (GPT-2 small's fifty cold starts
    took tens of minutes); a CPU never runs more rounds side by side than cores."""
    smoke, quick = compile_time.chapter_plan(True, "smoke"), compile_time.chapter_plan(True, "quick")
    assert (smoke.size, smoke.rounds, smoke.cnn) == ("small", 2, False) and (quick.size, quick.cnn) == ("small", False)
    assert all(plan.deadline_s is not None and plan.deadline_s <= 300 for plan in (smoke, quick))
    monkeypatch.setattr(compile_time.os, "cpu_count", lambda: 1)
    cpu = compile_time.chapter_plan(False, "smoke")
    assert (cpu.size, cpu.phase, cpu.at_once) == ("tiny", "forward", 1) and "GPT only" in cpu.describe()
    assert shapes.chapter_stream(True, "smoke")[0].n_embd < shapes.chapter_stream(True, "full")[0].n_embd == 768
    assert shapes.chapter_stream(False, "full") == (shapes.CPU_STREAM, 5)


def test_each_start_size_builds_its_own_gpt_and_an_unknown_size_is_refused_before_any_start():
    """The CPU's page compiles the fewest blocks that still repeat (2), a GPU's page 4, the reference run GPT-2
    small's 12; a size outside these is refused by name, before a process starts."""
    blocks = {size: len(starts.build("gpt", size)[1]) for size in ("tiny", "small")}
    assert blocks == {"tiny": 2, "small": 4}
    for call in (lambda: starts.build("gpt", "medium"), lambda: compile_time.run_starts("gpt", size="medium")):
        with pytest.raises(OptlabError, match="unknown size 'medium'; choose one of: tiny, small, real"):
            call()


def _rescaled(x):
    scale = x.abs().mean().item()  # a Python float the graph is specialized on: a new value, a new graph
    if scale > 10:
        return x / scale
    return x


def test_a_guard_on_a_python_value_is_named_with_its_source_line_and_whole_file():
    """Dynamo's guard comment cuts the file to its last characters; the guard named in a report has the source line
    and the file and line from the failure's stack, relative to the working folder."""
    seen = recompiles.watch(_rescaled, [torch.full((4,), value) for value in (11.0, 12.0, 13.0)])
    guard = recompiles.first_guard(seen.reasons[-1])
    line = _rescaled.__code__.co_firstlineno + 2
    assert guard.endswith(f"(`if scale > 10:` at {os.path.relpath(__file__)}:{line})"), guard
    assert recompiles.first_guard("0/2: tensor 'x' size mismatch at index 1. expected 5, actual 8; other") == \
        "tensor 'x' size mismatch at index 1. expected 5, actual 8"


# --- the starts end at a deadline or a signal, not after every queued round ---------------------------------------

class _Ended(Exception):
    """What the test's alarm raises in the main thread, as the reference run's signal handler does."""


def _sleepy_run(seconds_by_round):
    """A stand-in for ``fresh.run_fresh`` whose start sleeps as its round says, ending early, as a killed process
    does, when its ``stop`` comes."""
    def run(function, kwargs, cache, cold, settings=None, forks=None, stop=None):
        if function.endswith("build_headers"):
            return {"headers_s": 0.0}
        if stop is not None:
            stop.check()
        round_ = int(next(part for part in cache.path.parts if part.startswith("round"))[len("round"):])
        end = time.monotonic() + seconds_by_round(round_)
        while time.monotonic() < end:
            if stop is not None and stop.why:
                raise fresh.StartsStopped(stop.why)
            time.sleep(0.02)
        return {"step_times_s": [0.1, 0.1], "first_step_s": 1.0}
    return run


def test_a_signal_ends_the_starts_at_once_not_after_every_queued_round(monkeypatch, tmp_path):
    """Four rounds of five 2 s starts are queued; a signal after 0.5 s ends the study within seconds (the round in
    flight used to run all its starts first: 10 s, minutes on a GPU)."""
    monkeypatch.setattr(fresh, "run_fresh", _sleepy_run(lambda round_: 2.0))
    monkeypatch.setattr(fresh, "forks_possible", lambda: False)

    def alarm(signum, frame):
        raise _Ended()

    before = signal.signal(signal.SIGALRM, alarm)
    began = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(_Ended):
            compile_time.run_starts("gpt", rounds=4, root=tmp_path)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert time.monotonic() - began < 4


def test_rounds_past_the_deadline_are_ended_and_the_finished_ones_kept(monkeypatch, tmp_path):
    monkeypatch.setattr(fresh, "run_fresh", _sleepy_run(lambda round_: 0.01 if round_ < 2 else 60.0))
    monkeypatch.setattr(fresh, "forks_possible", lambda: False)
    began = time.monotonic()
    rows = compile_time.run_starts("gpt", rounds=4, root=tmp_path, deadline_s=1.5)  # rounds 0 and 1 take 0.1 s
    assert 1.5 <= time.monotonic() - began < 6.5  # a deadline kept 5x late fails here
    assert sorted(set(rows["round"])) == [0, 1] and rows.attrs["stopped"] == "2 of 4 rounds: stopped at its deadline"
    with pytest.raises(OptlabError, match=r"0 of 2 rounds of gpt's starts finished before its deadline"):
        monkeypatch.setattr(fresh, "run_fresh", _sleepy_run(lambda round_: 60.0))
        compile_time.run_starts("gpt", rounds=2, root=tmp_path / "again", deadline_s=0.5)


SLOW_START = "import time\n\ndef start():\n    time.sleep(60)\n    return {}\n"


@pytest.mark.parametrize("forked", [False, True])
def test_a_stop_kills_a_fresh_start_in_flight_with_or_without_a_fork_server(monkeypatch, tmp_path, forked):
    """A real process that would run 60 s ends within seconds of the stop, whether started on its own or forked."""
    (tmp_path / "slow_start.py").write_text(SLOW_START)
    monkeypatch.syspath_prepend(str(tmp_path))
    stop = fresh.Stop()
    server = fresh.ForkServer("slow_start", stop=stop) if forked else None
    threading.Timer(2.0, stop.stop, args=("the test",)).start()
    began = time.monotonic()
    try:
        with pytest.raises(fresh.StartsStopped, match="the test"):
            fresh.run_fresh("slow_start:start", {}, fresh.CacheFolder(tmp_path / "cache"), cold=True, forks=server,
                            stop=stop)
    finally:
        if server is not None:
            server.close()
    assert time.monotonic() - began < 20


def test_the_reference_part_of_the_starts_is_bounded_inside_its_estimate():
    from optlab.commands.reference.costs import TABLE_S

    assert compile_time.REFERENCE_DEADLINE_S < TABLE_S["compile_time"] <= 240


def test_the_headers_build_probes_the_cpu_in_the_process_s_own_cache_folder_not_in_the_fresh_one(monkeypatch,
                                                                                                  tmp_path):
    """Inductor keeps its probe of the CPU's vector instructions in the cache folder it probed in: ``build_headers``
    probes before it opens its fresh cache, so the machine's folder keeps the answer for every later process."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    probed_in = []
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: probed_in.append(cache_dir()))
    monkeypatch.setattr(torch, "compile", lambda fn: fn)  # the probe is the question here, not the compile
    assert starts.build_headers("cpu")["headers_s"] >= 0
    assert probed_in == [str(tmp_path)], probed_in
