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
what the GPU did during it (:mod:`optlab.core.gpu_sampler`).

After every part, ``reference.log`` gets the part's lines and ``--archive PATH`` re-packs the folder into one
tar.gz; SIGTERM, SIGINT and SIGHUP record the part in flight as interrupted, pack, and end the run with one line, so
a job killed at its time limit keeps every part it finished (a SIGKILL loses the part in flight). ``--unpack PATH``
merges such an archive into ``results/reference/<machine>/``. A disk that fills up, or an output folder that can no
longer be written, stops the run at once with one line; a part that fails for its own reasons is recorded and the run
goes on.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import errno
import importlib
import io
import math
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import pandas as pd
import torch

from ..core import archive as archives, results_check, store
from ..core.config import RunConfig
from ..core.device import DeviceInfo, resolve_device
from ..core.environment import git_commit
from ..core.errors import OptlabError
from ..core.gpu_sampler import PartWatch
from ..core.experiments import ExperimentResult, run_experiment
from ..core.profiles import Profile, get_profile
from ..core.registry import Experiment, get_experiment
from ..core import shutdown
from ..core.shutdown import Interrupted, signals_interrupt
from ..core.techniques import technique_set
from ..core.transformer import GPT_SIZES
from ..core.workload import get_workload

PRIORITY = ("seed", "beyond", "stack", "compile", "transformer", "serving")  # the sets' order; "all": every one
TECHNIQUE_ORDER = {  # within a set, where it differs: the headline comparisons first, compilation last
    "beyond": ("precision", "data_pipeline", "optimizers"),
    "transformer": ("gpt_all_together", "attention", "gpt_precision", "checkpointing", "gpt_optimizers", "gpt_shapes",
                    "gpt_compile", "gpt_compile_max_autotune"),
}
# The extra tables of each set: modules whose ``run_reference(out, device)`` measures and saves them (CUDA only).
EXTRAS = {
    "seed": ("microbench", "autotune"),
    "beyond": ("numerics", "tf32", "optimizer_bench", "cuda_graphs", "pipeline"),
    "stack": ("profiling", "learning"),  # profiling's "after" configuration compiles
    "compile": (),
    "transformer": (),
    "serving": ("serving.batching",),
}
MANIFEST = "reference-parts"  # <out>/reference-parts.csv: every part that ran, with its key, status and seconds
LOG = "reference.log"  # <out>/reference.log: what every run printed, one run after the other
TABLE_GPU = "H200"  # the GPU the step-time table is for

# Estimated H200 seconds, used for a part until a run on the same GPU has measured it. A training step at batch 128,
# full width, eager fp32 (TF32 convolutions), from the FLOPs: a CIFAR ResNet18 step is 0.43 TFLOP (6 x 0.555 GMAC x
# 128 images), ResNet50 1.0 and ResNet101 1.9; at about 70 TFLOP/s, a conservative 14 % of the H200's dense TF32
# peak, that is 6, 14 and 28 ms. MobileNetV2's depthwise convolutions are memory-bound: 10 ms, as surveyed. The
# rest: the loader's per-image cost measured on the 2-core CI machine, and guesses for compilation and set-up.
TRAIN_STEP_S = {"resnet18": 0.006, "resnet50": 0.014, "resnet101": 0.028, "mobilenet_v2": 0.010}
AMP_FACTOR = 0.5  # fp16 or bf16 autocast: half the step
# The GPT, per token trained, costed by what differs between configurations. GPT-2 small's training step is 6 x 124M
# FLOPs a token in its linear layers and head (0.74 GFLOP) plus 0.11 GFLOP in the two attention matmuls at 1024 tokens
# (torch.utils.flop_counter); in strict fp32 at a conservative 45 TFLOP/s of the H200's 67 that is 16.5 and 2.5 us a
# token. Memory-bound work adds to it: the hand-written attention writes, masks and reads back the T x T scores of
# every head (12 layers x 12 heads x 1024 x 4 bytes, about six passes forward and backward: 3.5 MB, 0.9 us a token at
# 4 TB/s), and the LayerNorms, GELUs and residual adds move about 2.2 MB a token in fp32 (0.55 us). gpt_tiny is the
# same split at the CPU's scale.
GPT_TOKEN_S = {  # strict fp32, eager, no checkpointing, the raw vocabulary: seconds a token trained, per kind of work
    "gpt2_small": {"matmul": 11.3e-6, "head": 5.2e-6, "attention": 2.5e-6, "scores": 0.9e-6, "pointwise": 0.55e-6},
    "gpt_tiny": {"matmul": 0.033e-6, "head": 0.002e-6, "attention": 0.008e-6, "scores": 0.004e-6,
                 "pointwise": 0.003e-6},
}
RAW_VOCAB = {"gpt2_small": 50257, "gpt_tiny": 65}  # the vocabulary GPT_TOKEN_S's head is costed at
UNALIGNED_HEAD_FACTOR = 1.1  # a head whose rows are no multiple of 64 fills its last tile partly (a guess)
# One optimizer step of GPT-2 small's 148 tensors (124M parameters): the for-loop AdamW launches a few kernels per
# tensor, foreach a few per list, fused one; seconds a step, scaled by the parameters (a guess from launch counts)
OPTIMIZER_STEP_S = {"gpt2_small": {"for_loop": 0.008, "default": 0.003, "foreach": 0.003, "fused": 0.0015},
                    "gpt_tiny": {"for_loop": 0.002, "default": 0.0006, "foreach": 0.0006, "fused": 0.0003}}
