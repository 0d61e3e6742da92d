"""gpu-check in parts (``tools/gpu_check.py --parts``): the CUDA-only tests, then the chapters' CUDA checks in groups,
each part with its estimated seconds on one H200 and in the rehearsal on a CPU, and each fitting one short command.

The H200 seconds are estimates until a GPU run measures them (each run's report, ``gpu-check.csv``, keeps every
part's seconds); the CPU seconds are the rehearsal's (``tools/gpu_check.py --rehearse``) on the 2-core CI machine,
shared with other work, so they are high. A new chapter with CUDA checks joins the part whose estimates leave it room,
or a new part.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.errors import OptlabError

PART_CALL_S = 240  # every part fits one command of this many seconds on an H200


DEADLINE_S = 220  # by default a part stops here and writes what finished, before a 240 s command is ended


KILL_AFTER_S = 10  # ``timeout -k``: a command still running this long after its limit's SIGTERM is killed


REHEARSAL_DEADLINE_S = 600  # the rehearsal's default deadline: a shared 2-core CPU is slower than a GPU


STARTUP_S = 20  # a part's process before its first check: Python, torch, the CUDA context, optlab


@dataclass(frozen=True)
class CheckPart:
    """One part of gpu-check: the CUDA-only tests, or some chapters' code cells, in one process."""

    name: str
    what: str
    h200_s: float  # estimated seconds on one H200, start-up included
    cpu_s: float  # seconds in the rehearsal on the 2-core CI machine, start-up included
    chapters: tuple[str, ...] = ()
    tests: bool = False  # the tests marked cuda


# In the order gpu-check runs them, which is also their value: the tests first (every CUDA path at the smallest
# size), then the chapters whose GPU branches hold the most that a CPU cannot check. H200: a guess from the chapters'
# compiles (GPT-2 small's ~45 s a cold compile) and sizes, until a GPU run measures them; a part guessed past its
# call is split (chapters 32 and 33, chapters 11-14 and 15), and every part stops at its deadline whatever the guess.
# CPU: the seconds of each part's checks in one whole rehearsal (make gpu-rehearsal, 2026-12-06: 1518 s in all, the
# process's start included) on the shared 2-core machine under other work, so high and noisy.
CHECK_PARTS = (
    CheckPart("tests", "the CUDA-only tests (every file with a test marked cuda)", 150, 27, tests=True),
    CheckPart("serving", "chapters 30-31: the KV cache and quantized decoding (int8/int4 kernels, CUDA graphs)",
              200, 242, chapters=("30_kv_cache", "31_quantization")),
    CheckPart("speculative", "chapter 32: speculative decoding (a draft and a target GPT, compiled, CUDA graphs)",
              170, 56, chapters=("32_speculative_decoding",)),
    CheckPart("requests", "chapter 33: serving requests (batching, streams, percentiles)", 120, 24,
              chapters=("33_serving",)),
    CheckPart("memory", "chapter 29: the allocator's snapshots, the allocator comparison's child processes",
              90, 70, chapters=("29_memory",)),
    CheckPart("gpt", "chapters 22-24: attention kernels, checkpointing, GPT precision (FP8 on sm 8.9+)", 150, 72,
              chapters=("22_attention", "23_checkpointing", "24_gpt_precision")),
    CheckPart("cnn", "chapters 11 and 14: CUDA graphs, the data pipeline", 170, 77,
              chapters=("11_cuda_graphs", "14_data_pipeline")),
    CheckPart("profiler", "chapter 15: the profiler and the machine's ceilings", 180, 43, chapters=("15_profiling",)),
    CheckPart("your-model", "chapter 37: tuning your own model (the small models in the smoke profile, compiled)",
              120, 79, chapters=("37_your_model",)),
    CheckPart("compile-starts", "chapter 34: compile starts in fresh processes (Triton's caches, portable artifacts)",
              180, 529, chapters=("34_compile_time",)),
    CheckPart("shapes", "chapters 35-36: graph breaks at GPT-2 small's width, CUDA graphs per bucket", 150, 270,
              chapters=("35_graph_breaks", "36_changing_shapes")),
)

# Studies the GPU run does not check: their chapters run on a CPU whatever the machine, so no part holds them.
NOT_CHECKED = ("chapters 19-21 (tensor, pipeline and composed parallelism): two or more ranks on gloo CPU processes; "
               "with one GPU, NCCL cannot run two ranks on it, so their GPU path (NCCL, CUDA tensors) is unchecked",)


def chapters() -> tuple[str, ...]:
    """Every chapter gpu-check runs, in order."""
    return tuple(chapter for part in CHECK_PARTS for chapter in part.chapters)


def check_part(key: str) -> CheckPart:
    """The part named or numbered (from 1) ``key``; anything else is an OptlabError naming the parts."""
    names = [part.name for part in CHECK_PARTS]
    if key.isdigit() and 1 <= int(key) <= len(CHECK_PARTS):
        return CHECK_PARTS[int(key) - 1]
    if key in names:
        return CHECK_PARTS[names.index(key)]
    raise OptlabError(f"--part {key!r} is not a part of gpu-check; allowed: 1-{len(CHECK_PARTS)} or "
                      f"{', '.join(names)}")


def parts_plan(deadline_s: float = DEADLINE_S) -> str:
    """The plan ``--parts`` prints: each part's number, name, deadline (inside its ``PART_CALL_S`` command), what it
    runs, and its seconds on an H200 and in the rehearsal on a CPU, with the command that runs it, and what no part
    checks."""
    lines = [f"gpu-check in {len(CHECK_PARTS)} parts, each within one {PART_CALL_S} s command: a part stops at its "
             f"deadline (--deadline, default {deadline_s:g} s) and writes what finished",
             f"{'part':<15} {'H200 s':>7} {'CPU s':>6} {'deadline s':>10}  what"]
    for number, part in enumerate(CHECK_PARTS, 1):
        lines.append(f"{number:<2} {part.name:<14} {part.h200_s:>5.0f} {part.cpu_s:>6.0f} {deadline_s:>10.0f}  "
                     f"{part.what}")
    lines += [f"all: {sum(p.h200_s for p in CHECK_PARTS) / 60:.1f} min on an H200 (estimated), "
              f"{sum(p.cpu_s for p in CHECK_PARTS) / 60:.1f} min in the rehearsal on the 2-core CI machine",
              f"run one: PYTHONPATH=. timeout -k {KILL_AFTER_S} {PART_CALL_S} python3 tools/gpu_check.py --part N "
              "--out results/reference/<gpu> --archive <gpu>-check.tar.gz",
              *(f"not checked on a GPU: {line}" for line in NOT_CHECKED)]
    return "\n".join(lines)
