"""The registry's entries: one per section of the seed article, labelled as in its tables."""
from __future__ import annotations

from ..errors import choice_error
from .registry import REGISTRY, Experiment, chained, register

DATA_LOADING = register(Experiment(
    name="data_loading", section="1.1", title="DataLoader num_workers and pin_memory",
    description="Worker processes decode and augment images in parallel; pinned pages let the copy to the GPU use DMA.",
    variants=(
        ("num_workers=0 pin_memory=False", {"num_workers": 0, "pin_memory": False}),
        ("num_workers=4 pin_memory=True", {"num_workers": 4, "pin_memory": True}),
        ("num_workers=8 pin_memory=True", {"num_workers": 8, "pin_memory": True}),
    ),
))

NON_BLOCKING = register(Experiment(
    name="non_blocking", section="2.1", title="tensor.to(non_blocking=True)",
    description="An asynchronous copy from pinned memory returns at once, so the host can queue the next kernels; "
                "on the compute stream the copy still runs between two steps' kernels, so at best it removes a host "
                "wait. Overlapping the copy with computation needs it on a side stream, one batch ahead.",
    variants=(("w/o non_blocking", {"non_blocking": False}), ("w non_blocking", {"non_blocking": True}),
              ("w non_blocking, prefetched on a side stream", {"non_blocking": True, "prefetch_to_device": True})),
    references={"w non_blocking, prefetched on a side stream": "w non_blocking"},  # the prefetch alone
))

_FACTORS = (
    ("channels-1", {"model_variant": "rec"}),
    ("batch+1", {"batch_offset": 1}),
    ("base model, fp16", {"amp_dtype": "fp16"}),
    ("channels-1, fp16", {"model_variant": "rec", "amp_dtype": "fp16"}),
    ("batch+1, fp16", {"batch_offset": 1, "amp_dtype": "fp16"}),
)
MULTIPLE_OF_8 = register(Experiment(
    name="multiple_of_8", section="3.1", title="Channels and batch size as multiples of 8",
    description="Tensor cores work on tiles of 8 (fp16) elements; the seed's 'rec' model has every layer one "
                "channel narrower and one image more per batch. The other variants change one factor at a time, "
                "in fp32 (TF32 convolutions on Ampere and newer) and under fp16 autocast, on ResNet18 and ResNet50 "
                "(the seed's slowdown was in the ResNets; two models keep the reference run within its budget).",
    variants=(("base model", {}), ("rec model (channels-1 batch+1)", {"model_variant": "rec", "batch_offset": 1}),
              *_FACTORS),
    variant_models={label: ("resnet18", "resnet50") for label, _ in _FACTORS},
    references={"channels-1, fp16": "base model, fp16", "batch+1, fp16": "base model, fp16"},  # each factor under fp16
))

MIXED_PRECISION = register(Experiment(
    name="mixed_precision", section="3.2", title="Automatic mixed precision",
    description="Autocast runs convolutions and matmuls in 16-bit on tensor cores; fp16 needs a GradScaler, bf16 does not.",
    variants=(
        ("w/o mixed precision", {"amp_dtype": "none"}),
        ("w mixed precision", {"amp_dtype": "fp16"}),
        ("bf16", {"amp_dtype": "bf16"}),
    ),
))

SET_TO_NONE = register(Experiment(
    name="set_to_none", section="3.3", title="optimizer.zero_grad(set_to_none=True)",
    description="Dropping gradients instead of writing zeros saves a memset per parameter and lets backward "
                "assign instead of add. The default became True in torch 2.0, so the baseline sets False explicitly.",
    variants=(("w/o gradient none", {"set_to_none": False}), ("w gradient none", {"set_to_none": True})),
))

GRADIENT_ACCUMULATION = register(Experiment(
    name="gradient_accumulation", section="3.4", title="Gradient accumulation",
    description="Summing gradients over 2 micro-batches halves the optimizer steps per image (the seed used 2).",
    variants=(("w/o gradient accumulation", {"accumulation_steps": 1}),
              ("w gradient accumulation", {"accumulation_steps": 2})),
))

NO_GRAD = register(Experiment(
    name="no_grad", section="4.1", title="no_grad and inference_mode at inference", phases=("test",),
    description="Without autograd, the forward keeps no activations for backward and records no graph.",
    variants=(
        ("w/o no_grad", {"eval_grad_mode": "grad"}),
        ("w no_grad", {"eval_grad_mode": "no_grad"}),
        ("inference_mode", {"eval_grad_mode": "inference_mode"}),
    ),
))

