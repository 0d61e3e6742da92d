import gc

import pytest
import torch

from optlab.core import loops, quiet
from optlab.core.errors import OptlabError
from optlab.core.experiments import run_experiment
from optlab.core.limits import cpu_cores
from optlab.core.registry import Experiment
from tests.helpers import TINY


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_thread_count_is_the_one_asked_for_else_one_on_a_cpu_and_torchs_own_on_a_gpu(monkeypatch, threads):
    monkeypatch.delenv(quiet.THREADS_ENV, raising=False)
    torch.set_num_threads(cpu_cores())
    assert quiet.fix_threads(cuda=True) == cpu_cores()
    assert quiet.fix_threads(cuda=False) == quiet.CPU_THREADS == torch.get_num_threads() == 1
    monkeypatch.setenv(quiet.THREADS_ENV, str(cpu_cores()))
    assert quiet.fix_threads() == cpu_cores() == torch.get_num_threads()


@pytest.mark.parametrize("typed, message", [("0", "at least 1"), ("many", "must be a whole number"),
                                            ("100000", "one thread per core")])
def test_a_thread_count_out_of_bounds_is_refused(monkeypatch, threads, typed, message):
    monkeypatch.setenv(quiet.THREADS_ENV, typed)
    with pytest.raises(OptlabError, match=message):
        quiet.fix_threads()


def test_the_collector_is_off_in_the_window_and_back_after_even_on_error(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    assert gc.isenabled()
    with quiet.gc_paused():
        assert not gc.isenabled() and collected == [1]
    assert gc.isenabled()
    with pytest.raises(ValueError), quiet.gc_paused():
        raise ValueError("a step failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with quiet.gc_paused():
            pass
        assert not gc.isenabled(), "a collector that was off stays off"
    finally:
        gc.enable()


def test_no_step_of_a_timed_pass_runs_with_the_collector_on():
    seen = []

    def step(batch, index):
        seen.append(gc.isenabled())
        return torch.zeros(())

    loops.run_timed(step, [(torch.zeros(1), torch.zeros(1))] * 4, torch.device("cpu"), 3, 1)
    assert seen == [False] * 4 and gc.isenabled()


def test_a_run_states_its_thread_count_and_records_it(monkeypatch, threads, capsys):
    monkeypatch.delenv(quiet.THREADS_ENV, raising=False)
    torch.set_num_threads(cpu_cores())
    run = run_experiment(Experiment("aa", "", "", variants=(("A", {}), ("B", {})), phases=("test",)),
                         profile=TINY.with_sizes(repeats=2, max_repeats=2), device="cpu", progress=False)
    header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("device:")]
    assert header[0].endswith("; 1 torch thread") and run.record["environment"]["torch_threads"] == 1