# The matmuls' time against strict fp32: TF32 and bf16 tensor cores at a conservative share of their peaks (494.5
# and 989 TFLOP/s dense), FP8 little better than bf16 at GPT-2 small's 768-wide matmuls (the casts and amax
# reductions around each cost a fixed share; torchao: 0.80x on a 1024x2048x1024 linear)
MATMUL_FACTOR = {"fp32": 1.0, "tf32": 0.25, "bf16": 0.15, "fp16": 0.15, "fp8": 0.13}
MEMORY_FACTOR = {"fp32": 1.0, "tf32": 1.0, "bf16": 0.6, "fp16": 0.6, "fp8": 0.6}  # 16-bit activations, fp32 softmax
# The attention matmuls' time per kernel against flash attention in the same precision. The hand-written one and
# SDPA's math backend also write the scores out ("scores" above); the memory-efficient kernel runs about 1.3x flash;
# FlexAttention about 90 % of flash attention's speed (PyTorch's FlexAttention post: 90 % of FlashAttention-2 forward
# on an A100). In strict fp32, SDPA's flash and cuDNN kernels do not run and SDPA picks the memory-efficient one.
ATTENTION_FACTOR = {"manual": 1.0, "sdpa_math": 1.0, "sdpa": 1.0, "sdpa_flash": 1.0, "sdpa_cudnn": 0.9,
                    "sdpa_efficient": 1.3, "flex": 1 / 0.9}
WRITES_SCORES = ("manual", "sdpa_math")
FP32_SDPA_FACTOR = 1.3  # SDPA in fp32 (no flash, no cuDNN): the memory-efficient kernel
COMPILED_POINTWISE_FACTOR = 0.5  # Inductor fuses the LayerNorms, GELUs and residual adds: about half the traffic
COMPILED_SCORES_FACTOR = 0.7  # and the hand-written attention's mask and softmax into one kernel
AUTOTUNED_MATMUL_FACTOR = 0.95  # max-autotune's matmul templates: a few per cent over cuBLAS at these shapes
# Checkpointing recomputes in the backward pass: every block's forward (a third of a step's arithmetic and traffic)
# for full checkpointing; only the pointwise ops (a third of their traffic) for selective
RECOMPUTED = {"none": (), "full": ("matmul", "attention", "scores", "pointwise"), "selective": ("pointwise",)}  # the
# head is outside the blocks: never recomputed
RECOMPUTE_FACTOR = 4 / 3
# A cold compile of GPT-2 small's training step (ml-engineering: cold compiles of Llama models take 22-47 s);
# max-autotune also benchmarks matmul templates for each shape (a guess: three more minutes at most, leaving its
# part a margin inside PART_LIMIT_S); FlexAttention compiles its own kernel, forward and backward, in any mode
GPT_COMPILE_S = {"default": 45.0, "reduce-overhead": 55.0, "max-autotune": 150.0, "max-autotune-no-cudagraphs": 150.0}
FLEX_COMPILE_S = 20.0
PART_MARGIN = 0.2  # a part's estimate leaves this share of PART_LIMIT_S free; --plan warns where it does not
WINDOW_S = 5e-6
EVAL_FACTOR = 1 / 3  # an evaluation step is a forward pass, about a third of a training step
MIN_STEP_S = 0.002  # a step launches hundreds of kernels: never faster than this
IMAGE_S = {"train": 60e-6, "test": 30e-6}  # one loader process's PIL decode and transforms per image
WORKER_STARTUP_S = 0.3  # starting a phase's loader workers
COMPILE_S = {"train": 60.0, "test": 25.0}  # a cold Inductor compile of a CIFAR model per phase (40-90 s a model)
COMPILE_FACTOR = {"default": 1.0, "reduce-overhead": 1.2, "max-autotune": 3.0, "max-autotune-no-cudagraphs": 3.0}
VARIANT_SETUP_S = 0.4  # a variant's model, optimizer and loaders (ResNet101 builds in 0.4 s on the CI machine)
FRESH_PROCESS_S = 4.0  # an isolated variant's own process: interpreter, torch, CUDA context, data sets
PART_SETUP_S = 0.3  # a part's environment capture (nvidia-smi) and record writes
TABLE_S = {"microbench": 20, "autotune": 45, "numerics": 40, "tf32": 15, "optimizer_bench": 30, "cuda_graphs": 60,
           "pipeline": 40, "profiling": 120, "learning": 150,  # each study's tables, whole
           "serving.batching": 200}  # GPT-2 small's training (cached after), 8 decode graphs, 3 rates x 2 x 6 rounds
PART_LIMIT_S = 300  # no part may need more than 5 minutes: a killed command loses only the part it was in
CHEAP_TABLE_S = 60  # a set's tables this cheap run right after its techniques on the first model
STARTUP_S = 15.0  # from the process start to the first part: imports, the CUDA context, the data sets
PACK_RESERVE_S = 10.0  # kept free before the deadline: the last part's record, the log and the archive
SHARE_FACTOR, SHARE_SLACK_S = 1.5, 10.0  # a part stops at a repeat's end past 1.5 x its estimate + 10 s
RECIPE = ("python3 -m optlab reference --set seed --max-repeats 4 --budget 540 --archive h200.tar.gz",
          "the whole seed set at 4 repeats: about 7 of the 8.6 minutes --budget 540 leaves for parts")


