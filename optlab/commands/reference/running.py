"""Running the reference: part by part within the deadline, each part recorded, the archive packed after each, and
an ending signal recorded as the part in flight's interruption.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import importlib
import io
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator

from ...core.results import archive as archives, store
from ...core.machine.device import DeviceInfo, resolve_device
from ...core.errors import OptlabError
from ...core.machine.gpu_sampler import PartWatch
from ...core.run.experiments import ExperimentResult, run_experiment
from ...core.knobs.profiles import Profile
from ...core.process import shutdown
from ...core.process.shutdown import Interrupted, signals_interrupt
from .costs import TABLE_GPU
from .outputs import PackFailed
from .parts_list import Part, repeats_run, run_key
from .planning import (PACK_RESERVE_S, STUDY_MODULES, measured_seconds, plan, reference_folders, reference_profile,
                       set_names, target_gpu)
from .run_folder import PartOverran, RunFolder


def study(module: str) -> Any:
    """The study whose ``run_reference(out, device)`` writes the tables of ``module`` (:data:`STUDY_MODULES`)."""
    return importlib.import_module(f"optlab.studies.{STUDY_MODULES[module]}")


def _run_part(part: Part, folder: Path, prof: Profile, device: str, progress: bool, download: bool,
              deadline: float | None = None) -> ExperimentResult | None:
    if part.module:
        for path in study(part.module).run_reference(folder, device):
            print(f"wrote {store.display_path(path)}")
        return None
    return run_experiment(part.technique, models=[part.model], profile=prof, device=device, out=folder,
                          progress=progress, download=download, filename=f"{part.technique}.json", resume=True,
                          deadline=deadline)


def run_reference(out: str | Path, set_name: str = "seed", profile: str | Profile | None = None,
                  device: str = "auto", progress: bool = True, download: bool = False, budget_s: float | None = None,
                  repeats: int | None = None, archive: str | Path | None = None) -> Iterator[ExperimentResult]:
    """Run every part of the set not yet recorded under ``out``, in priority order; with ``budget_s``, a deadline
    that many seconds after the process start: a part whose estimate would end past it is skipped (the later ones
    that fit still run), and a running part stops at the end of a repeat once it passes its share. Yields each
    technique part's result.

    The set, the device, the profile, the output folder and the archive path are checked first: a bad one is an
    OptlabError before anything is written. A part that fails, an OptlabError included, or that runs past its own
    deadline (:meth:`RunFolder.part_deadlines`: it is ended there), is reported and the run goes on; the end names
    every part that failed, stopped or was left. A full disk, an output folder that can no longer be
    written, or an archive that cannot be packed stops the run at once. After every part its lines are appended to
    ``out/reference.log`` and, with ``archive``, the folder is packed into that tar.gz; SIGTERM, SIGINT and SIGHUP
    (to the process or its group) record the part in flight as interrupted, pack, and raise
    :class:`~optlab.core.process.shutdown.Interrupted`.
    """
    with signals_interrupt():
        if budget_s is not None and not budget_s > 0:
            raise OptlabError(f"--budget must be a positive number of seconds, got {budget_s:g}")
        set_names(set_name)
        info = resolve_device(device)
        prof = reference_profile(profile, info.is_cuda, repeats)
        deadline = None if budget_s is None else shutdown.PROCESS_START + budget_s
        folder = RunFolder(out, archive, run_key(info), prof, deadline)
        folder.check()  # a folder or archive that cannot be written, or a parts list edited by hand: one line, now
        parts = plan(set_name, prof, measured_seconds(target_gpu(info), prof, reference_folders(out)))
        yield from _logged_run(folder.open(), set_name, parts, info, progress, download, budget_s)


def _logged_run(folder: RunFolder, set_name: str, parts: list[Part], info: DeviceInfo, progress: bool,
                download: bool, budget_s: float | None) -> Iterator[ExperimentResult]:
    """The parts, with what they print kept in the folder's log, and the last pack however the run ends."""
    ended, why = False, None
    try:
        with contextlib.redirect_stdout(Tee(sys.stdout, folder.log.buffer)):
            print(f"optlab reference --set {set_name}, into {folder.name}, started "
                  f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}")
            yield from _run_parts(folder, parts, info, progress, download, budget_s)
        ended = True
    except PackFailed:
        raise  # the last pack would fail the same way
    except Interrupted as stop:
        why = f"{stop} ({shutdown.now() - shutdown.PROCESS_START:.0f} s after the process start)"
        raise
    except GeneratorExit:  # the caller closed the run between parts: on a signal, or of its own accord
        received = shutdown.received()
        why = f"{signal.Signals(received[0]).name if received else 'the caller'}, between parts"
        raise
    except BaseException as error:
        received = shutdown.received()
        if received:  # a signal to the process group ended a child first, and the error came from that
            why = f"{signal.Signals(received[0]).name} ({type(error).__name__} in the clean-up)"
            raise Interrupted(received[0]) from error
        why = f"{type(error).__name__}: {error}"
        raise
    finally:
        if why is not None or ended:
            with shutdown.held(then_raise=False):
                if why is not None:
                    folder.log.buffer.write(f"stopped: {why}; every part finished before it is kept\n")
                try:
                    folder.save(final=True)
                except PackFailed as problem:
                    if ended:
                        raise
                    print(f"optlab: error: {problem}", file=sys.stderr)


