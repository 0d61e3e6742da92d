"""The plan for a short GPU job: what to run, in which order and with which time limit, when a job on a GPU has
:data:`JOB_S` seconds in all (the machine's start included) and a command may run at most :data:`COMMAND_S`. The
seed set goes first with ResNet18 first inside a stated budget, then gpu-check's parts and the other sets by value;
what does not fit the first job is the next job's start. ``python -m optlab reference --plan`` prints it, and the GPU
page (book/using/gpu.md) shows the same text.

Adding a set (the ceilings, the first-step chapters, ...) to the plan is one entry in :data:`PLAN`, at the place its
value ranks it::

    reference_step("ceilings", 230, "the measured matmul and bandwidth ceilings"),

(the set must be one ``python -m optlab reference --set`` knows); a new gpu-check part is one ``check_step(name)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .check_parts import CHECK_PARTS, KILL_AFTER_S, NOT_CHECKED, PART_CALL_S, check_part

JOB_S = 900  # one short job: 15 minutes in all
COMMAND_S = 600  # the longest one command may run
MACHINE_START_S = 150  # a cloud instance or a job's node takes minutes to start, out of the job's time
LIMIT_SLACK_S = 10  # a reference command's limit over its --budget: its last pack and the interpreter's exit
GPU_VARIABLE = ("GPU=$(python3 -c \"import torch; print(torch.cuda.get_device_name().removeprefix('NVIDIA ')"
                ".split()[0].lower())\" || echo gpu)")  # h200, h100, a100-sxm4-80gb: the GPU at hand names the folder and archives
OUT, NAME = "results/reference/$GPU", "$GPU"
PACKAGES = ("torch", "torchvision", "numpy", "pandas", "matplotlib", "seaborn", "tqdm", "pytest")
OPTIONAL = {"pynvml": "nvidia-ml-py", "yaml": "PyYAML"}  # module: the package that brings it (NVML; conftest)


@dataclass(frozen=True)
class Step:
    """One command of the plan, with its time limit and what it brings."""

    command: str
    limit_s: int
    what: str
    check: str | None = None  # the gpu-check part it runs, if it is one


def reference_step(set_name: str, budget_s: int, what: str) -> Step:
    """A reference run of ``set_name`` at 4 repeats within ``budget_s``, packed into ``<NAME>-<set>.tar.gz``."""
    return Step(f"python3 -m optlab reference --set {set_name} --max-repeats 4 --budget {budget_s} --out {OUT} "
                f"--archive {NAME}-{set_name}.tar.gz", budget_s + LIMIT_SLACK_S, what)


def check_step(part: str) -> Step:
    """gpu-check's part ``part``, its report packed into ``<NAME>-check.tar.gz``."""
    found = check_part(part)
    return Step(f"python3 tools/gpu_check.py --part {found.name} --out {OUT} --archive {NAME}-check.tar.gz",
                PART_CALL_S, f"gpu-check {found.name}: {found.what}", check=found.name)


PLAN = (  # by value: what the book lacks most, and what would crash a longer run, first
    reference_step("seed", 230, "the nine seed techniques on ResNet18 first, their cheap tables, then deeper"),
    check_step("tests"),
    check_step("serving"),
    check_step("speculative"),
    check_step("requests"),
    check_step("memory"),
    check_step("gpt"),
    reference_step("transformer", 530, "GPT-2 small's techniques, the headline comparison first"),
    check_step("cnn"),
    check_step("profiler"),
    check_step("your-model"),
    reference_step("serving", 230, "serving GPT-2 small: the tables"),
    check_step("compile-starts"),
    check_step("shapes"),
    reference_step("all", 530, "whatever is left; run again, each run adds what is missing"),
)


def first_job(plan: tuple[Step, ...] = PLAN) -> int:
    """How many of ``plan``'s steps fit one job: their limits and the machine's start within :data:`JOB_S`."""
    spent, fitted = MACHINE_START_S, 0
    for step in plan:
        if spent + step.limit_s > JOB_S:
            break
        spent, fitted = spent + step.limit_s, fitted + 1
    return fitted


def describe_short_plan() -> str:
    """The plan as shell lines: the packages it needs and how to bring them, then each command under ``timeout -k``
    with its limit (killed :data:`KILL_AFTER_S` after its SIGTERM if it is still running), the first job's steps apart
    from the next job's, and what the plan does not check."""
    fitted = first_job()
    lines = [f"# A short GPU job: {JOB_S // 60} minutes in all (about {MACHINE_START_S / 60:.1f} of them the "
             f"machine's start), each command within {COMMAND_S // 60} minutes.",
             "# Needs Python 3.11+ and these packages, no Jupyter and no network; check them first:",
             f"python3 -c \"import {', '.join(PACKAGES)}\"",
             f"# optional: {', '.join(f'{package} (import {module})' for module, package in OPTIONAL.items())}.",
             "# Missing ones come as wheels from a machine with a network, for the GPU machine's Python and platform:",
             "#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 "
             "-d wheels seaborn tqdm",
             "#   then copy wheels/ over; on the GPU machine: pip install --no-index --find-links wheels seaborn tqdm",
             "export PYTHONPATH=.",
             f"export {GPU_VARIABLE}   # every archive and the results folder are named after the GPU they ran on",
             f"# the first job: {fitted} commands, {sum(s.limit_s for s in PLAN[:fitted]) / 60:.0f} minutes of limits"]
    for index, step in enumerate(PLAN):
        if index == fitted:
            lines.append("# the next job, in this order (a reference command skips the parts already recorded):")
        lines.append(f"timeout -k {KILL_AFTER_S} {step.limit_s} {step.command}   # {step.what}")
    lines += [f"# not checked on a GPU: {line}" for line in NOT_CHECKED]
    return "\n".join(lines)


def parts_left_out() -> list[str]:
    """gpu-check's parts that the plan leaves out (none, unless a part was added without its step)."""
    return [part.name for part in CHECK_PARTS if part.name not in {step.check for step in PLAN}]