@dataclass(frozen=True)
class Part:
    """One unit of the reference run: a technique on one model, or one study's tables."""

    set_name: str
    name: str
    steps: int  # training and evaluation steps, warm-up included (0 for tables)
    estimate_s: float  # estimated seconds on one H200
    technique: str | None = None
    model: str | None = None
    module: str | None = None  # a study whose run_reference writes tables
    needs_cuda: bool = False
    estimate_from: str = "table"  # "table", or "measured (<machine folder>)" where an earlier run timed the part


def gpt_precision(config: RunConfig) -> str:
    """What the GPT's matmuls run in under ``config``: fp8, bf16 or fp16 autocast, tf32, or strict fp32."""
    if config.fp8:
        return "fp8"
    if config.amp_dtype != "none":
        return config.amp_dtype
    return "tf32" if config.matmul_tf32 else "fp32"


def token_costs(config: RunConfig) -> dict[str, float]:
    """Estimated H200 seconds a token of ``config``'s GPT training step spends on each kind of work: the blocks'
    matmuls and the head's (by precision, autotuned or not; the head by its vocabulary), attention matmuls (by kernel and precision), the scores a kernel writes out, and
    pointwise ops (compiled or not), each with checkpointing's recomputation."""
    base, precision = GPT_TOKEN_S[config.model], gpt_precision(config)
    length = config.seq_len or GPT_SIZES[config.model].block_size
    attention_scale = length / GPT_SIZES[config.model].block_size  # attention FLOPs a token grow with the length
    kernel = ATTENTION_FACTOR[config.attention] * (FP32_SDPA_FACTOR if precision in ("fp32", "tf32") and
                                                   config.attention in ("sdpa", "sdpa_flash", "sdpa_cudnn") else 1)
    compiled = config.compile_mode != "none"
    matmul = MATMUL_FACTOR[precision] * (AUTOTUNED_MATMUL_FACTOR if config.compile_mode.startswith("max-autotune")
                                         else 1)
    vocab = config.vocab_size or RAW_VOCAB[config.model]
    costs = {"matmul": base["matmul"] * config.width ** 2 * matmul,
             "head": base["head"] * config.width * vocab / RAW_VOCAB[config.model] * matmul
             * (UNALIGNED_HEAD_FACTOR if vocab % 64 else 1),
             "attention": base["attention"] * config.width * attention_scale * MATMUL_FACTOR[
                 "bf16" if precision == "fp8" else precision] * kernel,
             "scores": (base["scores"] * attention_scale * MEMORY_FACTOR[precision]
                        * (COMPILED_SCORES_FACTOR if compiled else 1) if config.attention in WRITES_SCORES else 0.0),
             "pointwise": base["pointwise"] * config.width * MEMORY_FACTOR[precision]
             * (COMPILED_POINTWISE_FACTOR if compiled else 1)}
    return {kind: cost * (RECOMPUTE_FACTOR if kind in RECOMPUTED[config.checkpointing] else 1)
            for kind, cost in costs.items()}


def _token_compute_seconds(config: RunConfig) -> float:
    """Estimated H200 seconds of one GPT training step of ``config``: its tokens at :func:`token_costs`, and its
    optimizer step (by implementation)."""
    tokens = config.samples_per_step * get_workload(config.workload).items_in(config)
    optimizer = OPTIMIZER_STEP_S[config.model][config.optimizer_impl] * config.width ** 2
    return tokens * sum(token_costs(config).values()) + optimizer


def compile_seconds(config: RunConfig, phase: str) -> float:
    """Estimated seconds ``config`` spends compiling in ``phase``: Inductor's compile in its mode (the GPT's own
    table for a GPT), and FlexAttention's kernel, which compiles in any mode."""
    gpt = config.model in GPT_TOKEN_S
    seconds = 0.0
    if config.compile_mode != "none":
        seconds += (GPT_COMPILE_S[config.compile_mode] * (1 if phase == "train" else EVAL_FACTOR) if gpt
                    else COMPILE_S[phase] * COMPILE_FACTOR[config.compile_mode])
    if gpt and config.attention == "flex":
        seconds += FLEX_COMPILE_S
    return seconds


def step_seconds(config: RunConfig, phase: str) -> float:
    """Estimated H200 seconds of one step of ``config`` in ``phase``, the loader included."""
    if config.model in GPT_TOKEN_S:
        compute, per_sample_load = _token_compute_seconds(config), WINDOW_S
    else:
        compute = TRAIN_STEP_S[config.model] * config.images_per_step / 128 * config.width ** 2
        compute *= AMP_FACTOR if config.amp_dtype != "none" else 1
        per_sample_load = IMAGE_S[phase]
    compute = max(compute * (EVAL_FACTOR if phase == "test" else 1), MIN_STEP_S)
    if config.data_on_device:
        return compute
    loading = config.images_per_step * per_sample_load
    return compute + loading if config.num_workers == 0 else max(compute, loading / config.num_workers)


