"""A busy machine, named: how much other work ran beside a comparison, and timings that only show the scheduler.

:func:`snapshot` reads the machine's load at one moment: the load averages against the CPU count, and (on Linux)
the CPU time of the whole machine from ``/proc/stat`` and of this process and its children from ``/proc/<pid>/stat``.
:func:`between` turns a snapshot before and one after a comparison into what the record keeps: both load averages
and the cores other processes kept busy in between. :func:`warning` is one line when that competes with the timing.

:func:`tick_quantised` looks at step times: when most of them sit on whole multiples of a tick of 4 ms or more (the
scheduler's time slices: a call that loses the CPU waits whole slices), it returns the tick.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

PROC = Path("/proc")
OTHER_WORK_LIMIT = 0.5  # cores: other processes busy more than this on average while a comparison ran -> a warning
MIN_TICK_S = 0.004  # the shortest scheduler tick worth naming (a 250 Hz kernel)
MAX_TICK_S = 0.1  # the longest: time slices are shorter
TICK_SHARE = 0.8  # of the step times on whole multiples of one tick
TICK_TOLERANCE = 0.04  # of a tick: how near a whole multiple a step time must be
MIN_TICK_STEPS = 8  # fewer step times than this say nothing about a tick


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _machine_jiffies(proc: Path) -> tuple[int, int] | None:
    """All CPUs' time since boot and the busy part of it (not idle, not waiting for I/O), in clock ticks."""
    text = _read(proc / "stat")
    if not text or not text.startswith("cpu "):
        return None
    fields = [int(value) for value in text.splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user already)
    return total, total - fields[3] - (fields[4] if len(fields) > 4 else 0)


def _process_jiffies(stat: str) -> tuple[int, int]:
    """A ``/proc/<pid>/stat`` line: the parent's pid, and the process's CPU time with its reaped children's."""
    after_name = stat.rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
    return int(after_name[1]), sum(int(value) for value in after_name[11:15])  # utime stime cutime cstime


def _own_jiffies(proc: Path, pid: int) -> int | None:
    """CPU time of process ``pid`` and every live descendant (loader workers, a variant's own process)."""
    parents, times = {}, {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            text = _read(entry / "stat")
            if text:
                parents[int(entry.name)], times[int(entry.name)] = _process_jiffies(text)
    if pid not in times:
        return None
    tree, grew = {pid}, True
    while grew:
        children = {child for child, parent in parents.items() if parent in tree} - tree
        tree, grew = tree | children, bool(children)
    return sum(times[member] for member in tree)


def snapshot(proc: Path = PROC, pid: int | None = None, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The machine's load now: 1-minute load average, CPU count, and the machine's and this process tree's CPU
    clock ticks where ``/proc`` can be read (else None)."""
    loads = _read(proc / "loadavg")
    machine = _machine_jiffies(proc)
    own = _own_jiffies(proc, pid or os.getpid()) if machine else None
    return {"time": clock(), "load_1m": float(loads.split()[0]) if loads else _loadavg(),
            "cpu_count": os.cpu_count() or 1, "total_jiffies": machine[0] if machine else None,
            "busy_jiffies": machine[1] if machine else None, "own_jiffies": own}


def _loadavg() -> float | None:
    try:
        return float(os.getloadavg()[0])
    except OSError:
        return None


def between(start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """What a record keeps of a comparison's machine load: the load average at its start and end, the CPU count,
    the seconds between, and the cores other processes kept busy on average (None where ``/proc`` was not read)."""
    other = None
    keys = ("total_jiffies", "busy_jiffies", "own_jiffies")
    if all(snap[key] is not None for snap in (start, end) for key in keys):
        total = end["total_jiffies"] - start["total_jiffies"]
        busy = end["busy_jiffies"] - start["busy_jiffies"]
        own = end["own_jiffies"] - start["own_jiffies"]
        if total > 0:
            other = round(max(busy - own, 0) / total * end["cpu_count"], 3)
    return {"load_1m_start": start["load_1m"], "load_1m_end": end["load_1m"], "cpu_count": end["cpu_count"],
            "seconds": round(end["time"] - start["time"], 3), "other_busy_cores": other}


def warning(load: dict[str, Any]) -> str | None:
    """One line when the comparison competed with other work: other processes kept more than
    ``OTHER_WORK_LIMIT`` cores busy on average, or (where that cannot be read) the load average passed the CPU
    count. None on a quiet machine."""
    cores = load["cpu_count"]
    loads = [value for value in (load["load_1m_start"], load["load_1m_end"]) if value is not None]
    trend = f"load average {load['load_1m_start']:.1f} -> {load['load_1m_end']:.1f} on {cores} CPUs" if loads else ""
    if load["other_busy_cores"] is not None:
        if load["other_busy_cores"] <= OTHER_WORK_LIMIT:
            return None
        what = f"other processes kept {load['other_busy_cores']:.1f} of {cores} cores busy"
    elif loads and max(loads) > cores:
        what = "more runnable work than CPUs"
    else:
        return None
    return (f"warning: the timing competed with other work ({what}; {trend}): expect wide intervals, and re-run on "
            "a quiet machine for numbers to keep")


def tick_quantised(step_times_s: "list[float] | np.ndarray", min_tick_s: float = MIN_TICK_S) -> tuple[float, float] | None:
    """The tick (seconds) that most step times are whole multiples of, and the share of them on it, when it is
    ``min_tick_s`` or more and at least three different multiples occur; else None (a steady step time that is
    one multiple of anything is no sign of the scheduler)."""
    times = np.asarray(step_times_s, dtype=float)
    times = times[np.isfinite(times) & (times > 0)]
    if times.size < MIN_TICK_STEPS or times.min() < min_tick_s:
        return None
    ticks = np.arange(min(times.min(), MAX_TICK_S), min_tick_s - 1e-12, -min_tick_s / 200)[::-1]
    multiples = times[None, :] / ticks[:, None]
    whole = np.rint(multiples)
    on_tick = np.abs(multiples - whole) <= TICK_TOLERANCE  # every tick is at most the shortest time
    shares = on_tick.mean(axis=1)
    for index in np.flatnonzero(shares >= TICK_SHARE)[::-1]:  # the longest tick that fits
        counts, fitted = whole[index][on_tick[index]], times[on_tick[index]]
        if np.unique(counts).size >= 3:
            return float((counts * fitted).sum() / (counts * counts).sum()), float(shares[index])  # least squares
    return None


def tick_note(step_times_s: "list[float] | np.ndarray") -> str | None:
    """A note when the step times are quantised to a scheduler tick (:func:`tick_quantised`), else None."""
    found = tick_quantised(step_times_s)
    if found is None:
        return None
    tick, share = found
    return (f"{share:.0%} of the timed calls took whole multiples of {1e3 * tick:.1f} ms: the scheduler's time "
            "slices, not the model (other work competes for the CPU); re-run on a quiet machine")
