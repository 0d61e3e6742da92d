"""The transformer track's techniques, on the GPT workload: attention kernels, activation checkpointing, precision
(FP8 included), AdamW's implementations, torch.compile, shapes, and all of them stacked.

Each is an :class:`~optlab.core.techniques.registry.Experiment` like the CNN chapters' (same timing, verdicts and records). The
registered ones are the GPU's (GPT-2 small); the functions build a device's or a size's own set where the registered
one would not fit (an attention kernel a device lacks, sequence lengths of a smaller model).
"""
from __future__ import annotations

import torch

from ..errors import choice_error
from .registry import Experiment, chained, register
from ..gpt.transformer import GPT_SIZES, attention_support

GPT = {"workload": "gpt"}
ADAMW = {"optimizer": "adamw", "optimizer_impl": "foreach"}  # nanoGPT's optimizer, torch's default implementation
ATTENTION_VARIANTS = (
    ("hand-written attention", {"attention": "manual"}),
    ("SDPA (PyTorch picks)", {"attention": "sdpa"}),
    ("SDPA math", {"attention": "sdpa_math"}),
    ("SDPA flash", {"attention": "sdpa_flash"}),
    ("SDPA memory-efficient", {"attention": "sdpa_efficient"}),
    ("SDPA cuDNN", {"attention": "sdpa_cudnn"}),
    ("FlexAttention, causal block mask", {"attention": "flex"}),
)


