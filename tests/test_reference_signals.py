"""A reference run ended by a signal keeps what it finished: real signals, to the run's process and to its process
group (as Ctrl-C in a terminal or a scheduler's scancel sends them), sent to real smoke runs of
``python -m optlab reference --archive`` early, in the first part while its loader workers run, and between parts,
the runs side by side to keep the test short (``benchmarks/signals.py`` runs every cell many times); and one killed
once a record is on disk, whose every record left reads back."""
import json
import signal

import pytest

from benchmarks.signals import AFTER_A_PACK, Run, members, run_all
from optlab.core.results import store

CELLS = [  # (signal, sent to, moment)
    (signal.SIGTERM, "process", "early"),
    (signal.SIGTERM, "process", "between parts"),
    (signal.SIGTERM, "group", "mid-part with workers"),
    (signal.SIGINT, "group", "mid-part with workers"),
    (signal.SIGHUP, "group", "early"),
    (signal.SIGHUP, "group", "mid-part with workers"),
    (signal.SIGHUP, "process", "between parts"),
    (signal.SIGKILL, "process", AFTER_A_PACK),  # nothing can be done: the last pack must be whole
]


@pytest.mark.beside_the_book_build  # slow, in processes of its own: it fills the wait for the book
def test_a_signal_at_any_moment_leaves_an_archive_of_every_finished_part_a_log_and_one_last_line(tmp_path):
    runs = [Run(tmp_path / f"{signal.Signals(signum).name}-{target}-{moment.replace(' ', '-')}", signum, target,
                moment) for signum, target, moment in CELLS]
    codes = run_all(runs, parallel=4)
    assert all(run.sent for run in runs), {run.folder.name: (run.folder / "stderr").read_text()[-500:]
                                           for run in runs if not run.sent}
    for index, run in enumerate(runs[:-1]):
        assert run.problems(codes[index]) == [], (run.folder.name, (run.folder / "stderr").read_text()[-2000:])
    assert not runs[0].finished  # early: no part had finished

    killed = runs[-1]
    assert codes[len(runs) - 1] == -signal.SIGKILL
    archived = members(killed.archive)  # whole: packed atomically after the part before the kill
    assert killed.archived and {name for name in archived if name.endswith(".json")} >= killed.archived
    assert "reference-parts.csv" in archived and "reference.log" in archived
    records = {path.name: path for path in killed.out.glob("*.json")}
    assert killed.finished and records.keys() >= killed.finished
    for path in records.values():  # each written whole, in strict JSON
        record = store.load_record(path)
        assert {row["model"] for row in record["samples"]} <= set(record["configs"])
        json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
