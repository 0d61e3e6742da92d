"""The KV cache chapter's measurement: greedy decoding with no cache, a dynamic cache, a static cache and a compiled
static cache, timed in paired rounds, with TTFT, TPOT, memory, the bandwidth bound and MBU.

Every round runs each variant once (a whole generation), in the book's rotating order (``sequential.visit_order``);
each round keeps a variant's TPOT (vLLM's: the mean of its decode steps) and its median decode step. Tokens/s, the
bound and MBU use the TPOT's median over the rounds, and a speed-up over no cache is the ratio of the same two
medians (the ratio of the tokens/s), so that a row's speed-up and its rate always rank the variants alike; beside it
stand the book's interval and verdict of the TPOT paired round by round, read once after the fixed rounds, which
drift between rounds does not move. The median step is shown
beside, as what one slow step does not move (a gap between it and the TPOT shows slow steps). The compiled variant
is compiled before the rounds and its compile time reported apart. Every variant's tokens are checked against the
no-cache greedy reference.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from ...core.errors import OptlabError
from ...core.knobs.limits import check_count
from ...core.measuring.memory import cpu_step_increase_mb, graph_pool_mb, phase_peak_mb, phase_start, resident_mb
from ...core.run.progress import progress_bar
from ...core.stats.sequential import visit_order
from ...core.measuring.timing import INTERVAL, speed_up
from ...core.gpt.transformer import GPT, GPTConfig
from . import bandwidth
from .agreement import TokenAgreement, token_agreement
from .generation import (
    Generation, StaticKVCache, compiled_decode, forward_cached, generate, greedy_reference, make_cache,
)
from .trained import trained_gpt, validation_windows

VARIANTS = {"no cache": ("none", False), "dynamic cache": ("dynamic", False), "static cache": ("static", False),
            "static cache, compiled": ("static", True)}
BASELINE = "no cache"
MAX_ROUNDS = 64


@dataclass(frozen=True)
class DecodeSize:
    """The chapter's size on a device: the trained GPT (a name of ``trained.SERVING_SIZES``) and its training
    steps, the dtype it decodes in, the prompt, the new tokens and the paired rounds."""

    size: str
    steps: int
    dtype: torch.dtype
    prompt_len: int
    new_tokens: int
    rounds: int


# On a CPU the book's tiny GPT with a prompt long enough that recomputing it costs clearly more than reading a
# cache; on a GPU GPT-2 small in bf16, where a decode step is launch-bound and CUDA graphs pay.
DECODE_SIZES = {"cpu": DecodeSize("gpt_tiny", 200, torch.float32, 384, 32, 6),
                "cuda": DecodeSize("gpt2_small", 300, torch.bfloat16, 512, 128, 6)}


def decode_size(device: "str | torch.device") -> DecodeSize:
    """The chapter's size for ``device``'s type."""
    return DECODE_SIZES["cuda" if torch.device(device).type == "cuda" else "cpu"]


def chapter_model(device: "str | torch.device", dtype: "torch.dtype | None" = None) -> GPT:
    """The size's trained GPT on ``device`` in ``dtype`` (default: the size's), in eval mode."""
    size = decode_size(device)
    return trained_gpt(size.size, size.steps, device).to(dtype or size.dtype).eval()


def chapter_prompt(model: GPT, prompt_len: int) -> torch.Tensor:
    """A prompt ``[1, prompt_len]``: the start of a window of the corpus's validation text."""
    x, _ = validation_windows(model.config.block_size, model.config.vocab_size, 1)
    return x[:, :prompt_len].to(model.token_embedding.weight.device)


