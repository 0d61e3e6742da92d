"""Weight-only quantization of the book's GPT: int8 per output channel, int4 in groups, through torch's packed kernels.

Every ``nn.Linear`` of the GPT (the attention's and the MLP's matmuls, and the head) is replaced by a module that keeps
its weight in 8 or 4 bits and multiplies by it in a kernel that reads those bits: decoding at batch 1 reads every weight
once per token, so fewer bytes a weight should mean more tokens a second where reading them is the bound. The
activations stay in the model's dtype (fp32 on a CPU, bf16 on a GPU); only the weights are stored smaller.

- **int8**: symmetric, one scale per output channel (row of the ``[out, in]`` weight): ``w ~ q * scale[row]``,
  ``q`` in -127..127. On a GPU the multiply is gpt-fast's ``F.linear(x, q.to(x.dtype)) * scales``, whose cast and
  scale Inductor fuses into the matmul under ``torch.compile`` (``int8_kernel`` says why not torch's CUDA
  ``_weight_int8pack_mm``); elsewhere ``torch._weight_int8pack_mm(x, q, scales)`` where it runs, else gpt-fast's.
- **int4**: asymmetric, a scale and a zero per group of ``group_size`` input columns of each row,
  ``w ~ (q - 8) * scale + zero``, ``q`` in 0..15, packed two a byte by ``_convert_weight_to_int4pack_for_cpu`` (CPU) or
  ``_convert_weight_to_int4pack`` (CUDA, bf16 activations) and multiplied by the matching ``_weight_int4pack_mm``;
  rows are padded to a multiple of 16 (the packing's tile), the padding's outputs dropped.

The head shares its weight with the token embedding; the quantized head holds its own int8 or int4 copy and the
embedding keeps the original table (a lookup reads one row a token, not the table).
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from ...core.errors import OptlabError, choice_error
from ...core.knobs.limits import check_count
from ...core.measuring.memory import GraphPoolTally, cpu_step_increase_mb, phase_peak_mb, phase_start, resident_mb
from ...core.process.quiet import fix_threads
from ...core.stats.sequential import visit_order
from ...core.measuring.timing import INTERVAL, speed_up
from . import generation

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels accept (CPU and CUDA)
INT4_ROW_TILE = 16  # the int4 packing needs the output rows in multiples of this
INT4_INNER_K_TILES = 2  # the packing's inner tile count (CUDA allows 2, 4, 8); needs in features % 32 == 0
INT8_MAX = 127
INT8_PACKED = "torch._weight_int8pack_mm"
INT8_DEQUANTIZED = "F.linear(x, int8 weight in x's dtype) * scales"
INT4_CPU = "torch._weight_int4pack_mm_for_cpu"
INT4_CUDA = "torch._weight_int4pack_mm"
SMALLEST_SCALE = 1e-12  # a row (or group) of zeros gets this scale, not a division by zero
MAX_ROUNDS = 100  # paired rounds of a decode comparison: an interval hardly narrows past this
MAX_BATCH = 1_024  # decode batch: far beyond what a CPU decodes in a page's time
MAX_PROMPT, MAX_NEW_TOKENS = 4_096, 1_024
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as int8 ``q`` and one scale per output row (in ``weight``'s dtype):
    ``weight ~ q * scales[:, None]``, symmetric, the largest magnitude of each row at 127."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=SMALLEST_SCALE)
    q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales.to(weight.dtype)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight ``q`` and its per-row ``scales`` stand for, in ``scales``' dtype."""
    return q.to(scales.dtype) * scales[:, None]