def attention_experiment(device: "torch.device | str | None" = None) -> tuple[Experiment, dict[str, str]]:
    """The attention comparison, and the variants left out because their kernel does not run training on ``device``
    in the dtype the GPT trains in there (bf16 on a GPU, fp32 on a CPU; label -> one line why). Without a device,
    every variant (the registered comparison, for a GPU)."""
    left_out = {}
    if device is not None:
        device = torch.device(device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        left_out = {label: why for label, changes in ATTENTION_VARIANTS[1:]
                    if (why := attention_support(changes["attention"], device, backward=True, dtype=dtype))}
    variants = tuple((label, changes) for label, changes in ATTENTION_VARIANTS if label not in left_out)
    return Experiment(
        name="attention", section="", title="Attention kernels: hand-written, SDPA's backends and FlexAttention",
        description="The hand-written causal attention builds the T x T score matrix, masks it and takes its softmax "
                    "in separate kernels; scaled_dot_product_attention picks a fused kernel (flash, memory-efficient, "
                    "cuDNN) that never writes the scores out; FlexAttention compiles a kernel from a block mask.",
        variants=variants, base=dict(ADAMW), **GPT,
    ), left_out


ATTENTION = register(attention_experiment()[0])

CHECKPOINTING = register(Experiment(
    name="checkpointing", section="", title="Activation checkpointing: none, every block, selective",
    description="Checkpointing a block keeps only its input and recomputes its activations in the backward pass: "
                "less memory, one more forward per block. Selective checkpointing keeps the matmuls' outputs and "
                "recomputes only the cheap pointwise ops (LayerNorm, GELU, softmax).",
    phases=("train",), base=dict(ADAMW), **GPT,
    variants=(("no checkpointing", {"checkpointing": "none"}), ("every block", {"checkpointing": "full"}),
              ("selective (keep the matmuls)", {"checkpointing": "selective"})),
))

FP8_COMPILED = "bf16 autocast + FP8 linears, compiled"
GPT_PRECISION = register(Experiment(
    name="gpt_precision", section="", title="Precision on the GPT: fp32, TF32, bf16 and FP8",
    description="TF32 runs fp32 matmuls on tensor cores with a 10-bit mantissa; bf16 autocast halves the bytes; FP8 "
                "linear layers (torchao's float8 training, else torch._scaled_mm with per-tensor scales) halve them "
                "again on GPUs of compute capability 8.9 or newer; compiled, as torchao and torchtitan run it, the "
                "casts and amax reductions fuse into their neighbours.",
    phases=("train",), base=dict(ADAMW), **GPT,
    variants=(("fp32 strict", {"amp_dtype": "none", "matmul_tf32": False}),
              ("TF32", {"amp_dtype": "none", "matmul_tf32": True}),
              ("bf16 autocast", {"amp_dtype": "bf16"}), ("bf16 autocast + FP8 linears", {"amp_dtype": "bf16", "fp8": True}),
              (FP8_COMPILED, {"amp_dtype": "bf16", "fp8": True, "compile_mode": "default"})),
    references={"bf16 autocast + FP8 linears": "bf16 autocast",  # FP8 alone, on top of bf16
                FP8_COMPILED: "bf16 autocast + FP8 linears"},  # what compiling FP8's casts adds
    # at GPT-2 small, where FP8 can pay (a GPU's size); the CPU's tiny GPT has no FP8 and would time a compile alone
    variant_models={FP8_COMPILED: ("gpt2_small",)},
))

GPT_OPTIMIZERS = register(Experiment(
    name="gpt_optimizers", section="", title="AdamW for-loop, foreach and fused on the GPT", phases=("train",),
    description="AdamW keeps two fp32 moments per parameter; the for-loop implementation launches a few kernels per "
                "parameter tensor, foreach batches them across tensors, fused does the whole update in one kernel.",
    base={"optimizer": "adamw"}, **GPT,
    variants=(("AdamW for-loop", {"optimizer_impl": "for_loop"}), ("AdamW foreach", {"optimizer_impl": "foreach"}),
              ("AdamW fused", {"optimizer_impl": "fused"})),
))

GPT_COMPILE = register(Experiment(
    name="gpt_compile", section="", title="torch.compile on the GPT", phases=("train",),
    description="Inductor fuses the GPT's LayerNorms, GELUs and residual adds into fewer kernels; reduce-overhead "
                "adds CUDA graphs. Compilation is paid once and reported apart from the step time.",
    base={"amp_dtype": "bf16", **ADAMW}, **GPT,
    variants=(("eager", {"compile_mode": "none"}), ("compile default", {"compile_mode": "default"}),
              ("reduce-overhead", {"compile_mode": "reduce-overhead"})),
))

# max-autotune benchmarks matmul templates while it compiles (minutes more): a part of its own, so that each part of
# a reference run stays within its time limit
GPT_MAX_AUTOTUNE = register(GPT_COMPILE.with_variants(
    ("eager", {"compile_mode": "none"}), ("max-autotune, no CUDA graphs", {"compile_mode": "max-autotune-no-cudagraphs"}),
    name="gpt_compile_max_autotune"))

# A vocabulary and the same padded to a multiple of 64, per size: GPT-2's tokenizer and nanoGPT's padding; the
# character corpus's 65 and 128 for the tiny GPT (a CPU's 50257-row head would cost more than the rest of the model)
VOCABS = {"gpt2_small": (50257, 50304), "gpt_tiny": (65, 128)}


def shapes_experiment(model: str = "gpt2_small", batch_size: int = 16) -> Experiment:
    """The shapes comparison for ``model`` at ``batch_size`` sequences: its raw vocabulary against the padded one
    (``VOCABS``), and the same tokens per step as twice the sequences of half the length, and four times of a
    quarter."""
    if model not in VOCABS:
        raise choice_error("GPT size", model, tuple(VOCABS))
    block, (raw, padded) = GPT_SIZES[model].block_size, VOCABS[model]
    tokens = f"{batch_size * block:,} tokens a step"
    full = f"vocab {padded}, {batch_size} x {block}"
    shorter = {f"vocab {padded}, {batch_size * k} x {block // k} ({tokens})":
               {"vocab_size": padded, "batch_size": batch_size * k, "seq_len": block // k} for k in (2, 4)}
    return Experiment(
        name="gpt_shapes", section="", title="Shapes: a padded vocabulary, and batch x sequence length",
        description=f"A vocabulary of {raw} rows leaves the embedding and head matmuls on ragged tiles; padding it to "
                    f"{padded} (a multiple of 64) is nanoGPT's fix. At a fixed number of tokens per step, longer "
                    "sequences cost more attention (quadratic in length) and fewer, larger matmul rows.",
        phases=("train",), base={**ADAMW, "vocab_size": raw}, **GPT, models=(model,),
        variants=((f"vocab {raw}, {batch_size} x {block}", {}), (full, {"vocab_size": padded}), *shorter.items()),
        references={label: full for label in shorter},
    )


GPT_SHAPES = register(shapes_experiment())


def gpt_stack(model: str = "gpt2_small") -> list[tuple[str, dict]]:
    """From nanoGPT's baseline to the fastest configuration, one technique more per step (``model``'s vocabularies)."""
    raw, padded = VOCABS[model]
    return [
        (f"baseline: fp32, hand-written attention, for-loop AdamW, vocab {raw}",
         {"amp_dtype": "none", "attention": "manual", "optimizer": "adamw", "optimizer_impl": "for_loop",
          "vocab_size": raw}),
        ("+ SDPA", {"attention": "sdpa"}),
        ("+ bf16 autocast", {"amp_dtype": "bf16"}),
        ("+ fused AdamW", {"optimizer_impl": "fused"}),
        (f"+ vocab padded to {padded}", {"vocab_size": padded}),
        ("+ torch.compile", {"compile_mode": "default"}),
    ]


def gpt_all_together(model: str = "gpt2_small", skip: tuple[str, ...] = ()) -> Experiment:
    """The GPT stack on ``model`` as an experiment: each variant adds one step to the one before and is compared with
    it (``registry.chained``); ``skip`` leaves steps out (a device where a step does not pay), and
    the variants after it are built without it and compared with the step kept before them."""
    if model not in VOCABS:
        raise choice_error("GPT size", model, tuple(VOCABS))
    steps = gpt_stack(model)
    unknown = set(skip) - {label for label, _ in steps[1:]}
    if unknown:
        raise choice_error("stack step", sorted(unknown)[0], [label for label, _ in steps[1:]])
    stacked, changes = [], {}
    for label, step in steps:
        changes = {**changes, **step}  # a skipped step's knobs are dropped below
        if label not in skip:
            stacked.append((label, dict(changes)))
        else:
            changes = {k: v for k, v in changes.items() if k not in step} | {k: steps[0][1][k] for k in step
                                                                            if k in steps[0][1]}
    return Experiment(
        name="gpt_all_together", section="", title="The GPT all together: from nanoGPT's baseline to the fastest",
        description="Each variant adds one technique to the one before and is compared with it, so the differences "
                    "form a waterfall.",
        phases=("train",), variants=tuple(stacked), models=(model,), **GPT,
        references=chained([label for label, _ in stacked]),
    )


GPT_ALL_TOGETHER = register(gpt_all_together())

TRANSFORMER_TECHNIQUES = tuple(e.name for e in (ATTENTION, CHECKPOINTING, GPT_PRECISION, GPT_OPTIMIZERS, GPT_COMPILE,
                                                GPT_MAX_AUTOTUNE, GPT_SHAPES, GPT_ALL_TOGETHER))
