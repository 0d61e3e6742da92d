"""A reference run ended by a signal, as schedulers and terminals send them: every ending signal (SIGTERM, SIGINT,
SIGHUP), to the run's process or to its whole process group, at three moments (early, in the first part while its
loader workers run, between parts), each cell several times, on real smoke runs of
``python -m optlab reference --set seed --archive``. Each run passes when it ends as promised: exit 128 + the signal,
one last line on stderr and no traceback, an archive holding every part finished before the signal and the log, and
the part in flight recorded as interrupted.

    python benchmarks/signals.py                   # every cell 10 times, 3 runs at a time: about 25 min on 2 cores
    python benchmarks/signals.py --times 1 --only SIGTERM:group
"""
from __future__ import annotations

import argparse
import io
import itertools
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "optlab", "reference", "--set", "seed", "--profile", "smoke", "--device", "cpu",
           "--quiet", "--repeats", "2", "--max-repeats", "2"]
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP}
TARGETS = ("process", "group")
RUN_LIMIT_S = 600  # no run waits longer than this for its moment


def members(path: Path) -> dict[str, bytes]:
    """The files of an archive, by name."""
    with tarfile.open(path) as tar:
        return {Path(member.name).name: tar.extractfile(member).read() for member in tar.getmembers()}


@dataclass
class Run:
    """One smoke reference run, and what it had finished when the signal was sent."""

    folder: Path
    signum: int
    target: str
    moment: str
    process: subprocess.Popen | None = None
    sent: bool = False
    finished: set[str] = field(default_factory=set)
    archived: set[str] = field(default_factory=set)
    seen: dict[int, float] = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return self.folder / "out"

    @property
    def archive(self) -> Path:
        return self.folder / "run.tar.gz"

    def start(self, env: dict[str, str]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [*COMMAND, "--out", str(self.out), "--archive", str(self.archive)], cwd=ROOT, env=env,
            stdout=(self.folder / "stdout").open("w"), stderr=(self.folder / "stderr").open("w"),
            start_new_session=True)  # a group of its own, as a job or a terminal gives it

    def parts_started(self) -> int:
        path = self.folder / "stdout"
        return sum(line.startswith("part ") for line in path.read_text().splitlines()) if path.exists() else 0

    def parts_noted(self) -> int:
        path = self.out / "reference-parts.csv"
        try:
            return len(pd.read_csv(path)) if path.exists() else 0
        except (OSError, ValueError):
            return 0

    def has_children(self) -> bool:
        """Whether the run has child processes now (its loader workers)."""
        try:
            return bool((Path("/proc") / str(self.process.pid) / "task" / str(self.process.pid) / "children")
                        .read_text().split())
        except OSError:
            return False

    def send(self) -> None:
        self.finished = {p.name for p in self.out.glob("*.json")}  # records whole on disk now
        self.archived = archived_records(self)
        if self.target == "group":
            os.killpg(self.process.pid, self.signum)
        else:
            self.process.send_signal(self.signum)
        self.sent = True

    def problems(self, code: int) -> list[str]:
        """What this run did not do as promised (empty: it passed)."""
        name = signal.Signals(self.signum).name
        err = (self.folder / "stderr").read_text()
        found = []
        if code != 128 + self.signum:
            found.append(f"exit {code}, not {128 + self.signum}")
        if "Traceback" in err:
            found.append("a traceback on stderr")
        lines = err.strip().splitlines()
        if not lines or not lines[-1].startswith(f"optlab: stopped by {name}: every part finished before it is kept"):
            found.append(f"last line {lines[-1] if lines else '(none)'!r}")
        try:
            archived = members(self.archive)
        except (OSError, tarfile.TarError, EOFError) as error:
            return found + [f"no archive ({error})"]
        if not self.finished <= set(archived):
            found.append(f"finished parts missing from the archive: {sorted(self.finished - set(archived))}")
        log = archived.get("reference.log", b"").decode()
        if f"stopped: {name}" not in log:
            found.append("the log does not say it stopped")
        if self.moment != "between parts":
            parts = archived.get("reference-parts.csv")
            status = pd.read_csv(io.BytesIO(parts))["status"].iloc[-1] if parts else None
            if status != "interrupted":
                found.append(f"the part in flight is {status!r}, not interrupted")
        return found


