import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch import nn

import optlab
from optlab.commands.cli import main
from optlab.core.knobs.profiles import get_profile
from optlab.core.techniques.registry import get_experiment
from optlab.core.process.shutdown import ENDING_SIGNALS
from optlab.core.techniques.cnn import SEED_TECHNIQUES
from optlab.core.workload import WORKLOADS, get_workload

ROOT = Path(__file__).resolve().parent.parent


def test_list_shows_the_nine_seed_techniques(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SEED_TECHNIQUES)


@pytest.mark.parametrize("argv, message", [
    (["run", "turbo"], "unknown technique 'turbo'"),
    (["run", "set_to_none", "--models", "alexnet"], "unknown model 'alexnet'"),
    (["run", "set_to_none", "--profile", "fast"], "unknown profile 'fast'"),
    (["run", "set_to_none", "--batch-size", "0"], "batch_size must be at least 1, got 0"),
    (["run", "set_to_none", "--num-workers", "-2"], "num_workers must be at least 0, got -2"),
    (["run", "set_to_none", "--device", "tpu"], "unknown device 'tpu'"),
    (["reference", "--set", "everything"], "unknown technique set 'everything'"),
])
def test_bad_input_is_one_line_not_a_traceback(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optlab: error: ") and message in err and "\n" not in err


def test_run_prints_a_comparison_and_writes_a_record(tmp_path):
    # the README's example, as a user would type it, from a plain checkout with PYTHONPATH
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "optlab", "run", "mixed_precision", "--models", "resnet18", "--profile", "smoke",
         "--out", str(tmp_path), "--quiet", "--repeats", "2", "--max-repeats", "2", "--batch-size", "4", "--steps",
         "1"],  # 16-bit autocast is slow on a CPU: the fewest images and steps that still print a whole comparison
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "profile smoke" in done.stdout and "data source: stand-in" in done.stdout
    assert "; batch 4; " in done.stdout, "the header names the batch size typed, not the profile's"
    assert "speed-up (99.5 % sequential interval)" in done.stdout and "w mixed precision" in done.stdout
    assert "compared with" in done.stdout and "resnet18: " in done.stdout and " repeats, stopped " in done.stdout
    verdicts = {row["verdict"] for row in json.loads(next(tmp_path.glob("*.json")).read_text())["summary"]}
    assert verdicts <= {"baseline", "faster", "slower", "same within 2 %", "can't tell yet"}
    (path,) = tmp_path.glob("mixed_precision-*.json")
    record = json.loads(path.read_text())
    assert record["technique"] == "mixed_precision" and record["profile"]["name"] == "smoke"
    assert {row["model"] for row in record["summary"]} == {"resnet18"}


def cheapest_technique(workload: str) -> str:
    """The registered technique of ``workload`` with the fewest variants x phases that runs on a CPU without
    compiling (the registry's order breaks ties)."""
    from optlab.core.techniques.registry import REGISTRY

    runnable = [e for e in REGISTRY.values() if e.workload == workload and not e.needs_cuda
                and all(knobs.get("compile_mode", "none") == "none" for _, knobs in e.variants)]
    return min(runnable, key=lambda e: len(e.variants) * len(e.phases)).name


PACKAGE_WORKLOADS = sorted(name for name, workload in WORKLOADS.items() if workload.module.startswith("optlab."))