@dataclass
class DecodeStudy:
    """Per-round TTFT and TPOT of each variant, with what each read and held, on one prompt."""

    device: str
    batch: int
    prompt_len: int
    new_tokens: int
    peak: bandwidth.Peak
    weight_bytes: int
    element_size: int
    config: GPTConfig
    llc_bytes: int | None  # the device's last-level cache
    ttft_s: dict[str, list[float]] = field(default_factory=dict)
    tpot_s: dict[str, list[float]] = field(default_factory=dict)  # per round: the mean decode step (vLLM's TPOT)
    step_s: dict[str, list[float]] = field(default_factory=dict)  # per round: the median decode step
    slot_shifts: dict[str, list[float]] = field(default_factory=dict)
    peak_mb: dict[str, float] = field(default_factory=dict)
    cache_bytes: dict[str, int] = field(default_factory=dict)
    agreements: dict[str, TokenAgreement] = field(default_factory=dict)  # each variant's tokens against the reference
    compile_s: float = math.nan

    @property
    def rounds(self) -> int:
        return len(self.tpot_s[BASELINE])

    def attended(self, label: str) -> float:
        """Cached positions each decode step reads per row, on average: all of a static cache's slots (masked or
        not), a dynamic cache's growing length, none without a cache (it recomputes them instead)."""
        cache = VARIANTS[label][0]
        if cache == "none":
            return 0.0
        last = self.prompt_len + self.new_tokens - 1
        return float(last) if cache == "static" else self.prompt_len + (self.new_tokens - 1) / 2

    def step_bytes(self, label: str) -> float:
        """Bytes a decode step reads: the weights and the cached keys and values it attends to (no cache: the
        weights alone, a lower bound, since it also recomputes the prefix)."""
        return self.weight_bytes + bandwidth.kv_bytes(self.config, self.batch, self.attended(label), self.element_size)

    def mbu_reason(self, label: str) -> str | None:
        """Why the variant gets no MBU figure (its step's bytes fit in the last-level cache, or no datasheet peak on
        a GPU); None where MBU is given."""
        return bandwidth.mbu_reason(self.step_bytes(label), self.llc_bytes, self.peak,
                                    torch.device(self.device).type == "cuda")

    def table(self) -> pd.DataFrame:
        """One row per variant, medians over the rounds: TTFT, TPOT (vLLM's mean gap) and the median step, tokens/s
        (the batch over the TPOT), the speed-up over no cache as the ratio of those tokens/s (so it ranks as they do)
        with the interval and verdict of the TPOT paired by round (``low``, ``high``), the cache's and the peak memory,
        bytes per step, the bandwidth bound and MBU (NaN where ``mbu_reason`` says why), and whether its tokens are the
        reference's up to near-ties (``agreement.token_agreement``) with the count of ties."""
        rows = []
        for label, tpots in self.tpot_s.items():
            tpot = float(np.median(tpots))
            step_bytes = self.step_bytes(label)
            row = {"variant": label, "TTFT ms": 1e3 * float(np.median(self.ttft_s[label])), "TPOT ms": 1e3 * tpot,
                   "median step ms": 1e3 * float(np.median(self.step_s[label])), "tokens/s": self.batch / tpot,
                   "rounds": len(tpots)}
            if label == BASELINE:
                row |= {"decode speed-up": 1.0, "low": math.nan, "high": math.nan, "verdict": "reference"}
            else:
                paired = speed_up(self.tpot_s[BASELINE], tpots, self.slot_shifts[label])
                row |= {"decode speed-up": float(np.median(self.tpot_s[BASELINE])) / tpot, "low": paired.low,
                        "high": paired.high, "verdict": paired.verdict}
            row |= {"KV cache MiB": self.cache_bytes[label] / 2**20, "peak memory MiB": self.peak_mb[label],
                    "MB read per step": step_bytes / 1e6,
                    "bound tokens/s": bandwidth.bound_tokens_per_s(step_bytes, self.batch, self.peak),
                    "MBU %": math.nan if self.mbu_reason(label) else 100 * bandwidth.mbu(step_bytes, tpot, self.peak),
                    "same as reference": self.agreements[label].agrees, "near-ties": self.agreements[label].ties}
            rows.append(row)
        return pd.DataFrame(rows).set_index("variant")

    def speedups(self) -> pd.DataFrame:
        """The cached variants' decode speed-ups over no cache as tidy rows, in the columns
        ``optlab.book.report`` plots."""
        table = self.table().drop(index=BASELINE)
        return pd.DataFrame({"model": "GPT", "phase": "decode", "variant": table.index, "source": "live",
                             "speedup": table["decode speed-up"], "ci_low": table["low"], "ci_high": table["high"],
                             "verdict": table["verdict"], "role": None, "versus": BASELINE}).reset_index(drop=True)

    def describe(self) -> str:
        return (f"batch {self.batch}, a {self.prompt_len}-token prompt, {self.new_tokens} new tokens, "
                f"{self.rounds} paired rounds on {self.device}; TPOT is the mean decode step (vLLM's); tokens/s is "
                f"the batch over its median, a speed-up the ratio of those tokens/s, with the {INTERVAL} and verdict "
                f"of the TPOT paired by round (read once); "
                f"peak bandwidth {self.peak.label()}")


