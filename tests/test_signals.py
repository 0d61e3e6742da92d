"""Signals and the reference run's ends, fast: real signals sent to this process while the reference run goes
through its parts, with the parts faked (no training), so that the exit status, the interrupted row, the archive after
every part, the checks before the first part and the deadline are caught in the normal suite."""
import io
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from optlab.commands import cli, reference
from optlab.commands.reference import planning, running
from optlab.core.results import archive as archives, store
from optlab.core.process import shutdown
from optlab.core.knobs.config import RunConfig
from optlab.core.process.loader import make_loader
from optlab.core.process.shutdown import Interrupted, signals_interrupt

ENDING = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


def _members(path):
    with tarfile.open(path) as tar:
        return {Path(member.name).name: tar.extractfile(member).read() for member in tar.getmembers()}


@pytest.mark.parametrize("signum", ENDING, ids=lambda s: signal.Signals(s).name)
def test_each_ending_signal_raises_interrupted_with_the_shells_exit_code(signum):
    assert signum in shutdown.ENDING_SIGNALS
    with pytest.raises(Interrupted) as stop, signals_interrupt() as received:
        os.kill(os.getpid(), signum)
        time.sleep(1)  # the handler runs at the next bytecode: never reached
    assert stop.value.signum == signum and stop.value.exit_code == 128 + signum and received == [signum]
    assert signal.getsignal(signum) is not shutdown._handler  # the previous handler is back


def test_a_swallowed_raise_is_raised_again_at_the_next_check_and_by_the_next_signal():
    with signals_interrupt():
        try:  # a library frame that swallows every exception, as an at-fork hook or a __del__ does
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)
        except BaseException:  # noqa: BLE001
            pass
        with pytest.raises(Interrupted) as first:
            shutdown.check()
        assert first.value.signum == signal.SIGHUP
        with pytest.raises(Interrupted) as later:  # a later signal is not ignored
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert later.value.signum == signal.SIGHUP  # the run ends for the first signal
    with signals_interrupt():  # a new run starts with no signal on record
        shutdown.check()


def test_a_signal_while_held_waits_for_the_end_of_the_block():
    done = []
    with signals_interrupt(), pytest.raises(Interrupted):
        with shutdown.held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            done.append("the pack ended")
    assert done == ["the pack ended"]
    with signals_interrupt():  # the last clean-up: recorded, never raised
        with shutdown.held(then_raise=False):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert shutdown.received() == [signal.SIGINT]


