"""The planner: memory per GPU and bytes per step for data parallelism (DDP), FSDP, tensor (and sequence) and
pipeline parallelism and their compositions, from :mod:`.formulas`, for a GPT on ``gpus`` GPUs.

Assumptions, stated once: mixed-precision AdamW keeps 16 bytes per parameter (bf16 weights and gradients, fp32
master weights and two moments, as in the ZeRO paper); activations are bf16 and kept whole (no checkpointing); a
pipeline runs 1F1B, so its first stage holds ``pp`` micro-batches' activations; FSDP also holds two blocks gathered
(the current one and the prefetched); collectives run on rings over ``interconnect``. A rank with the embeddings
is the one counted (the largest).
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ...core.errors import OptlabError, choice_error
from ...core.gpt.transformer import GPT_SIZES, GPTConfig
from ...core.knobs.limits import check_count
from . import formulas

STATE_BYTES = 16  # per parameter: bf16 weight 2 + bf16 gradient 2 + fp32 master, first and second moment 12
VALUE_BYTES = 2  # bf16 activations, gradients on the wire
MAX_GPUS, MAX_MICRO_BATCHES, MAX_BATCH = 4096, 1024, 1024
MAX_GPU_MEMORY_GB = 2048

INTERCONNECTS = {  # one direction's bandwidth per GPU, bytes/s (each vendor's figure)
    "nvlink4": 450e9,  # H100/H200 SXM, NVLink 4: 900 GB/s both ways
    "nvlink3": 300e9,  # A100 SXM
    "pcie5": 64e9,  # PCIe 5.0 x16
    "pcie4": 32e9,
    "infiniband-ndr": 50e9,  # 400 Gb/s per GPU between nodes
}

MODELS = {  # GPT-2's sizes and a 7B-class model in the book's GPT shape (4x GELU MLP, tied head)
    "gpt2_small": GPT_SIZES["gpt2_small"],
    "gpt2_medium": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2_large": GPTConfig(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2_xl": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "7b": GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096),
}


@dataclass(frozen=True)
class Layout:
    """How ``data x tp x pp`` GPUs share the work: ``data`` replicas (DDP) or shards (FSDP), ``tp`` ranks per layer
    (with ``sequence`` parallel norms), ``pp`` pipeline stages."""

    data: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: bool = False
    sequence: bool = False

    @property
    def name(self) -> str:
        parts = [f"{'FSDP' if self.fsdp else 'DP'} {self.data}"] if self.data > 1 else []
        parts += [f"TP{'+SP' if self.sequence else ''} {self.tp}"] if self.tp > 1 else []
        parts += [f"PP {self.pp}"] if self.pp > 1 else []
        return " x ".join(parts) or "one GPU"

    def problem(self, config: GPTConfig) -> str | None:
        """Why this layout cannot split ``config``, or None."""
        if config.n_head % self.tp:
            return f"{config.n_head} heads do not split over {self.tp}"
        if config.n_layer % self.pp:
            return f"{config.n_layer} layers do not split into {self.pp} stages"
        return None


def memory_per_gpu(config: GPTConfig, layout: Layout, micro_batch: int = 1, state_bytes: int = STATE_BYTES,
                   value_bytes: int = VALUE_BYTES) -> dict[str, float]:
    """Bytes on the GPU that holds the embeddings: model state (``state_bytes`` per parameter it keeps), the blocks
    FSDP holds gathered, and activations of ``value_bytes`` each (see the module's assumptions)."""
    layers = config.n_layer // layout.pp
    parameters = formulas.model_parameters(config, layout.tp, layers) / (layout.data if layout.fsdp else 1)
    gathered = 2 * value_bytes * formulas.block_parameters(config, layout.tp) if layout.fsdp else 0
    activations = in_flight(layout) * formulas.activation_bytes(config, micro_batch, config.block_size, layout.tp,
                                                        layout.sequence, value_bytes, layers)
    return {"parameters": parameters, "state": state_bytes * parameters, "gathered": gathered,
            "activations": activations}


def in_flight(layout: Layout) -> int:
    """Micro-batches whose activations the first stage holds at once: 1F1B runs pp forwards before its first
    backward (1 without a pipeline)."""
    return layout.pp


def bytes_per_step(config: GPTConfig, layout: Layout, micro_batch: int = 1, micro_batches: int = 8,
                   value_bytes: int = VALUE_BYTES) -> float:
    """Bytes one GPU sends in one step of ``micro_batches`` micro-batches on rings: the data-parallel gradients
    (DDP: one all-reduce; FSDP: parameters gathered twice and gradients reduce-scattered), the tensor-parallel
    collectives of every micro-batch, and a pipeline stage's activations forward and gradients backward."""
    layers = config.n_layer // layout.pp
    if layout.fsdp:
        data = _ring_sum(formulas.fsdp_collectives(config, layout.tp, True, value_bytes, layers), layout.data)
    else:
        gradient_bytes = value_bytes * formulas.model_parameters(config, layout.tp, layers)
        data = formulas.ring_bytes_sent("all-reduce", gradient_bytes, layout.data)
    collectives = formulas.tensor_parallel_collectives(config, micro_batch, config.block_size, layout.sequence,
                                                       value_bytes, layers) if layout.tp > 1 else {}
    tensor = micro_batches * _ring_sum(collectives, layout.tp)
    boundary = micro_batch * config.block_size * config.n_embd * value_bytes
    pipeline = 2 * micro_batches * boundary if layout.pp > 1 else 0
    return data + tensor + pipeline


def _ring_sum(collectives: dict[str, dict[str, int]], ranks: int) -> float:
    return sum(formulas.ring_bytes_sent(key.split()[0], value["bytes"], ranks) for key, value in collectives.items())


def layouts(gpus: int) -> list[Layout]:
    """Every way to write ``gpus`` as data x tp x pp (powers of the factors that divide it), DDP and FSDP for the
    data part, TP with and without sequence parallelism."""
    found = []
    for tp in [d for d in range(1, gpus + 1) if gpus % d == 0]:
        for pp in [d for d in range(1, gpus // tp + 1) if (gpus // tp) % d == 0]:
            data = gpus // tp // pp
            for fsdp in ([False, True] if data > 1 else [False]):
                for sequence in ([False, True] if tp > 1 else [False]):
                    found.append(Layout(data, tp, pp, fsdp, sequence))
    return found


def resolve_model(config: GPTConfig | str) -> GPTConfig:
    if isinstance(config, GPTConfig):
        return config
    if config not in MODELS:
        raise choice_error("model", config, tuple(MODELS))
    return MODELS[config]


def parallel_plan(config: GPTConfig | str, gpus: int, gpu_memory: float, interconnect: str = "nvlink4",
                  micro_batch: int = 1, micro_batches: int = 8) -> pd.DataFrame:
    """Each layout of ``gpus`` GPUs of ``gpu_memory`` GB for ``config`` (a ``GPTConfig`` or a name in
    ``MODELS``): GB per GPU (model state, activations, total), whether it fits (below 90 % of the memory: the
    allocator, the CUDA context and temporaries need the rest), GB each GPU sends per step, those bytes' seconds
    at ``interconnect``'s bandwidth, and the pipeline's bubble. Sorted: fitting layouts first, least traffic first."""
    config = resolve_model(config)
    check_count("gpus", gpus, 1, MAX_GPUS, "GPUs in one plan")
    check_count("micro_batch", micro_batch, 1, MAX_BATCH, "sequences per micro-batch")
    check_count("micro_batches", micro_batches, 1, MAX_MICRO_BATCHES, "micro-batches per step")
    number = isinstance(gpu_memory, (int, float)) and not isinstance(gpu_memory, bool)
    if not number or not 0 < gpu_memory <= MAX_GPU_MEMORY_GB:
        raise OptlabError(f"gpu_memory must be a number of GB above 0 and at most {MAX_GPU_MEMORY_GB}, "
                          f"got {gpu_memory!r}")
    if interconnect not in INTERCONNECTS:
        raise choice_error("interconnect", interconnect, tuple(INTERCONNECTS))
    rows = []
    for layout in layouts(gpus):
        problem = layout.problem(config)
        row = {"layout": layout.name, "data": layout.data, "tp": layout.tp, "pp": layout.pp}
        if problem:
            rows.append(row | {"fits": False, "note": problem})
            continue
        memory = memory_per_gpu(config, layout, micro_batch)
        total = memory["state"] + memory["gathered"] + memory["activations"]
        sent = bytes_per_step(config, layout, micro_batch, micro_batches)
        rows.append(row | {"parameters per GPU (M)": memory["parameters"] / 1e6,
                           "state GB": (memory["state"] + memory["gathered"]) / 1e9,
                           "activations GB": memory["activations"] / 1e9, "total GB": total / 1e9,
                           "fits": total <= 0.9 * gpu_memory * 1e9, "sent GB per step": sent / 1e9,
                           "link s per step": sent / INTERCONNECTS[interconnect],
                           "bubble": formulas.bubble_fraction(layout.pp, micro_batches), "note": ""})
    table = pd.DataFrame(rows)
    return (table.sort_values(["fits", "sent GB per step"], ascending=[False, True], na_position="last")
            .set_index("layout").round(3))


def fit_table(models: list[str], gpus: int, gpu_memory: float, interconnect: str = "nvlink4",
              chosen: tuple[str, ...] = ()) -> pd.DataFrame:
    """GB per GPU of each model (rows) under each layout (columns, all by default, else ``chosen``), NaN where the
    layout cannot split the model; ``fits`` says which are below 90 % of ``gpu_memory``."""
    columns = {}
    for model in models:
        plan = parallel_plan(model, gpus, gpu_memory, interconnect)
        columns[model] = plan["total GB"]
    table = pd.DataFrame(columns).T
    return table[list(chosen)] if chosen else table