@pytest.mark.beside_the_book_build  # slow, in processes of its own: it fills the wait for the book
@pytest.mark.parametrize("workload", PACKAGE_WORKLOADS)
def test_a_technique_of_every_workload_runs_and_prints_its_unit(workload, tmp_path):
    technique = cheapest_technique(workload)
    model = get_experiment(technique).default_models(get_profile("smoke", False))[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "optlab", "run", technique, "--profile", "smoke", "--device", "cpu", "--models", model,
         "--steps", "1", "--repeats", "2", "--max-repeats", "2", "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "compared with" in line)
    assert f" {get_workload(workload).unit}/s " in f" {header} "
    assert "img/s" not in header and "TFLOP/s" not in header


class SlowMLP(nn.Module):
    """12 features, 4 classes, and a forward that takes 50 ms: a tune is still in flight a while after it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 4)

    def forward(self, x):
        time.sleep(0.05)
        return self.body(x)


@pytest.mark.beside_the_book_build  # slow, in a process of its own: it fills the wait for the book
def test_ctrl_c_ends_a_tune_in_flight_in_one_line_with_exit_130(tmp_path):
    """A real process and signal; the progress bar is shown (no --quiet): the last line must be a line of its own."""
    signum = signal.SIGINT
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    tune = subprocess.Popen(
        [sys.executable, "-m", "optlab", "tune", "--model", "tests.test_cli:SlowMLP", "--input-shape", "12",
         "--num-classes", "4", "--profile", "smoke", "--device", "cpu", "--steps", "5", "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    for line in tune.stdout:  # the header's last line: the steps are being timed
        if line.startswith(b"loss check:"):
            break
    time.sleep(0.5)
    tune.send_signal(signum)
    _, err = tune.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert tune.returncode == 128 + signum, err
    assert err.decode().rstrip("\n").split("\n")[-1] == \
        f"optlab: stopped by {name}: the tune ended before its recommendation, and wrote nothing"
    assert b"Traceback" not in err and not list(tmp_path.iterdir())


class Unhandled(Exception):
    """What a signal raises in this test process where the command left it unhandled."""


@pytest.fixture
def signals_caught():
    """Each ending signal raises :class:`Unhandled` unless the command handles it (so that a command that does not
    fails the test instead of ending pytest), and the handlers come back after."""
    def unhandled(signum, frame):
        raise Unhandled(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, unhandled) for signum in ENDING_SIGNALS}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def signalled(signum: int):
    """A stand-in for a run or a tune that receives ``signum`` while it works."""
    def run(*args, **kwargs):
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises at once
    return run


@pytest.mark.parametrize("signum", ENDING_SIGNALS, ids=lambda signum: signal.Signals(signum).name)
def test_a_signal_during_a_tune_is_one_line_and_128_plus_the_signal(signum, signals_caught, monkeypatch, capsys):
    monkeypatch.setattr(optlab.studies.tune, "tune", signalled(signum))
    assert main(["tune", "--model", "tests.test_cli:SlowMLP", "--input-shape", "12", "--quiet"]) == 128 + signum
    assert capsys.readouterr().err == (f"optlab: stopped by {signal.Signals(signum).name}: the tune ended before its "
                                       "recommendation, and wrote nothing\n")


@pytest.mark.parametrize("signum", ENDING_SIGNALS, ids=lambda signum: signal.Signals(signum).name)
def test_a_signal_during_a_run_is_one_line_and_128_plus_the_signal(signum, signals_caught, monkeypatch, capsys,
                                                                   tmp_path):
    monkeypatch.setattr(optlab.core.run.experiments, "run_experiment", signalled(signum))
    assert main(["run", "set_to_none", "--out", str(tmp_path), "--quiet"]) == 128 + signum
    assert capsys.readouterr().err == (f"optlab: stopped by {signal.Signals(signum).name}: every model finished "
                                       f"before it is kept in {tmp_path}\n")


def test_the_last_line_starts_a_line_of_its_own_after_a_progress_bar(signals_caught, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(optlab.core.run.experiments, "run_experiment", signalled(signal.SIGINT))
    assert main(["run", "set_to_none", "--out", str(tmp_path)]) == 130  # the bar may be mid-line
    assert capsys.readouterr().err.startswith("\noptlab: stopped by SIGINT")


@pytest.mark.parametrize("command", [["tune", "--model", "tests.test_cli:SlowMLP", "--input-shape", "12"],
                                     ["run", "set_to_none"]], ids=["tune", "run"])
def test_ctrl_c_before_the_handler_is_one_line_and_exit_130(command, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(optlab.studies.tune, "tune", interrupted)
    monkeypatch.setattr(optlab.core.run.experiments, "run_experiment", interrupted)
    before = signal.getsignal(signal.SIGINT)  # Python's own, or SIG_IGN where a shell started this in the background
    try:
        status = main([*command, "--quiet"])
    except KeyboardInterrupt:  # caught here, or it would end the test session
        pytest.fail("Ctrl-C before the handler escaped main as a KeyboardInterrupt")
    assert status == 130
    assert capsys.readouterr().err == "optlab: stopped by SIGINT\n"
    assert signal.getsignal(signal.SIGINT) is before, "the handler was left installed"