def check_group_size(group_size: int, in_features: "int | None" = None) -> int:
    """``group_size`` if the int4 kernels accept it (and it divides ``in_features``), else one line saying what is."""
    if isinstance(group_size, bool) or group_size not in INT4_GROUP_SIZES:
        raise OptlabError(f"int4 group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} "
                          f"(what the int4 kernels accept), got {group_size!r}")
    if in_features is not None and in_features % group_size:
        allowed = [g for g in INT4_GROUP_SIZES if in_features % g == 0] or ["none"]
        raise OptlabError(f"int4 group_size {group_size} does not divide a layer's {in_features} input features; "
                          f"allowed here: {', '.join(map(str, allowed))}")
    return group_size


def int4_weight(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as int4 values ``q`` (int32, 0..15) and ``scales_and_zeros``
    ``[in / group_size, out, 2]`` (in ``weight``'s dtype): within each group of ``group_size`` columns of a row,
    ``weight ~ (q - 8) * scale + zero``, the group's minimum at 0 and its maximum at 15."""
    out_features, in_features = weight.shape
    check_group_size(group_size, in_features)
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=SMALLEST_SCALE)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    zeros = low + 8 * scales
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
    return q.reshape(out_features, in_features), scales_and_zeros


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight ``[out, in]`` that int4 ``q`` and its groups' ``scales_and_zeros`` stand for."""
    out_features, in_features = q.shape
    scales, zeros = (part.transpose(0, 1).float()[..., None] for part in scales_and_zeros.unbind(-1))
    grouped = q.reshape(out_features, in_features // group_size, group_size).float()
    return ((grouped - 8) * scales + zeros).reshape(out_features, in_features).to(scales_and_zeros.dtype)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.size(-1)).contiguous()


class Int8Linear(nn.Module):
    """An ``nn.Linear`` with its weight in int8 and one scale per output channel; ``kernel`` names the multiply."""

    def __init__(self, linear: nn.Linear, kernel: str = INT8_PACKED) -> None:
        super().__init__()
        if kernel not in (INT8_PACKED, INT8_DEQUANTIZED):
            raise choice_error("int8 kernel", kernel, (INT8_PACKED, INT8_DEQUANTIZED))
        self.in_features, self.out_features, self.kernel = linear.in_features, linear.out_features, kernel
        q, scales = int8_weight(linear.weight)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in]`` times the quantized weight, without the bias."""
        if self.kernel == INT8_PACKED:
            return torch._weight_int8pack_mm(x, self.weight, self.scales)
        return F.linear(x, self.weight.to(x.dtype)) * self.scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(_flat(x))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values ``[out, in]`` packed for the int4 kernel of ``q``'s device."""
    if q.device.type == "cuda":
        return torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), INT4_INNER_K_TILES)
    return torch._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)