def _signalled_run_part(part: Part, folder: Path, prof: Profile, device: str, progress: bool, download: bool,
                        deadline: float | None) -> ExperimentResult | None:
    """:func:`_run_part`, where an error that follows a signal (a child that the signal ended first) reads as the
    signal."""
    try:
        return _run_part(part, folder, prof, device, progress, download, deadline)
    except Exception as error:
        received = shutdown.received()
        if received:
            raise Interrupted(received[0]) from error
        raise


def _run_parts(folder: RunFolder, parts: list[Part], info: DeviceInfo, progress: bool, download: bool,
               budget_s: float | None) -> Iterator[ExperimentResult]:
    device, prof, deadline = str(info.device), folder.profile, folder.deadline
    done = folder.recorded(parts)
    failures, stopped, left, skipped, finished = [], [], [], [], 0
    for part in parts:
        shutdown.check()  # a signal whose raise was swallowed ends the run here at the latest
        if part.name in done:
            skipped.append(part.name)
            continue
        if part.needs_cuda and not info.is_cuda:
            print(f"skip {part.name}: needs CUDA, this run is on {info.name}")
            continue
        if deadline is not None and shutdown.now() + part.estimate_s > deadline - PACK_RESERVE_S:
            left.append(part)
            room = max(deadline - PACK_RESERVE_S - shutdown.now(), 0)
            print(f"skip {part.name} for now: about {part.estimate_s:.0f} s, and {room:.0f} s are left before "
                  f"--budget {budget_s:g} s")
            continue
        source = "measured" if part.estimate_from != "table" else f"on an {TABLE_GPU}"
        part_start, watch = shutdown.now(), PartWatch(info.device)
        try:  # from the part's first line on, a signal records it as interrupted
            print(f"part {part.name} ({part.set_name}; about {part.estimate_s:.0f} s, {source}; ended at "
                  f"{folder.part_deadlines(part, part_start)[1] - part_start:.0f} s)")
            watch.start()
            with folder.within(part, part_start) as soft:
                result = _signalled_run_part(part, folder.path, prof, device, progress, download, soft)
            status = "ok"
        except Interrupted:
            with shutdown.held(then_raise=False), contextlib.suppress(OSError):
                folder.note(part, "interrupted", shutdown.now() - part_start, watch.stop(), None)
                print(f"interrupted in part {part.name}: recorded as interrupted; {finished} part(s) finished this "
                      "run")
            raise
        except PartOverran as overran:  # ended where it stood; what it wrote before is kept, and the run goes on
            result, status = None, f"stopped: {overran}"
            stopped.append(part.name)
            print(f"stopped part {part.name}: {overran}; what it wrote before is kept, and the run goes on")
        except Exception as error:  # noqa: BLE001  (an OptlabError too: this part failed, the others go on)
            problem = folder.problem(error)
            if problem is not None:
                watch.stop()
                raise OptlabError(folder.stop_line(problem, part, finished)) from error
            result, status = None, f"failed: {type(error).__name__}: {error}".splitlines()[0][:200]
            failures.append(part.name)
            traceback.print_exc()
            folder.log.buffer.write(traceback.format_exc())
        try:
            with shutdown.held():  # the part's row is written whole; a signal meanwhile is raised right after
                folder.note(part, status, shutdown.now() - part_start, watch.stop(), repeats_run(result, part, prof))
        except OSError as error:
            problem = folder.problem(error)
            if problem is None:
                raise
            raise OptlabError(folder.stop_line(problem, part, finished)) from error
        finished += status == "ok"
        folder.save()
        if result is not None:
            yield result
    print(f"reference: {shutdown.now() - shutdown.PROCESS_START:.0f} s since the process start; skipped "
          f"{len(skipped)} part(s) already recorded under {folder.name}")
    if left:
        print(f"left for a later run (over --budget {budget_s:g} s): {', '.join(p.name for p in left)} "
              f"(about {sum(p.estimate_s for p in left) / 60:.1f} min)")
    if failures or stopped:
        raise OptlabError("; ".join(
            [f"these parts failed and have no new results: {', '.join(failures)}"] * bool(failures)
            + [f"these parts ran past their deadline and were ended there, what they wrote before kept: "
               f"{', '.join(stopped)}"] * bool(stopped)))


def unpack(path: str | Path, out: str | Path | None = None) -> str:
    """Merge an archive that ``--archive`` wrote into ``out`` (default: ``results/reference/<its folder>``); the
    line to print."""
    folder, members = archives.unpack(path, out)
    return (f"unpacked {len(members)} files into {store.display_path(folder)}, merged with what was there; commit "
            "that folder, or run the reference with --out on it to add the parts still missing")


class Tee(io.TextIOBase):
    """Text written to several streams at once: the terminal, and the run's log."""

    def __init__(self, *streams: Any) -> None:
        super().__init__()
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()