def config_assumption(config: RunConfig) -> str:
    """What the estimate assumes for one configuration: for a GPT the microseconds a token by kind of work, its
    precision, attention kernel, compile mode and checkpointing; for a CNN its step time; and any compile seconds."""
    if config.model in GPT_TOKEN_S:
        costs = token_costs(config)
        kinds = ", ".join(f"{kind} {seconds * 1e6:.3g}" for kind, seconds in costs.items() if seconds)
        line = (f"{sum(costs.values()) * 1e6:.3g} us a token ({kinds}; {gpt_precision(config)}, attention "
                f"{config.attention}, compile {config.compile_mode}, checkpointing {config.checkpointing}) + "
                f"{OPTIMIZER_STEP_S[config.model][config.optimizer_impl] * 1e3:.3g} ms AdamW {config.optimizer_impl}")
    else:
        line = f"{step_seconds(config, 'train') * 1e3:.3g} ms a training step"
    compiling = compile_seconds(config, "train")
    return line + (f" + {compiling:g} s compile" if compiling else "")


def part_assumptions(part: Part, profile: Profile) -> list[str]:
    """The assumptions behind a technique part's table estimate, one line per variant (none for a study's tables)."""
    if not part.technique:
        return []
    configs = get_experiment(part.technique).configs(part.model, profile)
    return [f"  {label}: {config_assumption(config)}" for label, config in configs.items()]


def runs_per_variant(profile: Profile) -> int:
    """How many times a part may run each variant in ``profile``: its discarded repeats and the cap on its timed
    ones (a run adds repeats while an answer is unclear, so the plan counts the most it may take)."""
    return profile.warmup_repeats + profile.max_repeats


def estimate(experiment: Experiment, configs: dict[str, RunConfig], profile: Profile,
             repeats: int | None = None) -> tuple[int, float]:
    """Steps and estimated H200 seconds of one model's run of ``experiment``: every variant, repeat and phase, its
    compilation included; at most the profile's time budget past the set-up once the fewest repeats have run.
    ``repeats``: runs per variant (default: :func:`runs_per_variant` of ``profile``)."""
    repeats = runs_per_variant(profile) if repeats is None else repeats
    setup = PART_SETUP_S + len(configs) * (VARIANT_SETUP_S + (FRESH_PROCESS_S if experiment.isolate_variants else 0))
    steps, seconds = 0, setup
    for config in configs.values():
        for phase in experiment.phases:
            timed = profile.steps if phase == "train" else profile.test_steps
            epoch = get_workload(config.workload).sizes()[phase] // config.images_per_step
            per_repeat = profile.warmup_steps + (epoch if timed is None else timed)
            startups = 1 if config.persistent_workers else repeats
            if config.num_workers == 0 or config.data_on_device:
                startups = 0
            steps += per_repeat * repeats
            seconds += per_repeat * repeats * step_seconds(config, phase) + startups * WORKER_STARTUP_S
            seconds += compile_seconds(config, phase)
    if repeats > profile.warmup_repeats + profile.repeats and math.isfinite(profile.time_budget_s):
        _, minimum = estimate(experiment, configs, profile, profile.warmup_repeats + profile.repeats)
        # the rounds, compilation in the warm-up ones included, start no pair past the time budget once the
        # fewest repeats have run
        seconds = min(seconds, max(minimum, setup + profile.time_budget_s))
    return steps, seconds


def set_names(set_name: str) -> tuple[str, ...]:
    """The sets ``set_name`` stands for, in priority order (an unknown name is an OptlabError)."""
    technique_set(set_name)
    return PRIORITY if set_name == "all" else (set_name,)


def measured_seconds(gpu: str | None, profile: Profile, folders: Iterable[Path]) -> dict[str, tuple[float, str]]:
    """Seconds that earlier runs measured per part on GPU ``gpu`` (None: any H200, the table's GPU) in ``profile``,
    from the ``reference-parts.csv`` of ``folders``: a technique's part scaled to ``profile``'s repeats, a study's
    tables as they were. The latest ok row of each part wins; each value comes with the folder that measured it."""
    frames = [_manifest(folder).assign(folder=folder.name) for folder in folders if (folder / f"{MANIFEST}.csv").is_file()]
    frames = [frame for frame in frames if {"device_name", "status", "profile", "seconds"} <= set(frame)]
    if not frames:
        return {}
    rows = pd.concat(frames, ignore_index=True)
    machine = rows["device_name"] == gpu if gpu else rows["device_name"].str.contains(TABLE_GPU, case=False, na=False)
    rows = rows[machine & (rows["status"] == "ok") & (rows["profile"] == profile.name)]
    rows = rows.sort_values("finished", kind="stable") if "finished" in rows else rows
    found = {}
    for row in rows.to_dict(orient="records"):
        seconds, then = float(row["seconds"]), pd.to_numeric(row.get("repeats"), errors="coerce")
        if not row["part"].endswith(" tables") and pd.notna(then) and then > 0:
            seconds *= runs_per_variant(profile) / then
        found[row["part"]] = (seconds, row["folder"])
    return found


def reference_folders(out: str | Path | None) -> list[Path]:
    """Where earlier runs' parts lists are looked for: every machine under ``results/reference``, and ``out``."""
    folders = [store.REFERENCE_DIR / name for name in store.reference_machines()]
    if out is not None and Path(out).is_dir() and Path(out).resolve() not in {f.resolve() for f in folders}:
        folders.append(Path(out))
    return folders


MODEL_ORDER = tuple(sorted(TRAIN_STEP_S, key=TRAIN_STEP_S.get))  # the depth of a set, cheapest model first