def archived_records(run: Run) -> set[str]:
    """The records the run's archive holds now (none where it is missing or being replaced)."""
    try:
        return {name for name in members(run.archive) if name.endswith(".json")}
    except (OSError, tarfile.TarError, EOFError):
        return set()


def _mid_part_with_workers(run: Run) -> bool:
    """In the first part (loader workers: data_loading) while its workers run, a little after they started."""
    if run.parts_started() != 1 or run.parts_noted() or not run.has_children():
        return False
    return run.seen.setdefault(1, time.monotonic()) < time.monotonic() - 0.3


MOMENTS: dict[str, Callable[[Run], bool]] = {
    "early": lambda run: run.parts_started() >= 1,
    "mid-part with workers": _mid_part_with_workers,
    "between parts": lambda run: run.parts_noted() >= 1,
}
AFTER_A_PACK = "after a pack"  # for SIGKILL, which no run can answer: once the archive holds a record
READY = {**MOMENTS, AFTER_A_PACK: lambda run: bool(archived_records(run))}


def run_all(runs: list[Run], parallel: int, limit_s: float = RUN_LIMIT_S) -> dict[int, int]:
    """Start the runs ``parallel`` at a time, send each its signal at its moment, and return each run's exit code
    (by index; a run whose moment never came within ``limit_s`` is killed and counted with code -9)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    codes: dict[int, int] = {}
    waiting, active = list(enumerate(runs)), {}
    try:
        while waiting or active:
            while waiting and len(active) < parallel:
                index, run = waiting.pop(0)
                run.start(env)
                active[index] = (run, time.monotonic())
            for index, (run, started) in list(active.items()):
                if not run.sent and run.process.poll() is None and READY[run.moment](run):
                    run.send()
                if run.process.poll() is not None or time.monotonic() - started > limit_s:
                    if run.process.poll() is None:
                        os.killpg(run.process.pid, signal.SIGKILL)
                    codes[index] = run.process.wait() if run.sent else -9
                    del active[index]
            time.sleep(0.05)
    finally:
        for run, _ in active.values():
            if run.process.poll() is None:
                os.killpg(run.process.pid, signal.SIGKILL)
    return codes


def cells(only: str | None = None) -> list[tuple[str, str, str]]:
    """(signal, target, moment) for every cell, or those ``only`` names as SIGNAL:TARGET (either part may be *)."""
    wanted = (only or "*:*").split(":")
    return [(name, target, moment) for name, target, moment in itertools.product(SIGNALS, TARGETS, MOMENTS)
            if wanted[0] in ("*", name) and wanted[1] in ("*", target)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--times", type=int, default=10, help="runs per cell (default 10)")
    parser.add_argument("--parallel", type=int, default=3, help="runs at a time (default 3)")
    parser.add_argument("--only", help="SIGNAL:TARGET, such as SIGHUP:group or *:process")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/optlab-signals"), help="where the runs write")
    args = parser.parse_args(argv)
    if not 1 <= args.times <= 100 or not 1 <= args.parallel <= (os.cpu_count() or 1) * 2:
        parser.error(f"--times must be 1-100 and --parallel 1-{(os.cpu_count() or 1) * 2}")
    plan = [(cell, n) for cell in cells(args.only) for n in range(args.times)]
    runs = [Run(args.folder / f"{name}-{target}-{moment.replace(' ', '-')}-{n}", SIGNALS[name], target, moment)
            for (name, target, moment), n in plan]
    codes = run_all(runs, args.parallel)
    rows = [{"signal": signal.Signals(run.signum).name, "to": run.target, "moment": run.moment,
             "problems": "; ".join(run.problems(codes[index])) if codes[index] != -9 else "moment never came"}
            for index, run in enumerate(runs)]
    table = pd.DataFrame(rows).assign(ok=lambda frame: frame["problems"] == "")
    summary = table.groupby(["signal", "to", "moment"], sort=False)["ok"].agg(["sum", "count"])
    print(summary.rename(columns={"sum": "as promised", "count": "runs"}).to_string())
    for row in table[~table["ok"]].itertuples():
        print(f"{row.signal} to the {row.to} {row.moment}: {row.problems}")
    print(f"{int(table['ok'].sum())} of {len(table)} runs ended as promised")
    return 0 if table["ok"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
