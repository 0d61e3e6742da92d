"""The GPU reference run: part by part, within a time budget, resumable by any number of shorter runs.

A *part* is one model of one technique (it adds that model to ``<out>/<technique>.json``) or one study's extra
tables (``<out>/<table>.csv``, CUDA only). Parts run in a fixed priority order: the nine seed techniques and their
tables, then precision, the data pipeline and the optimizers with theirs, the all-together stack, and the compiling
techniques; within a set, breadth first: every technique on ResNet18, then the set's cheap tables, then the other
models from the cheapest, so that a cut loses depth, not techniques. ``--plan`` prints every part with its steps and
its estimated seconds: measured by an earlier run on the same GPU where ``reference-parts.csv`` has it
(:func:`measured_seconds`), else from the H200 step-time table below (:func:`estimate`). ``--budget`` is a hard
deadline counted from the process start: a part that would end past it is skipped (later, smaller ones still run),
and a running part stops at the end of a repeat once it passes its share. A part already recorded under ``<out>`` by
this machine, torch version and commit in this profile is skipped, so each run adds what is missing: a technique's
record says which models it holds, and ``reference-parts.csv`` lists every part that ran, with the repeats it ran and
what the GPU did during it (:mod:`optlab.core.machine.gpu_sampler`).

After every part, ``reference.log`` gets the part's lines and ``--archive PATH`` re-packs the folder into one
tar.gz; SIGTERM, SIGINT and SIGHUP record the part in flight as interrupted, pack, and end the run with one line, so
a job killed at its time limit keeps every part it finished (a SIGKILL loses the part in flight). ``--unpack PATH``
merges such an archive into ``results/reference/<machine>/``. A disk that fills up, or an output folder that can no
longer be written, stops the run at once with one line; a part that fails for its own reasons is recorded and the run
goes on.

Every part runs under its own deadline (``planning.part_limit_s``): a technique stops at the end of a repeat past
its share, and any part still running at its hard deadline (a study's tables included) is ended there, recorded as
``stopped``, and the run goes on with what it finished kept.

The package's parts: ``costs`` (the H200 step-time table and the estimates), ``planning`` (the parts in order, the
plan, each part's deadline and what a budget leaves out), ``parts_list`` (what a results folder records), ``outputs``
(the writes, the problems that stop a run, the log), ``run_folder`` (the one owner of a run's folder: its parts list,
log, archive, stop line and each part's deadline) and ``running`` (the run itself, and ``--unpack``); ``check_parts``
(gpu-check's parts and their seconds) and ``short_plan`` (the order and time limits of a short GPU job).
"""
from .outputs import PackFailed, check_outputs
from .planning import describe_plan, plan
from .running import run_reference, unpack

__all__ = ["PackFailed", "check_outputs", "describe_plan", "plan", "run_reference", "unpack"]