CUDNN_BENCHMARK = register(Experiment(
    name="cudnn_benchmark", section="5.1", title="torch.backends.cudnn.benchmark",
    description="cuDNN times every convolution algorithm on the first call of each shape and keeps the fastest. "
                "Its plan cache lives per process and its key has no benchmark flag, so each variant runs in a "
                "fresh process of its own: otherwise the second would reuse the first's plans.",
    variants=(("w/o cudnn.benchmark", {"cudnn_benchmark": False}), ("w cudnn.benchmark", {"cudnn_benchmark": True})),
    isolate_variants=True,
))

CHANNELS_LAST = register(Experiment(
    name="channels_last", section="5.2", title="channels_last memory format (with mixed precision)",
    description="NHWC puts a pixel's channels side by side, the layout tensor-core convolutions read natively.",
    base={"amp_dtype": "fp16"},
    variants=(
        ("w/o channel_last (with mixed precision)", {"channels_last": False}),
        ("w channel_last (with mixed precision)", {"channels_last": True}),
    ),
))

SEED_TECHNIQUES = tuple(e.name for e in (
    DATA_LOADING, NON_BLOCKING, MULTIPLE_OF_8, MIXED_PRECISION, SET_TO_NONE, GRADIENT_ACCUMULATION, NO_GRAD,
    CUDNN_BENCHMARK, CHANNELS_LAST,
))

# Beyond the seed: what matters on a modern GPU, where a 32x32 batch of 128 is little work per kernel launch.

# The models with the shortest kernels, where compilation and graphs matter most; two, not four, because
# compiling every model in every mode would take a GPU reference run well past its time budget.
LAUNCH_BOUND_MODELS = ("resnet18", "mobilenet_v2")
# A compiled step of a small model takes 1-3 ms on an H200: four PIL workers and a blocking copy could be what is
# measured, so the compiling techniques read their batches from a data set held on the device.
ON_DEVICE = {"data_on_device": True, "num_workers": 0, "pin_memory": False}
MAX_AUTOTUNE = ("compile max-autotune", {"compile_mode": "max-autotune"})  # minutes more per graph: not by default

COMPILE = register(Experiment(
    name="compile", section="", title="torch.compile",
    description="TorchDynamo captures the model into a graph and Inductor fuses its elementwise work into fewer "
                "kernels; compilation is paid once, on the first steps (reported apart from the step time).",
    base={"amp_dtype": "bf16", "channels_last": True, **ON_DEVICE}, models=LAUNCH_BOUND_MODELS,
    variants=(("eager", {"compile_mode": "none"}), ("compile default", {"compile_mode": "default"})),
))


def compile_with_max_autotune() -> Experiment:
    """The ``compile`` comparison with ``max-autotune`` added (Triton templates benchmarked at compile time, and CUDA
    graphs): ``run_experiment(compile_with_max_autotune())``. Left out of the default set for its compile time."""
    return COMPILE.with_variants(*COMPILE.variants, MAX_AUTOTUNE, name="compile_max_autotune")


CUDA_GRAPHS = register(Experiment(
    name="cuda_graphs", section="", title="CUDA graphs (torch.compile mode reduce-overhead)", needs_cuda=True,
    description="A captured graph replays all of a step's kernels with one launch, removing per-kernel CPU overhead.",
    base={"amp_dtype": "bf16", "channels_last": True, **ON_DEVICE}, models=LAUNCH_BOUND_MODELS,
    variants=(("compile default", {"compile_mode": "default"}), ("reduce-overhead", {"compile_mode": "reduce-overhead"})),
))

PRECISION = register(Experiment(
    name="precision", section="", title="TF32, fp16 and bf16",
    description="TF32 keeps fp32's range with a 10-bit mantissa on tensor cores; fp16 and bf16 halve the bytes moved. "
                "fp16's GradScaler reads a found-inf flag on the host (.item(), a sync) every step unless the "
                "optimizer is fused, which takes the flag on the device; bf16 needs no scaler.",
    variants=(
        ("fp32 strict", {"matmul_tf32": False, "cudnn_tf32": False}),
        ("fp32 with TF32", {"matmul_tf32": True, "cudnn_tf32": True}),
        ("fp16 autocast", {"amp_dtype": "fp16"}),
        ("fp16 autocast, fused SGD", {"amp_dtype": "fp16", "optimizer_impl": "fused"}),
        ("bf16 autocast", {"amp_dtype": "bf16"}),
    ),
    references={"fp16 autocast, fused SGD": "fp16 autocast"},  # the fused step alone: the scaler's host sync
))