def _depth(part: Part) -> int:
    """Where a part falls in its set, breadth first: the first model's techniques, the cheap tables, the other models
    from the cheapest, the dear tables."""
    if part.module:
        return 1 if part.estimate_s <= CHEAP_TABLE_S else 2 * len(MODEL_ORDER)
    return 2 * MODEL_ORDER.index(part.model) if part.model in MODEL_ORDER else 2 * len(MODEL_ORDER) - 1


def plan(set_name: str, profile: Profile, measured: dict[str, tuple[float, str]] | None = None) -> list[Part]:
    """Every part of ``set_name`` (``all``: of every set) in priority order, breadth first within a set (every
    technique on ResNet18, the cheap tables, then the other models from the cheapest), with steps and estimates:
    ``measured`` seconds (:func:`measured_seconds`) where a part has them, else the H200 table's."""
    parts = []
    for name in set_names(set_name):
        order = TECHNIQUE_ORDER.get(name, ())
        techniques = sorted(technique_set(name), key=lambda t: order.index(t) if t in order else len(order))
        in_set = []
        for technique in techniques:
            experiment = get_experiment(technique)
            for model in experiment.default_models(profile):
                steps, seconds = estimate(experiment, experiment.configs(model, profile), profile)
                in_set.append(Part(name, f"{technique} {model}", steps, seconds, technique=technique, model=model,
                                   needs_cuda=experiment.needs_cuda))
        in_set += [Part(name, f"{module} tables", 0, TABLE_S[module], module=module, needs_cuda=True)
                   for module in EXTRAS[name]]
        parts += sorted(in_set, key=_depth)
    measured = measured or {}
    return [replace(part, estimate_s=measured[part.name][0], estimate_from=f"measured ({measured[part.name][1]})")
            if part.name in measured else part for part in parts]


def run_key(info: DeviceInfo) -> dict[str, str]:
    """What a recorded part must share with this run to be skipped: the machine, torch version and commit."""
    return {"device_name": info.name, "torch": torch.__version__, "git_commit": git_commit()}


def _manifest(folder: Path) -> pd.DataFrame:
    """The parts list of ``folder`` (empty if none); one with a missing column or a bad row is an OptlabError."""
    path = folder / f"{MANIFEST}.csv"
    return results_check.read_parts_list(path) if path.is_file() else pd.DataFrame(columns=["part"])


def recorded(parts: list[Part], folder: Path, key: dict[str, str], profile: Profile) -> set[str]:
    """The names of ``parts`` already recorded under ``folder`` for ``key``: a technique's model in its record (made
    with ``profile``), a study's tables in the manifest with status ok (tables have sizes of their own)."""
    done = set()
    manifest = _manifest(folder)
    records = {part.technique: store.resumable(folder / f"{part.technique}.json", key, profile)
               for part in parts if part.technique}
    for part in parts:
        if part.technique:
            record = records[part.technique]
            if record and part.model in {row["model"] for row in record["samples"]}:
                done.add(part.name)
        elif not manifest.empty:
            rows = manifest[(manifest["part"] == part.name) & (manifest["status"] == "ok")]
            if any(all(row[k] == v for k, v in key.items()) for _, row in rows.iterrows()):
                done.add(part.name)
    return done