class Int4Linear(nn.Module):
    """An ``nn.Linear`` with its weight in packed int4, a scale and a zero per group of ``group_size`` inputs."""

    def __init__(self, linear: nn.Linear, group_size: int = 64) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = check_group_size(group_size, linear.in_features)
        weight = linear.weight.detach()
        padded = -self.out_features % INT4_ROW_TILE
        weight = torch.cat([weight, weight.new_zeros(padded, self.in_features)]) if padded else weight
        q, scales_and_zeros = int4_weight(weight, group_size)
        self.kernel = INT4_CUDA if weight.device.type == "cuda" else INT4_CPU
        self.register_buffer("weight", _pack_int4(q))
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in]`` times the quantized weight, without the bias (the padding's outputs dropped)."""
        multiply = torch._weight_int4pack_mm if self.kernel == INT4_CUDA else torch._weight_int4pack_mm_for_cpu
        return multiply(x, self.weight, self.group_size, self.scales_and_zeros)[:, :self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(_flat(x))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


QUANTIZED = (Int8Linear, Int4Linear)
ROUNDING_STEPS = 0.5  # a weight rounded to its nearest level is at most half a step away
# In 16 bits a scale's rounding and the product's each move an int8 weight by up to a quarter step (127 levels times
# bf16's relative half-ulp of 2^-9); a quarter step more for the kernel's own order of operations.
SIXTEEN_BIT_STEPS = 1.25


def error_bound(dtype: torch.dtype) -> float:
    """How many quantization steps a kernel's weight may lie from the original with activations in ``dtype``."""
    return ROUNDING_STEPS + 1e-3 if dtype == torch.float32 else SIXTEEN_BIT_STEPS


def quantization_steps(weight: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """The spacing of ``layer``'s levels for each weight of ``weight`` ``[out, in]``, from the original weights:
    a row's largest magnitude / 127 (int8) or a group's range / 15 (int4)."""
    w = weight.detach().float()
    if isinstance(layer, Int8Linear):
        return (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).expand_as(w)
    groups = w.reshape(w.size(0), -1, layer.group_size)
    return ((groups.amax(dim=-1) - groups.amin(dim=-1)) / 15).repeat_interleave(layer.group_size, dim=1)


@torch.no_grad()
def error_in_steps(linear: nn.Linear, layer: nn.Module) -> float:
    """The largest distance between ``linear``'s weights and the weights ``layer``'s kernel multiplies by (its
    product with the identity), in quantization steps (``quantization_steps``): at most
    ``ROUNDING_STEPS`` where the quantizer, the packing and the kernel agree."""
    weight = linear.weight
    effective = layer.matmul(torch.eye(linear.in_features, device=weight.device, dtype=weight.dtype)).float().T
    steps = quantization_steps(weight, layer).clamp(min=SMALLEST_SCALE)
    return float(((effective - weight.float()).abs() / steps).max())


def largest_error_in_steps(original: nn.Module, quantized: nn.Module) -> float:
    """``error_in_steps`` over every quantized layer of ``quantized``, against the layer of ``original`` it
    replaced (0 when none is quantized)."""
    return max((error_in_steps(original.get_submodule(name), layer) for name, layer in quantized.named_modules()
                if isinstance(layer, QUANTIZED)), default=0.0)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@functools.lru_cache(maxsize=None)
def _tried(scheme: str, device: str, dtype: torch.dtype) -> str | None:
    """None when ``scheme``'s packed kernel runs a tiny layer on ``device`` with ``dtype`` activations, else why not."""
    layer = nn.Linear(64, 32).to(device, dtype)
    x = torch.ones(2, 64, device=device, dtype=dtype)
    try:
        module = Int8Linear(layer, INT8_PACKED) if scheme == "int8" else Int4Linear(layer, 32)
        with torch.no_grad():
            module(x)
    except (RuntimeError, NotImplementedError) as error:
        return _first_line(error)
    return None


def int8_kernel(device: "torch.device | str", dtype: torch.dtype) -> str:
    """The int8 multiply for ``device`` with ``dtype`` activations. On CUDA the dequantizing ``F.linear``, as
    gpt-fast runs int8 (Inductor fuses the cast and the scale into the matmul): torch's CUDA ``_weight_int8pack_mm``
    computes each output with one thread or warp in fp32 and shares no weight tile across rows, so at a large batch it
    reads the weights once per row, and a table of it would time that kernel, not weight-only quantization.
    Elsewhere the packed kernel where it runs, else the dequantizing ``F.linear``."""
    place = torch.device(device)
    if place.type == "cuda":
        return INT8_DEQUANTIZED
    return INT8_PACKED if _tried("int8", str(place), dtype) is None else INT8_DEQUANTIZED


def int4_support(device: "torch.device | str", dtype: torch.dtype) -> str | None:
    """None when an int4 kernel runs on ``device`` with ``dtype`` activations, else one line: no kernel, and why."""
    why = _tried("int4", str(torch.device(device)), dtype)
    return None if why is None else f"no int4 kernel on {torch.device(device).type} for {dtype}: {why}"


def _replacer(scheme: str, device: torch.device, dtype: torch.dtype,
              group_size: int) -> Callable[[nn.Linear], nn.Module]:
    if scheme == "int8":
        kernel = int8_kernel(device, dtype)
        return lambda linear: Int8Linear(linear, kernel)
    why = int4_support(device, dtype)
    if why is not None:
        raise OptlabError(why)
    return lambda linear: Int4Linear(linear, group_size)


def quantize(model: nn.Module, scheme: str, group_size: int = 64) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` replaced by its ``scheme`` ("int8" or "int4") weight-only
    module (the original is left as it was). int4 needs a kernel on the model's device (``int4_support``)
    and a ``group_size`` from ``INT4_GROUP_SIZES`` that divides every layer's input features."""
    if scheme not in SCHEMES:
        raise choice_error("quantization scheme", scheme, SCHEMES)
    if scheme == "int4":
        check_group_size(group_size)
    weight = next(model.parameters())
    replace = _replacer(scheme, weight.device, weight.dtype, group_size)
    quantized = copy.deepcopy(model)
    linears = [(name, module) for name, module in quantized.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        setattr(quantized.get_submodule(parent_name), child, replace(linear))
    return quantized


def layer_counts(model: nn.Module) -> dict[str, int]:
    """How many of ``model``'s matmul layers are plain ``nn.Linear`` and how many are int8 or int4."""
    modules = list(model.modules())
    return {"linear": sum(isinstance(m, nn.Linear) for m in modules),
            "int8": sum(isinstance(m, Int8Linear) for m in modules),
            "int4": sum(isinstance(m, Int4Linear) for m in modules)}


def _storage_bytes(tensors: "list[torch.Tensor]") -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def matmul_weight_bytes(model: nn.Module) -> int:
    """Bytes of the matmul layers' weights, scales, zeros and biases: what one decode step reads, row of the
    embedding aside (each storage once)."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, *QUANTIZED))]
    return _storage_bytes([t for m in layers for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))])


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``, each storage once (the tied embedding and head once)."""
    return _storage_bytes([*model.parameters(), *model.buffers()])


@dataclass(frozen=True)
class ChapterPlan:
    """What the chapter runs on a device: the trained GPT (a name of ``trained.SERVING_SIZES``, the same key as the
    KV cache chapter's, so that one training serves both) and its steps, the dtype of the unquantized weights, the
    two decode batches (bandwidth-bound, then not), the prompt, the new tokens, the paired rounds and int4's group."""

    size: str
    steps: int
    dtype: torch.dtype
    batches: tuple[int, int]
    prompt_len: int
    new_tokens: int
    rounds: int
    group_size: int


def chapter_plan(cuda: bool) -> ChapterPlan:
    """On a GPU, GPT-2 small in bf16 at batch 1 and 64, decode steps under CUDA graphs; on a CPU, the book's tiny GPT
    in fp32 at batch 1 and 16."""
    if cuda:
        return ChapterPlan("gpt2_small", 300, torch.bfloat16, (1, 64), 32, 64, 6, 64)
    return ChapterPlan("gpt_tiny", 200, torch.float32, (1, 16), 8, 16, 16, 64)


def weight_label(model: nn.Module) -> str:
    """The unquantized model's row: "fp32 weights" or "bf16 weights"."""
    name = str(next(model.parameters()).dtype).removeprefix("torch.")
    return f"{DTYPE_NAMES.get(name, name)} weights"


def variants(model: nn.Module, group_size: int = 64) -> tuple[dict[str, nn.Module], list[str]]:
    """The model and its int8 and int4 weight-only copies, by label, and a line for each scheme that could not be
    built on this device (int4 without a kernel)."""
    built, skipped = {weight_label(model): model}, []
    for scheme in SCHEMES:
        label = f"{scheme} weight-only" + (f" (group {group_size})" if scheme == "int4" else "")
        try:
            built[label] = quantize(model, scheme, group_size)
        except OptlabError as error:
            if scheme != "int4" or "no int4 kernel" not in str(error):
                raise
            skipped.append(f"{label}: {error}")
    return built, skipped


def kernel_name(model: nn.Module) -> str:
    """The multiply ``model``'s matmul layers run: the quantized kernel, or ``F.linear``."""
    kernels = {getattr(m, "kernel", "F.linear") for m in model.modules() if isinstance(m, (nn.Linear, *QUANTIZED))}
    return ", ".join(sorted(kernels))


def layers_table(models: dict[str, nn.Module]) -> pd.DataFrame:
    """One row per variant: the kernel that ran, how many matmul layers are plain or quantized, their bytes, and the
    largest distance of the weights its kernels multiply by from the first model's, in quantization steps."""
    original = next(iter(models.values()))
    rows = [{"variant": label, "kernel": kernel_name(model), **layer_counts(model),
             "matmul weights MiB": matmul_weight_bytes(model) / 2**20, "all weights MiB": model_bytes(model) / 2**20,
             "largest error (steps)": largest_error_in_steps(original, model)}
            for label, model in models.items()]
    return pd.DataFrame(rows).set_index("variant").round(4)


@dataclass(frozen=True)
class DecodeTimes:
    """Decode steps of every variant at one batch size, timed in paired rounds (``decode_times``)."""

    batch: int
    baseline: str
    step_s: dict[str, list[float]]  # per variant: each round's mean decode step (one token for every row)
    shifts: dict[str, list[int]]  # per variant: how many slots after the baseline it ran in each round
    peak_mib: dict[str, float]  # per variant: resident weights and KV cache plus the peak increase of one generation

    def table(self) -> pd.DataFrame:
        """Tokens a second (every row's), the median step, the speed-up over the baseline with its interval and
        verdict, and peak memory: one row per variant."""
        rows = []
        for label, times in self.step_s.items():
            step = float(np.median(times))
            row = {"variant": label, "batch": self.batch, "tokens/s": self.batch / step, "ms per step": 1e3 * step,
                   "rounds": len(times), "peak MiB": self.peak_mib[label]}
            if label == self.baseline:
                rows.append(row | {"speed-up": 1.0, "low": np.nan, "high": np.nan, "verdict": "reference"})
                continue
            result = speed_up(self.step_s[self.baseline], times, self.shifts[label])
            rows.append(row | {"speed-up": result.ratio, "low": result.low, "high": result.high,
                               "verdict": result.verdict})
        return pd.DataFrame(rows).set_index("variant").round(4)

    def speedups(self) -> pd.DataFrame:
        """The quantized variants' speed-ups as tidy rows, in the columns ``optlab.book.report`` plots."""
        table = self.table().drop(index=self.baseline)
        return pd.DataFrame({"model": f"batch {self.batch}", "phase": f"decode ({INTERVAL})", "variant": table.index,
                             "source": "live", "speedup": table["speed-up"], "ci_low": table["low"],
                             "ci_high": table["high"], "verdict": table["verdict"], "role": None,
                             "versus": self.baseline}).reset_index(drop=True)


def _generation(model: nn.Module, prompt: torch.Tensor, new_tokens: int, compiled: bool,
                cache: generation.StaticKVCache) -> generation.Generation:
    return generation.generate(model, prompt, new_tokens, cache="static", compiled=compiled, reuse=cache)


def _peak_mib(model: nn.Module, run: Callable[[], object], device: torch.device, graphs: bool) -> float:
    """Resident MiB of ``model`` plus the peak increase while ``run`` runs once (the cache and the activations),
    and, if it replays CUDA graphs (``graphs``), what its graphs added to the private pools in that run: a replay
    uses that memory without allocating, and the other variants' graphs are not its own."""
    start = phase_start(device)
    increase = np.nan
    pool = GraphPoolTally(device, graphs)
    if device.type == "cuda":
        with pool.run():
            run()
    else:
        increase = cpu_step_increase_mb(run)
    return phase_peak_mb(device, start, resident_mb([model], device), increase) + pool.mb


@torch.no_grad()
def decode_times(models: dict[str, nn.Module], batch: int, prompt_len: int = 8, new_tokens: int = 16,
                 rounds: int = 6, seed: int = 0) -> DecodeTimes:
    """Greedy generation with the static KV cache (compiled, CUDA graphs, on a GPU) from the same random prompt of
    ``batch`` rows by every variant, in ``rounds`` paired rounds (``optlab.core.stats.sequential.visit_order``) after an
    untimed one that also measures peak memory; each round keeps a variant's mean decode step. Each variant fills
    one static cache, emptied before every run (``generate(reuse=...)``): its storage never moves, so on a GPU the
    CUDA graphs are recorded in the untimed run and only replayed in the timed ones. The first model is the
    baseline."""
    batch = check_count("batch", batch, 1, MAX_BATCH, "a decode batch")
    rounds = check_count("rounds", rounds, 2, MAX_ROUNDS, "paired rounds; an interval needs at least two")
    prompt_len = check_count("prompt_len", prompt_len, 1, MAX_PROMPT, "prompt tokens")
    new_tokens = check_count("new_tokens", new_tokens, 2, MAX_NEW_TOKENS, "decode steps after the first token")
    first = next(iter(models.values()))
    device = next(first.parameters()).device
    fix_threads(device.type == "cuda")
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(first.config.vocab_size, (batch, prompt_len), generator=generator).to(device)
    compiled, labels = device.type == "cuda", list(models)
    caches = {label: generation.StaticKVCache(models[label], batch, prompt_len + new_tokens - 1) for label in labels}
    peaks = {label: _peak_mib(models[label], lambda m=models[label], c=caches[label]:
                              _generation(m, prompt, new_tokens, compiled, c), device, compiled)
             + caches[label].nbytes / 2**20 for label in labels}  # the cache, allocated before the run
    step_s: dict[str, list[float]] = {label: [] for label in labels}
    shifts: dict[str, list[int]] = {label: [] for label in labels}
    for round_index in range(rounds):
        order = visit_order(labels, round_index)
        for label in order:
            run = _generation(models[label], prompt, new_tokens, compiled, caches[label])
            step_s[label].append(float(np.mean(run.decode_s)))
            shifts[label].append(order.index(label) - order.index(labels[0]))
    return DecodeTimes(batch, labels[0], step_s, shifts, peaks)


@torch.no_grad()
def next_token_agreement(reference: nn.Module, model: nn.Module, windows: torch.Tensor) -> float:
    """The share of positions of ``windows`` ``[N, T]`` where ``model``'s most likely next token is ``reference``'s."""
    return float((model(windows).argmax(-1) == reference(windows).argmax(-1)).float().mean())


@torch.no_grad()
def quality_table(models: dict[str, nn.Module], windows: torch.Tensor, prompt: torch.Tensor, new_tokens: int,
                  loss: Callable[[nn.Module], float]) -> pd.DataFrame:
    """Per variant: ``loss`` (the validation loss), its change from the first model's, the share of next tokens
    on ``windows`` equal to the first model's, and the share of greedy tokens after ``prompt`` equal to the first
    model's (once a token differs, the text after it is another text: a strict measure)."""
    reference = next(iter(models.values()))
    fix_threads(windows.device.type == "cuda")  # on a CPU, the threads the timed runs use: no waiting for busy cores
    reference_tokens = generation.generate(reference, prompt, new_tokens).new_tokens
    base_loss = loss(reference)
    rows = []
    for label, model in models.items():
        value = loss(model)
        tokens = generation.generate(model, prompt, new_tokens).new_tokens
        rows.append({"variant": label, "validation loss": value, "loss change": value - base_loss,
                     "next-token agreement": next_token_agreement(reference, model, windows),
                     "greedy tokens equal": float((tokens == reference_tokens).float().mean())})
    return pd.DataFrame(rows).set_index("variant").round(4)