OPTIMIZERS = register(Experiment(
    name="optimizers", section="", title="for-loop, foreach and fused optimizers", phases=("train",),
    description="A for-loop optimizer launches a few kernels per parameter tensor; foreach batches them across "
                "tensors; fused does the whole update in one kernel.",
    variants=(
        ("SGD for-loop", {"optimizer": "sgd", "optimizer_impl": "for_loop"}),
        ("SGD foreach", {"optimizer": "sgd", "optimizer_impl": "foreach"}),
        ("SGD fused", {"optimizer": "sgd", "optimizer_impl": "fused"}),
        ("Adam for-loop", {"optimizer": "adam", "optimizer_impl": "for_loop"}),
        ("Adam foreach", {"optimizer": "adam", "optimizer_impl": "foreach"}),
        ("Adam fused", {"optimizer": "adam", "optimizer_impl": "fused"}),
    ),
    references={"Adam foreach": "Adam for-loop", "Adam fused": "Adam for-loop"},  # each implementation of one optimizer
))

DATA_PIPELINE = register(Experiment(
    name="data_pipeline", section="", title="persistent workers, prefetching and GPU-resident data",
    description="Persistent workers skip the per-epoch start-up; a deeper prefetch absorbs jitter; keeping the "
                "whole data set on the device removes the loader, the copies and the per-image PIL work.",
    variants=(
        ("4 workers", {"num_workers": 4, "pin_memory": True, "non_blocking": True}),
        ("4 persistent workers, prefetch 4", {"num_workers": 4, "pin_memory": True, "non_blocking": True,
                                              "persistent_workers": True, "prefetch_factor": 4}),
        ("data on device", {"num_workers": 0, "pin_memory": False, "data_on_device": True}),
    ),
))

# The seed's baseline, then one technique more per step: the waterfall of the all-together chapter.
_STACK = [
    ("seed baseline", {"num_workers": 0, "pin_memory": False, "set_to_none": False}),
    ("+ 4 workers, pinned, non_blocking", {"num_workers": 4, "pin_memory": True, "non_blocking": True}),
    ("+ bf16 autocast", {"amp_dtype": "bf16"}),
    ("+ channels_last", {"channels_last": True}),
    ("+ set_to_none, fused SGD", {"set_to_none": True, "optimizer_impl": "fused"}),
    ("+ data on device", {"num_workers": 0, "pin_memory": False, "data_on_device": True}),
    ("+ torch.compile", {"compile_mode": "default"}),
]
COMPILE_STEP = _STACK[-1][0]
WORKERS_STEP = _STACK[1][0]
STACK_WORKERS = _STACK[1][1]["num_workers"]


def all_together(skip: tuple[str, ...] = ()) -> Experiment:
    """The stack as an experiment: each variant adds one step to the one before and is compared with it
    (:func:`~optlab.core.techniques.registry.chained`). ``skip`` leaves steps out (a device where a step does not apply), and the
    variants after it are built without it and compared with the step kept before them."""
    unknown = set(skip) - {label for label, _ in _STACK}
    if unknown:
        raise choice_error("stack step", sorted(unknown)[0], [label for label, _ in _STACK])
    stacked, changes = [], {}
    for label, step in _STACK:
        if label not in skip:
            changes = {**changes, **step}
            stacked.append((label, dict(changes)))
    return Experiment(
        name="all_together", section="", title="All together: from the seed's baseline to the fastest configuration",
        description="Each variant adds one technique to the one before and is compared with it, so the differences "
                    "form a waterfall. torch.compile is added on the launch-bound models only (compiling ResNet50 and "
                    "101 would take minutes each).",
        variants=tuple(stacked), variant_models={COMPILE_STEP: LAUNCH_BOUND_MODELS},
        references=chained([label for label, _ in stacked]),
    )


ALL_TOGETHER = register(all_together())

BEYOND_TECHNIQUES = tuple(e.name for e in (COMPILE, CUDA_GRAPHS, PRECISION, OPTIMIZERS, DATA_PIPELINE, ALL_TOGETHER))
COMPILING_TECHNIQUES = tuple(e.name for e in (COMPILE, CUDA_GRAPHS))  # minutes of compilation on a GPU

SET_NAMES = ("seed", "beyond", "compile", "stack", "transformer", "serving", "first_step", "all")


def technique_set(name: str) -> list[str]:
    """``seed``: the nine seed techniques; ``beyond``: the modern ones that do not compile; ``compile``: torch.compile
    and CUDA graphs; ``stack``: all of them together (each compiling set kept apart so that every set stays a short
    run); ``transformer``: the GPT's techniques; ``all``: every one."""
    from .gpt import TRANSFORMER_TECHNIQUES  # registered after this module

    sets = {"transformer": list(TRANSFORMER_TECHNIQUES),"seed": list(SEED_TECHNIQUES), "compile": list(COMPILING_TECHNIQUES), "stack": [ALL_TOGETHER.name],
            "beyond": [t for t in BEYOND_TECHNIQUES if t not in COMPILING_TECHNIQUES + (ALL_TOGETHER.name,)],
            "serving": [], "first_step": [], "all": list(REGISTRY)}  # serving: tables only (EXTRAS in the reference run)
    if name not in sets:
        raise choice_error("technique set", name, SET_NAMES)
    return sets[name]