def _note_part(folder: Path, part: Part, key: dict[str, str], profile: Profile, status: str, seconds: float,
               gpu: dict[str, Any], repeats: int | None) -> None:
    row = {"part": part.name, "set": part.set_name, "status": status, "seconds": round(seconds, 1),
           "estimate_s": round(part.estimate_s, 1), "estimate_from": part.estimate_from, **key,
           "profile": profile.name, "repeats": repeats, **gpu,
           "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    manifest = _manifest(folder)
    manifest = manifest[manifest["part"] != part.name] if not manifest.empty else None
    store.save_table(pd.concat([manifest, pd.DataFrame([row])], ignore_index=True), folder, MANIFEST)


def repeats_run(result: ExperimentResult | None, part: Part, profile: Profile) -> int | None:
    """How many times ``part`` ran each variant: its discarded repeats and the timed ones it took (None for tables
    and for a part that has no result)."""
    if result is None or part.model is None:
        return None
    rounds = result.record.get("rounds", {}).get(part.model)
    return profile.warmup_repeats + rounds["repeats"] if rounds else None


def available_s(budget_s: float | None) -> float:
    """Seconds a plan may fill under ``budget_s`` counted from the process start: less the start-up and the
    reserve kept for packing (infinite without a budget)."""
    return math.inf if budget_s is None else budget_s - STARTUP_S - PACK_RESERVE_S


def plan_table(parts: list[Part], done: set[str], budget_s: float | None, cuda: bool) -> pd.DataFrame:
    """The plan as a table: each part's set, steps, estimate, and what this command would do with it. A part that
    does not fit in what is left of the budget is skipped, and the later ones that fit still run."""
    rows, spent, room = [], 0.0, available_s(budget_s)
    for part in parts:
        if part.name in done:
            action = "recorded: skip"
        elif part.needs_cuda and not cuda:
            action = "needs CUDA: skip"
        elif spent + part.estimate_s > room:
            action = "left: over budget"
        else:
            action, spent = "run", spent + part.estimate_s
        rows.append({"set": part.set_name, "part": part.name, "steps": part.steps,
                     "est_s": round(part.estimate_s, 1), "estimate from": part.estimate_from, "this run": action})
    return pd.DataFrame(rows)


def _stage(part: Part) -> str:
    return "tables" if part.module else part.model or ""


def cut_lines(parts: list[Part], table: pd.DataFrame) -> list[str]:
    """What each cut would lose: for each stage of the run order (a model's parts, a set's tables), the minutes
    by which it ends, and what a budget that ends before it leaves out."""
    todo = table["this run"].isin(["run", "left: over budget"]).tolist()
    stages: list[tuple[str, str, float]] = []  # (set, stage, seconds at its end)
    elapsed = 0.0
    for part, listed in zip(parts, todo):
        if not listed:
            continue
        elapsed += part.estimate_s
        if stages and stages[-1][:2] == (part.set_name, _stage(part)):
            stages[-1] = (part.set_name, _stage(part), elapsed)
        else:
            stages.append((part.set_name, _stage(part), elapsed))
    lines = []
    for index, (set_name, stage, end) in enumerate(stages):
        lost = ", ".join(f"{s} {g}" for s, g, _ in stages[index:])
        lines.append(f"cut: --budget {math.ceil(end + STARTUP_S + PACK_RESERVE_S)} s runs set {set_name} through "
                     f"{stage}; less loses parts of: {lost}")
    return lines


def reference_profile(profile: str | Profile | None, cuda: bool, repeats: int | None = None,
                      max_repeats: int | None = None, time_budget_s: float | None = None) -> Profile:
    """The run's profile (``auto``: quick on CUDA), with the minimum and cap of repeats and the time budget given."""
    return get_profile(profile, cuda).with_sizes(repeats=repeats, max_repeats=max_repeats, time_budget_s=time_budget_s)


def target_gpu(info: DeviceInfo) -> str | None:
    """The GPU whose measured seconds a plan uses: this one on CUDA; elsewhere None (any H200, the table's GPU)."""
    return info.name if info.is_cuda else None


def describe_plan(set_name: str = "all", profile: str | Profile | None = None, device: str = "auto",
                  out: str | Path | None = None, budget_s: float | None = None, repeats: int | None = None) -> str:
    """The plan of ``set_name`` as printed text: every part with where its estimate came from, each set's total in
    minutes, what each cut would lose, and the recipe that fits one 10-minute command."""
    info = resolve_device(device)
    prof = reference_profile(profile, True, repeats)  # the reference's profile on a GPU: quick, unless one is named
    gpu = target_gpu(info)
    parts = plan(set_name, prof, measured_seconds(gpu, prof, reference_folders(out)))
    done = recorded(parts, Path(out), run_key(info), prof) if out is not None and Path(out).is_dir() else set()
    table = plan_table(parts, done, budget_s, info.is_cuda)
    totals = table.groupby("set", sort=False)["est_s"].agg(["count", "sum"])
    lines = [f"reference plan, profile {prof.name} ({prof.describe_repeats()}): estimated seconds on "
             f"{gpu or f'one {TABLE_GPU}'}, measured by an earlier run on it where a "
             f"results/reference/<machine>/{MANIFEST}.csv has the part, else from the {TABLE_GPU} step-time table "
             "(optlab/commands/reference.py)", table.to_string(index=False), ""]
    lines += [f"set {name}: {int(row['count'])} parts, {row['sum'] / 60:.1f} min" for name, row in totals.iterrows()]
    measured = sum(part.estimate_from != "table" for part in parts)
    lines.append(f"estimates: {measured} part(s) measured, {len(parts) - measured} from the table")
    runs = table["this run"] == "run"
    lines.append(f"all listed: {table['est_s'].sum() / 60:.1f} min; the command would run "
                 f"{table['est_s'][runs].sum() / 60:.1f} min of it"
                 + (f" within --budget {budget_s:g} s (a deadline from the process start: {STARTUP_S:g} s of start-up "
                    f"and {PACK_RESERVE_S:g} s to pack are kept out, {available_s(budget_s) / 60:.1f} min for parts)"
                    if budget_s is not None else ""))
    over = int((table["this run"] == "left: over budget").sum())
    if over:
        lines.append(f"left for a later run: {over} part(s); each part that does not fit is skipped and the later "
                     "ones that fit still run")
    lines += cut_lines(parts, table)
    lines.append(f"recipe for one 10-minute command on an {TABLE_GPU}: {RECIPE[0]} ({RECIPE[1]}); a part that runs "
                 f"past {SHARE_FACTOR:g} x its estimate stops at the end of a repeat, one that would end past the "
                 "deadline is skipped, and the archive is packed after every part: run the same command again to add "
                 "what was left")
    lines += [f"warning: {part.name} may need more than {PART_LIMIT_S} s" for part in parts
              if part.estimate_s > PART_LIMIT_S]
    lines += [f"warning: {part.name} ({part.estimate_s:.0f} s) leaves less than {PART_MARGIN:.0%} of its "
              f"{PART_LIMIT_S} s part free" for part in parts
              if (1 - PART_MARGIN) * PART_LIMIT_S < part.estimate_s <= PART_LIMIT_S]
    lines.append(f"assumptions per part (the {TABLE_GPU} table's, where a part's estimate is from the table):")
    for part in parts:
        if part.estimate_from == "table" and part.technique:
            lines += [f"{part.name}:", *part_assumptions(part, prof)]
    return "\n".join(lines)


def _run_part(part: Part, folder: Path, prof: Profile, device: str, progress: bool, download: bool,
              deadline: float | None = None) -> ExperimentResult | None:
    if part.module:
        for path in importlib.import_module(f"optlab.studies.{part.module}").run_reference(folder, device):
            print(f"wrote {store.display_path(path)}")
        return None
    return run_experiment(part.technique, models=[part.model], profile=prof, device=device, out=folder,
                          progress=progress, download=download, filename=f"{part.technique}.json", resume=True,
                          deadline=deadline)


FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk (or the quota) is full
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # read-only, or not ours to write


def _folder_writable(folder: Path) -> bool:
    try:
        store.writable_dir(folder)
    except OptlabError:
        return False
    return True


def output_problem(error: BaseException, folder: Path) -> OSError | None:
    """The OSError behind ``error`` that means no more results can be written to ``folder``: a full disk or quota
    anywhere, or a permission or read-only error while ``folder`` itself cannot be written any more. None when the
    error is the part's own."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and (seen.errno in FULL or (seen.errno in UNWRITABLE
                                                                 and not _folder_writable(folder))):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def stop_line(problem: OSError, folder: Path, part: Part, kept: int) -> str:
    """The one line a run ends with when ``folder`` can no longer be written."""
    where = f" ({problem.filename})" if problem.filename else ""
    return (f"cannot write results to {store.display_path(folder)}: {problem.strerror or problem}{where}; stopped "
            f"at part {part.name}, and the {kept} part(s) this run finished are kept there. Free some space (or pass "
            "--out with a folder you can write to) and run the same command again: it skips every part already "
            "recorded")


class _Tee(io.TextIOBase):
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


class PackFailed(OptlabError):
    """The archive could not be written: the run stops at once, since nothing it measures from now on would be kept."""


class RunLog:
    """What this run printed, saved to ``<out>/reference.log`` after the earlier runs' lines, and the folder packed
    into ``archive``: after every part, and when the run ends."""

    def __init__(self, folder: Path, archive: str | Path | None) -> None:
        self.folder, self.archive, self.buffer = folder, archive, io.StringIO()
        try:
            self.before = (folder / LOG).read_text() if (folder / LOG).is_file() else ""
        except OSError:
            self.before = ""

    def save(self, final: bool = False) -> None:
        """Write the log and, with an archive, pack the folder into it (the log included even where the folder
        could not take it); ``final``: say where the archive is. A signal meanwhile waits for the pack to end. Raises
        :class:`PackFailed`, in one line, where the archive cannot be written."""
        text = self.before + self.buffer.getvalue()
        with shutdown.held(then_raise=not final):
            with contextlib.suppress(OSError):  # a folder that cannot take the log has already stopped the run
                store.atomic_write_text(self.folder / LOG, text)
            if self.archive is None:
                return
            try:
                written, members = archives.pack(self.folder, self.archive, extra={LOG: text.encode()})
            except OSError as error:
                raise PackFailed(f"the archive {str(self.archive)!r} could not be written ({error.strerror or error}); "
                                 f"the results are in {store.display_path(self.folder)}") from error
        if final:
            print(f"archive: {written} ({len(members)} files, {written.stat().st_size / 1024:.0f} KiB); unpack it "
                  f"with python -m optlab reference --unpack {written}")


def _nearest_existing(path: Path) -> Path:
    """``path`` itself or the closest folder above it that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _trial_write(folder: Path, what: str) -> None:
    """Write and remove a temporary file in ``folder`` (or in the closest folder above it that exists, which a run
    would create it in), so that a folder the run cannot write is refused before anything is written."""
    where = _nearest_existing(folder)
    try:
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(where))
        with tempfile.NamedTemporaryFile(dir=where, prefix=".write-check-"):
            pass
    except OSError as error:
        raise OptlabError(f"{what} {str(folder)!r} cannot be written ({error.strerror or error}"
                          f"{'' if where == folder.absolute() else f' in {str(where)!r}'}); pass a path you can "
                          "write to") from error


