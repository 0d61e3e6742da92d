"""A reference run killed at a job's time limit keeps what it finished: real signals sent to real smoke runs of
``python -m optlab reference --archive`` at four moments, the four runs side by side to keep the test short."""
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "optlab", "reference", "--set", "seed", "--profile", "smoke", "--device", "cpu",
           "--quiet", "--repeats", "2", "--max-repeats", "2"]


def _members(path):
    with tarfile.open(path) as tar:
        return {Path(member.name).name: tar.extractfile(member).read() for member in tar.getmembers()}


def _parts_started(run):
    text = (run["folder"] / "stdout").read_text() if (run["folder"] / "stdout").exists() else ""
    return sum(line.startswith("part ") for line in text.splitlines())


def _parts_noted(run):
    path = run["out"] / "reference-parts.csv"
    return len(pd.read_csv(path)) if path.exists() else 0


def _archived_records(run):
    try:
        return {name for name in _members(run["archive"]) if name.endswith(".json")}
    except (OSError, tarfile.TarError, EOFError):
        return set()


def _mid_part(run) -> bool:
    """Half a second into a part after the second (the third is multiple_of_8, one of the longest on a CPU; a quick
    one can end before the signal lands), while that part is still in flight."""
    started = _parts_started(run)
    if started < 3 or _parts_noted(run) >= started:
        return False
    return run.setdefault("seen", {}).setdefault(started, time.monotonic()) < time.monotonic() - 0.5


MOMENTS = {  # when to send the signal: early (the first part running), mid-part (a later one), between parts
    "early": (signal.SIGTERM, lambda run: _parts_started(run) >= 1),
    "mid-part": (signal.SIGTERM, _mid_part),
    "between parts": (signal.SIGTERM, lambda run: _parts_noted(run) >= 1),
    "killed between parts": (signal.SIGKILL, lambda run: bool(_archived_records(run))),
}


@pytest.mark.beside_the_book_build  # slow, in processes of its own: it fills the wait for the book
def test_a_signal_at_any_moment_leaves_an_archive_of_every_finished_part_a_log_and_one_last_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    runs = {}
    for moment in MOMENTS:
        folder = tmp_path / moment.replace(" ", "-")
        folder.mkdir()
        run = {"folder": folder, "out": folder / "out", "archive": folder / "run.tar.gz"}
        run["process"] = subprocess.Popen(
            [*COMMAND, "--out", str(run["out"]), "--archive", str(run["archive"])], cwd=ROOT, env=env,
            stdout=(folder / "stdout").open("w"), stderr=(folder / "stderr").open("w"), start_new_session=True)
        runs[moment] = run
    deadline = time.monotonic() + 600
    try:
        while any("sent" not in run for run in runs.values()) and time.monotonic() < deadline:
            for moment, run in runs.items():
                signum, ready = MOMENTS[moment]
                if "sent" not in run and run["process"].poll() is None and ready(run):
                    run["finished"] = {p.name for p in run["out"].glob("*.json")}  # records whole on disk now
                    run["archived"] = _archived_records(run)
                    run["process"].send_signal(signum)
                    run["sent"] = True
            time.sleep(0.05)
        codes = {moment: run["process"].wait(timeout=120) for moment, run in runs.items()}
    finally:
        for run in runs.values():
            if run["process"].poll() is None:
                os.killpg(run["process"].pid, signal.SIGKILL)
    assert all("sent" in run for run in runs.values()), {m: (r["folder"] / "stderr").read_text()[-500:]
                                                         for m, r in runs.items()}

    for moment in ("early", "mid-part", "between parts"):
        run = runs[moment]
        assert codes[moment] == 128 + signal.SIGTERM, (moment, (run["folder"] / "stderr").read_text())
        members = _members(run["archive"])
        assert run["finished"] <= set(members), moment  # every part finished before the signal
        log = members["reference.log"].decode()
        assert "stopped: SIGTERM" in log and log.startswith("optlab reference --set seed"), moment
        last = (run["folder"] / "stderr").read_text().strip().splitlines()[-1]
        assert last.startswith("optlab: stopped by SIGTERM: every part finished before it is kept in"), moment
        assert "run the same command again" in last
        parts = pd.read_csv(io.BytesIO(members["reference-parts.csv"])) if "reference-parts.csv" in members else None
        if moment != "between parts":  # the part in flight is recorded as interrupted
            assert parts is not None and parts["status"].iloc[-1] == "interrupted", moment
            assert "interrupted in part" in log
    assert not runs["early"]["finished"] and runs["mid-part"]["finished"]

    killed = runs["killed between parts"]
    assert codes["killed between parts"] == -signal.SIGKILL
    members = _members(killed["archive"])  # whole: packed atomically after the part before the kill
    assert killed["archived"] and {name for name in members if name.endswith(".json")} >= killed["archived"]
    assert "reference-parts.csv" in members and "reference.log" in members