def _peak_mb(model: GPT, run: Callable[[], object], device: torch.device, pool_before: "float | None") -> float:
    """MiB the model holds plus the most one generation allocated above its start (and, compiled on a GPU, what
    the variant's CUDA graphs added to the private pools since ``pool_before`` MiB, measured before the variant's
    first run: a replay uses that memory without allocating, and other variants' or earlier runs' pools are not
    this variant's)."""
    resident = resident_mb([model], device)
    if device.type == "cuda":
        start = phase_start(device)
        run()
        added = graph_pool_mb(device) - pool_before if pool_before is not None else 0.0
        return phase_peak_mb(device, start, resident) + added
    return resident + cpu_step_increase_mb(run)


def _one_run(model: GPT, prompt: torch.Tensor, new_tokens: int, label: str) -> Generation:
    cache, compiled = VARIANTS[label]
    return generate(model, prompt, new_tokens, cache=cache, compiled=compiled)


def decode_study(model: GPT, prompt: torch.Tensor, new_tokens: int, rounds: int = 6,
                 variants: "tuple[str, ...] | list[str]" = tuple(VARIANTS), progress: bool = True) -> DecodeStudy:
    """Time greedy decoding of ``new_tokens`` after ``prompt`` ``[B, T0]`` with each of ``variants`` (names of
    ``VARIANTS``, no cache among them) in ``rounds`` paired rounds; check each variant's tokens against the no-cache
    reference and measure its peak memory and its cache's bytes on an untimed run. ``progress``: a bar of the
    variants' first runs (a compile among them) and then every timed generation."""
    check_count("rounds", rounds, 2, MAX_ROUNDS, "paired rounds of a decoding comparison")
    unknown = [label for label in variants if label not in VARIANTS]
    if unknown or BASELINE not in variants:
        raise OptlabError(f"variants must be names of {list(VARIANTS)} including {BASELINE!r}, got {list(variants)}")
    weight = model.token_embedding.weight
    device = weight.device
    study = DecodeStudy(str(device), prompt.size(0), prompt.size(1), new_tokens,
                        bandwidth.peak_bandwidth(str(device)), bandwidth.weight_bytes(model), weight.element_size(),
                        model.config, bandwidth.last_level_cache_bytes(device))
    reference = greedy_reference(model, prompt, new_tokens)
    with progress_bar(len(variants) * (1 + rounds), "decoding", progress) as bar:
        _first_runs(study, model, prompt, new_tokens, variants, reference, bar)
        labels = list(variants)
        for index in range(rounds):
            order = visit_order(labels, index)
            for label in order:
                result = _one_run(model, prompt, new_tokens, label)
                study.ttft_s[label].append(result.ttft_s)
                study.tpot_s[label].append(result.tpot_s)
                study.step_s[label].append(result.median_step_s)
                study.slot_shifts[label].append(float(order.index(label) - order.index(BASELINE)))
                bar.update()
    return study


def _first_runs(study: DecodeStudy, model: GPT, prompt: torch.Tensor, new_tokens: int,
                variants: "tuple[str, ...] | list[str]", reference: torch.Tensor, bar: tqdm) -> None:
    """Each variant's untimed runs (a compile among them): its tokens against ``reference``, its peak memory and
    its cache's bytes."""
    device = model.token_embedding.weight.device
    for label in variants:
        pool_before = graph_pool_mb(device) if VARIANTS[label][1] else None
        if VARIANTS[label][1]:  # torch.compile imports Dynamo (seconds on a small CPU) here, outside compile_s
            compiled_decode(device)
        started = time.perf_counter()
        first = _one_run(model, prompt, new_tokens, label)  # warm-up; for the compiled variant, the compile
        first_s = time.perf_counter() - started
        if VARIANTS[label][1]:
            again = _one_run(model, prompt, new_tokens, label)
            study.compile_s = first_s - again.prefill_s - sum(again.decode_s)
        study.agreements[label] = token_agreement(model, first.tokens, reference, prompt.size(1))
        study.peak_mb[label] = _peak_mb(model, lambda: _one_run(model, prompt, new_tokens, label), device,
                                        pool_before)
        study.cache_bytes[label] = _cache_bytes(study, label)
        study.ttft_s[label], study.tpot_s[label], study.step_s[label], study.slot_shifts[label] = [], [], [], []
        bar.update()