def test_a_forked_child_ignores_the_ending_signals_and_leaves_them_to_the_run():
    with signals_interrupt():
        pid = os.fork()
        if pid == 0:  # the child: every ending signal ignored from its first instruction on
            ignored = all(signal.getsignal(s) == signal.SIG_IGN for s in shutdown.ENDING_SIGNALS)
            os._exit(0 if ignored else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    pid = os.fork()  # outside a run a child keeps what it inherits
    if pid == 0:
        os._exit(0 if signal.getsignal(signal.SIGTERM) != signal.SIG_IGN else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class _Pids(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        time.sleep(0.05)
        return torch.tensor(os.getpid())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_loader_workers_of_a_run_outlive_a_ctrl_c_or_a_hang_up_sent_to_them(signum):
    config = RunConfig(num_workers=1, batch_size=1, persistent_workers=False, pin_memory=False)
    with signals_interrupt():
        loader = make_loader(_Pids(), config, train=False)
        batches = iter(loader)
        worker = int(next(batches)[0])
        assert worker != os.getpid()
        os.kill(worker, signum)  # as a signal to the process group reaches each worker
        time.sleep(0.2)
        rest = [int(batch[0]) for batch in batches]  # a worker that died would be an error here
    assert rest and set(rest) == {worker}
    assert make_loader(_Pids(), config, train=False).worker_init_fn is None  # outside a run: torch's own handling


def test_a_loader_worker_of_a_run_exits_quietly_on_sigterm_leaving_no_error_to_its_parent():
    config = RunConfig(num_workers=1, batch_size=1, persistent_workers=False, pin_memory=False)
    with signals_interrupt():
        batches = iter(make_loader(_Pids(), config, train=False))
        worker = int(next(batches)[0])
        process = next(p for p in batches._workers if p.pid == worker)
        os.kill(worker, signal.SIGTERM)
        process.join(timeout=30)
        assert process.exitcode == 0  # killed by the signal, it would read -15, and torch's SIGCHLD handler would raise
        time.sleep(0.2)  # the parent's SIGCHLD handler has run: nothing raised
        del batches


# The reference run with its parts faked: each call gets the part and may act as a signal or a failure would.
def _fake_parts(monkeypatch, act):
    calls = []

    def run_part(part, folder, prof, device, progress, download, deadline=None):
        calls.append(part.name)
        act(len(calls), part, folder)
        return None

    monkeypatch.setattr(running, "_run_part", run_part)
    return calls


def _reference(tmp_path, *extra):
    return cli.main(["reference", "--set", "seed", "--profile", "smoke", "--device", "cpu", "--quiet",
                     "--out", str(tmp_path / "out"), "--archive", str(tmp_path / "run.tar.gz"), *extra])


@pytest.mark.parametrize("signum", ENDING, ids=lambda s: signal.Signals(s).name)
def test_a_signal_mid_part_records_it_packs_and_ends_in_one_line_with_128_plus_the_signal(tmp_path, monkeypatch,
                                                                                           capfd, signum):
    def act(call, part, folder):
        if call == 2:
            os.kill(os.getpid(), signum)
            time.sleep(1)

    calls = _fake_parts(monkeypatch, act)
    assert _reference(tmp_path) == 128 + signum
    assert len(calls) == 2
    members = _members(tmp_path / "run.tar.gz")
    parts = pd.read_csv(io.BytesIO(members["reference-parts.csv"]))
    assert list(parts["status"]) == ["ok", "interrupted"] and list(parts["part"]) == calls
    log = members["reference.log"].decode()
    assert f"stopped: {signal.Signals(signum).name}" in log and "interrupted in part" in log
    err = capfd.readouterr().err.strip().splitlines()
    name = signal.Signals(signum).name
    assert err[-1].startswith(f"optlab: stopped by {name}: every part finished before it is kept in")
    assert "Traceback" not in "\n".join(err)


def test_a_swallowed_signal_ends_the_run_at_the_next_part_boundary(tmp_path, monkeypatch, capfd):
    def act(call, part, folder):
        if call == 1:
            try:
                os.kill(os.getpid(), signal.SIGHUP)
                time.sleep(1)
            except BaseException:  # noqa: BLE001  (a library swallows it)
                pass

    calls = _fake_parts(monkeypatch, act)
    assert _reference(tmp_path) == 128 + signal.SIGHUP
    assert len(calls) == 1  # the second part never started
    assert "optlab: stopped by SIGHUP" in capfd.readouterr().err.strip().splitlines()[-1]


def test_an_error_that_follows_a_signal_reads_as_the_signal(tmp_path, monkeypatch, capfd):
    def act(call, part, folder):  # the signal reached a loader worker first, and torch reports the worker's death
        if call == 2:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
            except Interrupted:
                pass
            raise RuntimeError("DataLoader worker (pid 1234) is killed by signal: Terminated")

    _fake_parts(monkeypatch, act)
    assert _reference(tmp_path) == 128 + signal.SIGTERM
    parts = pd.read_csv(tmp_path / "out" / "reference-parts.csv")
    assert parts["status"].iloc[-1] == "interrupted"
    assert "Traceback" not in capfd.readouterr().err


def test_the_archive_is_packed_after_every_part(tmp_path, monkeypatch):
    seen = []

    def act(call, part, folder):  # what a SIGKILL now would leave: the archive as the last part left it
        if call > 1:
            parts = pd.read_csv(io.BytesIO(_members(tmp_path / "run.tar.gz")["reference-parts.csv"]))
            seen.append(len(parts))
        if call == 3:
            raise Interrupted(signal.SIGTERM)

    _fake_parts(monkeypatch, act)
    assert _reference(tmp_path) == 128 + signal.SIGTERM
    assert seen == [1, 2]


def test_a_pack_that_fails_mid_run_stops_the_run_at_once_in_one_line(tmp_path, monkeypatch, capfd):
    real_pack, packs = archives.pack, []

    def pack(folder, path, extra=None):
        packs.append(path)
        if len(packs) == 2:
            raise OSError(28, "No space left on device")
        return real_pack(folder, path, extra)

    monkeypatch.setattr(archives, "pack", pack)
    calls = _fake_parts(monkeypatch, lambda *_: None)
    assert _reference(tmp_path) == 2
    assert len(calls) == 2 and len(packs) == 2  # no part after the failed pack, and no pack tried again
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"optlab: error: the archive {str(tmp_path / 'run.tar.gz')!r} could not be written (No space left "
                   f"on device); the results are in {store.display_path(tmp_path / 'out')}"]


@pytest.mark.parametrize("arguments, said", [
    (["--set", "sed"], "sed"),
    (["--device", "cuda"], "cuda"),
    (["--budget", "0"], "--budget"),
    (["--archive", "{file}/run.tar.gz"], "cannot be written"),
    (["--archive", "{tmp}"], "is a folder"),
    (["--out", "{file}/out"], "cannot be written"),
], ids=["set", "device", "budget", "archive-under-a-file", "archive-a-folder", "out-under-a-file"])
def test_a_bad_argument_writes_nothing_and_ends_in_one_line(tmp_path, monkeypatch, capfd, arguments, said):
    if "cuda" in arguments and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "a-file").write_text("")
    arguments = [a.format(file=tmp_path / "a-file", tmp=tmp_path) for a in arguments]
    calls = _fake_parts(monkeypatch, lambda *_: None)
    before = sorted(tmp_path.rglob("*"))
    assert cli.main(["reference", "--profile", "smoke", "--device", "cpu", "--quiet", "--out",
                     str(tmp_path / "out"), "--archive", str(tmp_path / "run.tar.gz"), *arguments]) == 2
    assert sorted(tmp_path.rglob("*")) == before and not calls
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("optlab: error:") and said in err[0]


def test_the_budget_is_a_deadline_from_the_process_start_not_from_the_runs_start(tmp_path, monkeypatch, capfd):
    # The process started 1000 s ago; a budget of 1015 s leaves 15 s, less the reserve to pack: room for the
    # cheapest parts only. Counted from now it would leave room for all of them.
    monkeypatch.setattr(shutdown, "PROCESS_START", shutdown.now() - 1000)
    calls = _fake_parts(monkeypatch, lambda *_: None)
    assert _reference(tmp_path, "--budget", "1015") == 0
    out = capfd.readouterr().out
    assert "left for a later run (over --budget 1015 s)" in out
    assert 0 < len(calls) < len(reference.plan("seed", planning.reference_profile("smoke", False)))


SWALLOWED = """
import os, signal, time
from optlab.core.process import shutdown

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler raises here, inside __del__, where Python can only report it

with shutdown.signals_interrupt():
    Finalized()
    try:
        shutdown.check()
    except shutdown.Interrupted as stop:
        print("raised again:", stop)
"""


def test_a_raise_python_cannot_pass_on_prints_nothing_and_is_raised_at_the_next_check():
    done = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.stdout.strip() == "raised again: SIGTERM"
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_signal_while_the_loader_workers_start_waits_until_they_have(monkeypatch):
    config = RunConfig(num_workers=2, batch_size=1, persistent_workers=False, pin_memory=False)
    real_start = torch.multiprocessing.get_context("fork").Process.start
    starts = []

    def start(process):  # the signal lands between the two workers' starts
        starts.append(process)
        if len(starts) == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        return real_start(process)

    monkeypatch.setattr(type(torch.multiprocessing.get_context("fork").Process()), "start", start)
    with signals_interrupt(), pytest.raises(Interrupted):
        iter(make_loader(_Pids(), config, train=False, multiprocessing_context="fork"))
        pytest.fail("the signal was not raised once the iterator was built")
    assert len(starts) == 2  # both workers started: the iterator was built whole, then the signal raised


def test_a_parts_list_edited_by_hand_stops_the_run_before_anything_is_written(tmp_path, monkeypatch, capfd):
    out = tmp_path / "out"
    out.mkdir()
    (out / "reference-parts.csv").write_text("set,status\nseed,ok\n")  # no part column
    before = {path: path.read_bytes() for path in out.iterdir()}
    calls = _fake_parts(monkeypatch, lambda *_: None)
    assert _reference(tmp_path) == 2
    assert {path: path.read_bytes() for path in out.iterdir()} == before and not calls
    assert not (tmp_path / "run.tar.gz").exists()
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reference-parts.csv" in err[0]


def test_after_a_signal_a_child_that_it_ended_raises_nothing_in_the_run(capfd):
    def child_error(signum, frame):  # as torch's loader does for a worker killed by a signal
        raise RuntimeError("DataLoader worker (pid 1234) is killed by signal: Terminated")

    previous = signal.signal(signal.SIGCHLD, child_error)
    try:
        with signals_interrupt():
            with pytest.raises(Interrupted):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
            with shutdown.held(then_raise=False):  # the clean-up, while the group's signal ends a child
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                os.waitpid(pid, 0)
                os.kill(os.getpid(), signal.SIGCHLD)
                time.sleep(0.05)
        # A worker the signal ended may exit after the run's last line: its exit stays quiet to the process's end
        # (torch's loader then finds a dead worker by polling, within seconds, instead of by this signal)
        assert signal.getsignal(signal.SIGCHLD) is shutdown._children_may_end
        os.kill(os.getpid(), signal.SIGCHLD)  # and raises nothing
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_signal_of_a_run_that_ended_is_not_raised_in_the_next_code():
    with pytest.raises(Interrupted), signals_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    shutdown.check()  # outside a run: the signal ended that run, not this code
    assert shutdown.received() == [] and not shutdown.active()


def test_a_message_shows_a_folder_outside_the_repository_whole_and_a_temporary_one_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert store.display_path(tmp_path / "r05") == "r05"  # under the working folder
    outside = Path("/var/lib/optlab-results/r05")
    assert store.display_path(outside) == str(outside)
    monkeypatch.chdir(Path(__file__).resolve().parent)
    assert store.display_path(Path(tempfile.gettempdir()) / "job" / "r05") == "r05"


def test_a_loader_worker_of_a_run_is_quiet_when_the_run_closes_its_connection_and_reports_anything_else(capfd):
    pid = os.fork()
    if pid == 0:  # as a worker: its resource-sharing thread reports through sys.excepthook
        shutdown.leave_to_the_run(0)
        for error in (EOFError(), ConnectionResetError(), ValueError("a real fault")):
            sys.excepthook(type(error), error, None)
        os._exit(0)
    os.waitpid(pid, 0)
    err = capfd.readouterr().err
    assert "EOFError" not in err and "ConnectionResetError" not in err and "ValueError: a real fault" in err


def test_a_signal_during_the_tables_first_import_waits_for_the_import_to_end(monkeypatch):
    """The reference command prints each part's table as the part ends, importing the tables (seaborn, matplotlib's
    C extensions) the first time: the moment "between parts" that a scheduler's signal hits. The signal is raised once
    the import has ended, never inside it (a C extension cut halfway made the interpreter abort at exit)."""
    name = "optlab.book.report.tables"
    monkeypatch.delitem(sys.modules, name, raising=False)  # the module and its package's attribute come back after
    if package := sys.modules.get(name.rpartition(".")[0]):
        monkeypatch.setattr(package, "tables", package.tables)
    seen = []

    class SignalOnImport:
        def find_spec(self, fullname, path=None, target=None):
            if fullname == name and not seen:
                seen.append(fullname)
                os.kill(os.getpid(), signal.SIGTERM)
            return None

    monkeypatch.setattr(sys, "meta_path", [SignalOnImport(), *sys.meta_path])
    with pytest.raises(Interrupted, match="SIGTERM"), signals_interrupt():
        cli._print_table(None)
    assert seen and name in sys.modules  # the import ended before the signal was raised