def check_outputs(out: str | Path, archive: str | Path | None) -> None:
    """Refuse, before the first part and writing nothing, an output folder or an archive path that cannot be
    written."""
    _trial_write(Path(out), "output folder")
    if archive is not None:
        archive = Path(archive)
        if archive.is_dir():
            raise OptlabError(f"--archive {str(archive)!r} is a folder; give a file name, such as run.tar.gz")
        _trial_write(archive.parent, "the folder of --archive")


def run_reference(out: str | Path, set_name: str = "seed", profile: str | Profile | None = None,
                  device: str = "auto", progress: bool = True, download: bool = False, budget_s: float | None = None,
                  repeats: int | None = None, archive: str | Path | None = None) -> Iterator[ExperimentResult]:
    """Run every part of the set not yet recorded under ``out``, in priority order; with ``budget_s``, a deadline
    that many seconds after the process start: a part whose estimate would end past it is skipped (the later ones
    that fit still run), and a running part stops at the end of a repeat once it passes its share. Yields each
    technique part's result.

    The set, the device, the profile, the output folder and the archive path are checked first: a bad one is an
    OptlabError before anything is written. A part that fails, an OptlabError included, is reported and the run goes
    on; the end names every part that failed or was left. A full disk, an output folder that can no longer be
    written, or an archive that cannot be packed stops the run at once. After every part its lines are appended to
    ``out/reference.log`` and, with ``archive``, the folder is packed into that tar.gz; SIGTERM, SIGINT and SIGHUP
    (to the process or its group) record the part in flight as interrupted, pack, and raise
    :class:`~optlab.core.shutdown.Interrupted`.
    """
    with signals_interrupt():
        if budget_s is not None and not budget_s > 0:
            raise OptlabError(f"--budget must be a positive number of seconds, got {budget_s:g}")
        set_names(set_name)
        info = resolve_device(device)
        prof = reference_profile(profile, info.is_cuda, repeats)
        check_outputs(out, archive)
        parts = plan(set_name, prof, measured_seconds(target_gpu(info), prof, reference_folders(out)))
        if Path(out).is_dir():
            _manifest(Path(out))  # a parts list edited by hand stops the run here, in one line, before any write
        deadline = None if budget_s is None else shutdown.PROCESS_START + budget_s
        folder = store.writable_dir(out)
        log = RunLog(folder, archive)
        yield from _logged_run(log, folder, set_name, parts, prof, info, progress, download, budget_s, deadline)