def _cache_bytes(study: DecodeStudy, label: str) -> int:
    """Bytes of keys and values the variant holds at the end of a generation: a static cache's whole allocation,
    a dynamic cache's final length, nothing without a cache."""
    cache = VARIANTS[label][0]
    if cache == "none":
        return 0
    positions = study.prompt_len + study.new_tokens - 1
    return int(bandwidth.kv_bytes(study.config, study.batch, positions, study.element_size))


def tokens_match(model: GPT, prompt: torch.Tensor, new_tokens: int,
                 variants: "tuple[str, ...] | list[str]" = tuple(VARIANTS)) -> dict[str, bool]:
    """Whether each variant's greedy tokens equal the no-cache reference's, token for token."""
    reference = greedy_reference(model, prompt, new_tokens)
    return {label: bool(torch.equal(_one_run(model, prompt, new_tokens, label).tokens, reference))
            for label in variants}


def _decode_step(model: GPT, token: torch.Tensor, cache: "StaticKVCache", compiled: bool) -> torch.Tensor:
    """Logits ``[B, 1, V]`` of one decode step, through the compiled step (as ``generate`` runs it) or eagerly."""
    if not compiled:
        return forward_cached(model, token, cache)
    torch.compiler.cudagraph_mark_step_begin()
    logits = compiled_decode(token.device)(model, token, cache)[:, None].clone()  # a graph's output is reused
    cache.longest += 1  # the compiled step leaves the host-side count to its caller, as in ``generate``
    return logits


@torch.no_grad()
def logit_errors(model: GPT, tokens: torch.Tensor, prompt_len: int,
                 variants: "tuple[str, ...] | list[str]" = tuple(VARIANTS)) -> dict[str, float]:
    """The largest difference between each cached variant's logits and the full forward pass's over ``tokens``
    ``[B, T]``: the prompt's first ``prompt_len`` tokens prefilled, then the rest fed one by one through the variant's
    decode step (teacher forcing), as ``generate`` runs them: the last token is never fed, so the caches have
    ``generate``'s sizes. Stale or misplaced keys show here even where the greedy tokens survive them."""
    tokens = tokens[:, :-1]
    full = model(tokens).float()
    errors = {}
    for label in variants:
        kind, compiled = VARIANTS[label]
        if kind == "none":
            continue
        cache = make_cache(model, kind, tokens.size(0), tokens.size(1))
        pieces = [forward_cached(model, tokens[:, :prompt_len], cache)]
        for index in range(prompt_len, tokens.size(1)):
            token = tokens[:, index:index + 1].clone(memory_format=torch.contiguous_format)  # generate's strides
            pieces.append(_decode_step(model, token, cache, compiled))
        errors[label] = float((torch.cat(pieces, dim=1).float() - full).abs().max())
    return errors


@torch.no_grad()
def static_cache_checks(model: GPT, prompt: torch.Tensor, steps: int = 8) -> dict[str, float | bool]:
    """A static cache through a prefill and ``steps`` decode steps: whether its storage stayed where it was
    allocated, and the largest logit difference from the full forward pass when its rows hold different lengths
    and stale keys lie past each row's end (wrong masking shows here)."""
    prompt = prompt[:1]
    cache = StaticKVCache(model, 2, prompt.size(1) + steps)
    pointers = cache.data_pointers()
    forward_cached(model, prompt.expand(2, -1), cache)
    for index in range(steps):
        forward_cached(model, prompt[:, index:index + 1].expand(2, -1), cache)
    fixed = cache.data_pointers() == pointers
    short = prompt.size(1) // 2
    cache.truncate([prompt.size(1) - 1, short])  # past each row's end: stale keys from the steps above
    step = torch.stack([prompt[0, -1], prompt[0, short]])[:, None]
    logits = forward_cached(model, step, cache)[:, 0].float()
    full = torch.stack([model(prompt)[0, -1], model(prompt[:, :short + 1])[0, -1]]).float()
    return {"storage fixed": fixed, "masking error": float((logits - full).abs().max()),
            "logit scale": float(full.abs().max())}
