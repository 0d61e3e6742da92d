import gc
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from optlab.core.measuring import loops
from optlab.core.process import quiet
from optlab.core.errors import OptlabError
from optlab.core.run.experiments import run_experiment
from optlab.core.knobs.limits import cpu_cores
from optlab.core.techniques.registry import Experiment
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


def test_the_noise_benchmark_reads_the_sd_of_the_per_round_log_ratio():
    from benchmarks import noise

    ratios = np.array([1.10, 0.95, 1.02, 0.99])
    rows = [{"phase": "train", "repeat": r, "variant": v, "status": "ok", "epoch_equiv_s": t}
            for r, ratio in enumerate(ratios) for v, t in (("A", 2.0 * ratio), ("A again", 2.0))]
    samples = pd.DataFrame(rows)
    assert noise.round_noise(samples)["train"] == pytest.approx(np.log(ratios).std(ddof=1))
    assert noise.round_noise(samples, skip_first=True)["train"] == pytest.approx(np.log(ratios[1:]).std(ddof=1))
    seen = []
    with noise.collector_paused():
        loops.run_timed(lambda batch, i: seen.append(gc.isenabled()) or torch.zeros(()),
                        [(torch.zeros(1), torch.zeros(1))] * 3, torch.device("cpu"), 2, 1)
    assert len(seen) >= 3 and not any(seen) and gc.isenabled() and loops.timed_pass.__name__ == "timed_pass"


def test_a_run_states_its_thread_count_and_records_it(monkeypatch, threads, capsys):
    monkeypatch.delenv(quiet.THREADS_ENV, raising=False)
    torch.set_num_threads(cpu_cores())
    run = run_experiment(Experiment("aa", "", "", variants=(("A", {}), ("B", {})), phases=("test",)),
                         profile=TINY.with_sizes(repeats=2, max_repeats=2), device="cpu", progress=False)
    header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("device:")]
    assert header[0].endswith("; 1 torch thread") and run.record["environment"]["torch_threads"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the profiler's logs are silenced where there is no GPU")
def test_a_profiled_step_writes_nothing_on_the_processs_stderr():
    # kineto writes its logs to file descriptor 2 (a notebook shows them under the cell), so a fresh process tells
    script = ("import torch, optlab.core\nfrom optlab.core.measuring import memory\n"
              "memory.cpu_step_increase_mb(lambda: torch.ones(64, 64) @ torch.ones(64, 64))\nprint('profiled')")
    env = {key: value for key, value in os.environ.items() if key != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "profiled", done.stderr
    assert done.stderr == ""