def _logged_run(log: RunLog, folder: Path, set_name: str, parts: list[Part], prof: Profile, info: DeviceInfo,
                progress: bool, download: bool, budget_s: float | None,
                deadline: float | None) -> Iterator[ExperimentResult]:
    """The parts, with what they print kept in ``log``, and the last pack however the run ends."""
    ended, why = False, None
    try:
        with contextlib.redirect_stdout(_Tee(sys.stdout, log.buffer)):
            print(f"optlab reference --set {set_name}, into {store.display_path(folder)}, started "
                  f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}")
            yield from _run_parts(folder, parts, prof, info, progress, download, budget_s, deadline, log)
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
                    log.buffer.write(f"stopped: {why}; every part finished before it is kept\n")
                try:
                    log.save(final=True)
                except PackFailed as problem:
                    if ended:
                        raise
                    print(f"optlab: error: {problem}", file=sys.stderr)


def part_deadline(part: Part, deadline: float | None) -> float | None:
    """When a running ``part`` stops at the end of its repeat: past its share (:data:`SHARE_FACTOR` x its estimate
    and :data:`SHARE_SLACK_S`), and never later than the run's deadline less the reserve to pack."""
    if deadline is None:
        return None
    return min(shutdown.now() + part.estimate_s * SHARE_FACTOR + SHARE_SLACK_S, deadline - PACK_RESERVE_S)


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


def _run_parts(folder: Path, parts: list[Part], prof: Profile, info: DeviceInfo, progress: bool, download: bool,
               budget_s: float | None, deadline: float | None, log: RunLog) -> Iterator[ExperimentResult]:
    device = str(info.device)
    key = run_key(info)
    done = recorded(parts, folder, key, prof)
    failures, left, skipped, finished = [], [], [], 0
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
            print(f"part {part.name} ({part.set_name}; about {part.estimate_s:.0f} s, {source})")
            watch.start()
            result = _signalled_run_part(part, folder, prof, device, progress, download,
                                         part_deadline(part, deadline))
            status = "ok"
        except Interrupted:
            with shutdown.held(then_raise=False), contextlib.suppress(OSError):
                _note_part(folder, part, key, prof, "interrupted", shutdown.now() - part_start, watch.stop(), None)
                print(f"interrupted in part {part.name}: recorded as interrupted; {finished} part(s) finished this "
                      "run")
            raise
        except Exception as error:  # noqa: BLE001  (an OptlabError too: this part failed, the others go on)
            problem = output_problem(error, folder)
            if problem is not None:
                watch.stop()
                raise OptlabError(stop_line(problem, folder, part, finished)) from error
            result, status = None, f"failed: {type(error).__name__}: {error}".splitlines()[0][:200]
            failures.append(part.name)
            traceback.print_exc()
            log.buffer.write(traceback.format_exc())
        try:
            with shutdown.held():  # the part's row is written whole; a signal meanwhile is raised right after
                _note_part(folder, part, key, prof, status, shutdown.now() - part_start, watch.stop(),
                           repeats_run(result, part, prof))
        except OSError as error:
            problem = output_problem(error, folder)
            if problem is None:
                raise
            raise OptlabError(stop_line(problem, folder, part, finished)) from error
        finished += status == "ok"
        log.save()
        if result is not None:
            yield result
    print(f"reference: {shutdown.now() - shutdown.PROCESS_START:.0f} s since the process start; skipped "
          f"{len(skipped)} part(s) already recorded under {store.display_path(folder)}")
    if left:
        print(f"left for a later run (over --budget {budget_s:g} s): {', '.join(p.name for p in left)} "
              f"(about {sum(p.estimate_s for p in left) / 60:.1f} min)")
    if failures:
        raise OptlabError(f"these parts failed and have no new results: {', '.join(failures)}")


def unpack(path: str | Path, out: str | Path | None = None) -> str:
    """Merge an archive that ``--archive`` wrote into ``out`` (default: ``results/reference/<its folder>``); the
    line to print."""
    folder, members = archives.unpack(path, out)
    return (f"unpacked {len(members)} files into {store.display_path(folder)}, merged with what was there; commit "
            "that folder, or run the reference with --out on it to add the parts still missing")
