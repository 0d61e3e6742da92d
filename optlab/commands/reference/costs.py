"""What a part of the reference run costs on one H200: the step-time table and the estimates built from it.

Every figure here is an assumption about a GPU, stated with its reason; a part that an earlier run measured uses
the measured seconds instead (``planning.measured_seconds``).
"""
from __future__ import annotations

import math


from ...core.knobs.config import RunConfig
from ...core.knobs.profiles import Profile
from ...core.techniques.registry import Experiment
from ...core.gpt.transformer import GPT_SIZES
from ...core.workload import get_workload


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
           "serving": 200,  # GPT-2 small's training (cached after), 8 decode graphs, 3 rates x 2 x 6 rounds
           "ceilings": 40,  # 8 matmul shapes x 5 dtypes at 0.2 s or more each, two 4 GiB passes, two launch timings
           # GPT-2 small, up to 3 rounds of 5 fresh processes, bounded: the rounds that finish within its own deadline
           # (compile_time.REFERENCE_DEADLINE_S, 200 s), then the tables
           "compile_time": 210,
           "shapes": 150}  # GPT-2 small over 64 batches: 5 strategies, each a process; 4 buckets, CUDA graphs


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
