"""The registry's entries: one per section of the seed article, labelled as in its tables."""
from __future__ import annotations

from .experiments import Experiment, register

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
    description="An asynchronous copy from pinned memory lets the host queue the next kernels while the batch moves.",
    variants=(("w/o non_blocking", {"non_blocking": False}), ("w non_blocking", {"non_blocking": True})),
))

MULTIPLE_OF_8 = register(Experiment(
    name="multiple_of_8", section="3.1", title="Channels and batch size as multiples of 8",
    description="Tensor cores work on tiles of 8 (fp16) elements; the seed's 'rec' model has every layer one "
                "channel narrower and one image more per batch.",
    variants=(("base model", {}), ("rec model (channels-1 batch+1)", {"model_variant": "rec", "batch_offset": 1})),
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
    description="cuDNN times every convolution algorithm on the first call of each shape and keeps the fastest.",
    variants=(("w/o cudnn.benchmark", {"cudnn_benchmark": False}), ("w cudnn.benchmark", {"cudnn_benchmark": True})),
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
