import numpy as np
import pytest

from optlab.core.machine import machine_load

CPU_LINE = "cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"


def fake_proc(tmp_path, user: int, system: int, idle: int, iowait: int, processes: dict[int, tuple[int, int]],
              load: float = 0.5):
    """A /proc with the machine's CPU line, a load average and ``processes``: pid -> (parent pid, CPU ticks)."""
    (tmp_path / "stat").write_text(CPU_LINE.format(user=user, system=system, idle=idle, iowait=iowait))
    (tmp_path / "loadavg").write_text(f"{load} 0.40 0.30 1/100 999\n")
    for pid, (parent, ticks) in processes.items():
        folder = tmp_path / str(pid)
        folder.mkdir(exist_ok=True)
        # pid (name) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime
        (folder / "stat").write_text(f"{pid} (py (x) y) S {parent} 1 1 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0\n")
    (tmp_path / "self").mkdir(exist_ok=True)
    return tmp_path


def clock(*values):
    ticks = iter(values)
    return lambda: next(ticks)


def test_other_work_is_the_machines_busy_time_less_this_process_trees(tmp_path):
    proc = fake_proc(tmp_path, 1000, 0, 1000, 0, {10: (1, 500), 11: (10, 100), 12: (1, 50)}, load=0.5)
    start = machine_load.snapshot(proc, pid=10, clock=clock(0.0))
    assert start["own_jiffies"] == 600  # the process and its child, not the unrelated pid 12
    # 1000 ticks pass on the machine: 800 busy, of which this tree took 300
    proc = fake_proc(tmp_path, 1700, 100, 1100, 100, {10: (1, 700), 11: (10, 200), 12: (1, 550)}, load=1.8)
    end = machine_load.snapshot(proc, pid=10, clock=clock(5.0))
    load = machine_load.between(start, end)
    cores = end["cpu_count"]
    assert load["other_busy_cores"] == pytest.approx(round(500 / 1000 * cores, 3))
    assert (load["load_1m_start"], load["load_1m_end"], load["seconds"]) == (0.5, 1.8, 5.0)
    line = machine_load.warning(load)
    assert line.startswith("warning: the timing competed with other work") and "0.5 -> 1.8" in line
    assert "\n" not in line


def test_a_quiet_machine_gets_no_warning(tmp_path):
    quiet = {"load_1m_start": 0.2, "load_1m_end": 1.0, "cpu_count": 2, "seconds": 3.0,
             "other_busy_cores": machine_load.OTHER_WORK_LIMIT}
    assert machine_load.warning(quiet) is None
    assert machine_load.warning(quiet | {"other_busy_cores": machine_load.OTHER_WORK_LIMIT + 0.1}) is not None


def test_without_proc_stat_the_load_average_decides(tmp_path):
    (tmp_path / "loadavg").write_text("3.5 1 1 1/1 1\n")
    snap = machine_load.snapshot(tmp_path, pid=10, clock=clock(0.0))
    assert snap["total_jiffies"] is None and snap["own_jiffies"] is None and snap["load_1m"] == 3.5
    load = machine_load.between(snap, snap | {"time": 1.0})
    assert load["other_busy_cores"] is None
    assert (machine_load.warning(load) is not None) == (3.5 > load["cpu_count"])
    assert machine_load.warning(load | {"load_1m_start": 0.1, "load_1m_end": 0.1}) is None


def test_step_times_on_a_scheduler_tick_are_found():
    quantised = np.array([16.0, 24.0, 32.0, 40.0, 48.0, 16.0, 24.0, 32.0, 24.0, 40.0]) / 1e3  # the case
    tick, share = machine_load.tick_quantised(quantised + np.random.default_rng(0).normal(0, 5e-5, 10))
    assert tick == pytest.approx(0.008, abs=1e-4) and share == 1.0
    assert "multiples of 8.0 ms" in machine_load.tick_note(quantised)


def test_ordinary_step_times_are_not_called_quantised():
    rng = np.random.default_rng(1)
    assert machine_load.tick_quantised(rng.uniform(0.005, 0.05, 40)) is None  # spread, no tick
    assert machine_load.tick_quantised(rng.normal(0.016, 0.0002, 40)) is None  # steady: one multiple of anything
    assert machine_load.tick_quantised(np.array([2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]) / 1e3) is None  # < 4 ms
    assert machine_load.tick_quantised(np.array([0.016, 0.024, 0.032])) is None  # too few to say
    assert machine_load.tick_note([0.01] * 20) is None


def test_a_run_records_the_load_of_every_model(capsys):
    from optlab.core.run.experiments import run_experiment
    from optlab.core.techniques.registry import Experiment
    from tests.helpers import TINY

    run = run_experiment(Experiment("aa", "", "", variants=(("A", {}), ("B", {})), phases=("test",)),
                         profile=TINY.with_sizes(repeats=2, max_repeats=2), device="cpu", progress=False)
    load = run.record["rounds"]["resnet18"]["machine_load"]
    assert set(load) == {"load_1m_start", "load_1m_end", "cpu_count", "seconds", "other_busy_cores"}
    assert load["seconds"] > 0 and load["cpu_count"] >= 1
    printed = capsys.readouterr().out
    assert ("warning: the timing competed" in printed) == (machine_load.warning(load) is not None)
