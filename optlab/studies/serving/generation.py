"""Generating tokens from a prompt with the book's GPT: no cache, a growing KV cache, or a static pre-allocated one.

A decoder produces one token per step, and each step's attention needs the keys and values of every earlier position.
Without a cache every step recomputes them for the whole prefix; a KV cache keeps them. ``DynamicKVCache`` grows its
tensors by concatenation (new shapes every step); ``StaticKVCache`` allocates ``[batch, heads, max_len, head_dim]``
once per layer and writes each step's keys in place, so every decode step has the same shapes: what compiled
decoding (CUDA graphs) needs. ``forward_cached`` runs the GPT's own modules and weights over new tokens at each
row's positions; ``generate`` times prefill and decode apart; ``greedy_reference`` recomputes everything and
gives the tokens every variant must reproduce.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ...core.errors import OptlabError, choice_error
from ...core.measuring.timing import StepTimer
from ...core.gpt.transformer import GPT

CACHES = ("static", "dynamic", "none")
MAX_NEW_TOKENS = 65_536
MAX_BATCH = 4_096


def _model_dtype_device(model: GPT) -> tuple[torch.dtype, torch.device]:
    weight = model.token_embedding.weight
    return weight.dtype, weight.device


def _check_rows(rows: "torch.Tensor | list[int] | int", batch: int) -> torch.Tensor:
    rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= batch):
        raise OptlabError(f"rows must lie in 0..{batch - 1} (the cache's batch), got {rows.tolist()}")
    return rows


class StaticKVCache:
    """Keys and values for every layer, pre-allocated as ``[batch, heads, max_len, head_dim]`` in the model's dtype
    and on its device, and ``lengths`` (how many positions each row holds; rows may differ). The tensors are written
    in place and never re-allocated, so compiled decoding sees the same storage every step."""

    def __init__(self, model: GPT, batch: int, max_len: int) -> None:
        config = model.config
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
            raise OptlabError(f"StaticKVCache batch must be a whole number from 1 to {MAX_BATCH}, got {batch!r}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= config.block_size:
            raise OptlabError(f"StaticKVCache max_len must be a whole number from 1 to the GPT's block_size "
                              f"{config.block_size}, got {max_len!r}")
        dtype, device = _model_dtype_device(model)
        shape = (batch, config.n_head, max_len, config.n_embd // config.n_head)
        self.batch, self.max_len = batch, max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.longest = 0  # an upper bound on lengths, kept on the host so that a step needs no device sync
        for tensor in (*self.keys, *self.values, self.lengths):
            torch._dynamo.mark_static_address(tensor)  # CUDA graphs may write into these between replays

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values (all layers, all of ``max_len``)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def data_pointers(self) -> tuple[int, ...]:
        """The storage addresses of every layer's keys and values: they stay fixed for the cache's life."""
        return tuple(t.data_ptr() for t in (*self.keys, *self.values))

    def reset_rows(self, rows: "torch.Tensor | list[int] | int") -> None:
        """Empty ``rows`` (their lengths become 0)."""
        self.lengths[_check_rows(rows, self.batch).to(self.lengths.device)] = 0
        self.longest = int(self.lengths.max())

    def load_row(self, row: int, other: StaticKVCache, src_row: int = 0) -> None:
        """Copy row ``src_row`` of ``other`` (keys, values and its length) into row ``row``."""
        _check_rows(row, self.batch)
        _check_rows(src_row, other.batch)
        length = int(other.lengths[src_row])
        if len(other.keys) != len(self.keys) or length > self.max_len:
            raise OptlabError(f"load_row needs a cache of the same model holding at most {self.max_len} positions, "
                              f"got {len(other.keys)} layers and {length} positions")
        for mine, theirs in zip((*self.keys, *self.values), (*other.keys, *other.values)):
            mine[row, :, :length].copy_(theirs[src_row, :, :length])
        self.lengths[row] = length
        self.longest = int(self.lengths.max())

    def truncate(self, lengths: "torch.Tensor | list[int] | int") -> None:
        """Roll rows back to ``lengths`` (one per row, or one for all), each no longer than the row holds."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device).reshape(-1)
        if lengths.numel() not in (1, self.batch):
            raise OptlabError(f"truncate takes one length or one per row ({self.batch}), got {lengths.numel()}")
        lengths = lengths.expand(self.batch)
        if bool((lengths < 0).any()) or bool((lengths > self.lengths).any()):
            raise OptlabError(f"truncate lengths must lie between 0 and each row's length {self.lengths.tolist()}, "
                              f"got {lengths.tolist()}")
        self.lengths.copy_(lengths)
        self.longest = int(self.lengths.max())

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write ``keys``/``values`` ``[B, H, T, D]`` of ``layer`` at ``positions`` ``[B, T]``; return the layer's
        whole keys and values and the mask of what each new token may attend to (``[B, 1, T, max_len]``)."""
        rows = torch.arange(self.batch, device=positions.device)[:, None]
        self.keys[layer][rows, :, positions] = keys.transpose(1, 2)
        self.values[layer][rows, :, positions] = values.transpose(1, 2)
        slots = torch.arange(self.max_len, device=positions.device)
        return self.keys[layer], self.values[layer], slots[None, None, None, :] <= positions[:, None, :, None]

    def room(self) -> int:
        return self.max_len


class DynamicKVCache:
    """Keys and values that grow by concatenation each step; ``lengths`` as in ``StaticKVCache``, with every
    row holding the same number of positions."""

    def __init__(self, model: GPT, batch: int) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
            raise OptlabError(f"DynamicKVCache batch must be a whole number from 1 to {MAX_BATCH}, got {batch!r}")
        _, device = _model_dtype_device(model)
        self.batch, self.block_size = batch, model.config.block_size
        self.keys: list[torch.Tensor | None] = [None] * model.config.n_layer
        self.values: list[torch.Tensor | None] = [None] * model.config.n_layer
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.longest = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def truncate(self, lengths: "torch.Tensor | list[int] | int") -> None:
        """Roll every row back to ``lengths`` (one length: the rows of this cache stay equal)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1).unique()
        if lengths.numel() != 1 or not 0 <= int(lengths[0]) <= self.longest:
            raise OptlabError(f"a DynamicKVCache truncates every row to one length from 0 to {self.longest}, "
                              f"got {lengths.tolist()}")
        keep = int(lengths[0])
        self.keys = [None if t is None else t[:, :, :keep] for t in self.keys]
        self.values = [None if t is None else t[:, :, :keep] for t in self.values]
        self.lengths.fill_(keep)
        self.longest = keep

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = keys if old_k is None else torch.cat([old_k, keys], dim=2)
        self.values[layer] = values if old_v is None else torch.cat([old_v, values], dim=2)
        slots = torch.arange(self.keys[layer].size(2), device=positions.device)
        return self.keys[layer], self.values[layer], slots[None, None, None, :] <= positions[:, None, :, None]

    def room(self) -> int:
        return self.block_size


def _attend_cached(block: torch.nn.Module, layer: int, x: torch.Tensor, positions: torch.Tensor,
                   cache: "StaticKVCache | DynamicKVCache") -> torch.Tensor:
    """One block's attention over the cache plus the new tokens, with the block's own weights."""
    attn = block.attn
    n, t, c = x.shape
    q, k, v = (part.view(n, t, attn.n_head, c // attn.n_head).transpose(1, 2) for part in attn.qkv(x).split(c, dim=2))
    keys, values, mask = cache.append(layer, k, v, positions)
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return attn.proj(y.transpose(1, 2).contiguous().view(n, t, c))


def forward_tokens(model: GPT, tokens: torch.Tensor, cache: "StaticKVCache | DynamicKVCache") -> torch.Tensor:
    """Tensor work only (no host-side state), so that it compiles into one graph: logits, keys appended, lengths
    advanced."""
    positions = cache.lengths[:, None] + torch.arange(tokens.size(1), device=tokens.device)
    x = model.token_embedding(tokens) + model.position_embedding(positions)
    for layer, block in enumerate(model.blocks):
        x = x + _attend_cached(block, layer, block.norm1(x), positions, cache)
        x = x + block.mlp(block.norm2(x))
    cache.lengths += tokens.size(1)
    return model.head(model.norm(x))


def forward_cached(model: GPT, tokens: torch.Tensor, cache: "StaticKVCache | DynamicKVCache | None") -> torch.Tensor:
    """Logits ``[B, T, V]`` for ``tokens`` ``[B, T]`` placed at each row's positions ``cache.lengths[b] ..`` + T,
    attending to the row's cached keys and the new ones (causal among the new ones), which are then appended
    (``lengths`` advances by T). ``cache=None`` recomputes the whole sequence (the reference)."""
    if cache is None:
        return model(tokens)
    t = tokens.size(1)
    if cache.longest + t > cache.room():
        raise OptlabError(f"{t} new tokens after {cache.longest} cached do not fit the cache's {cache.room()} "
                          "positions; make the cache (max_len) or the GPT's block_size larger, or generate fewer")
    logits = forward_tokens(model, tokens, cache)
    cache.longest += t
    return logits


@dataclass
class Generation:
    """The tokens (prompt then new ones), the prefill's seconds (prompt to first new token) and each later token's
    decode seconds."""

    tokens: torch.Tensor
    prompt_len: int
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        """Time to first token: the prefill, which ends with the first new token."""
        return self.prefill_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first, as vLLM defines it: the mean of the gaps between the request's
        tokens (its decode steps), NaN with one new token."""
        return float(np.mean(self.decode_s)) if self.decode_s else math.nan

    @property
    def median_step_s(self) -> float:
        """The median decode step (NaN with one new token): robust to a slow step, and not the TPOT."""
        return float(np.median(self.decode_s)) if self.decode_s else math.nan

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len:]


def _check_generate(model: GPT, prompt: torch.Tensor, new_tokens: int, cache: str, temperature: float,
                    top_k: "int | None") -> None:
    if cache not in CACHES:
        raise choice_error("cache", cache, CACHES)
    if prompt.dim() != 2 or prompt.size(1) < 1 or prompt.dtype != torch.long:
        raise OptlabError(f"prompt must be a LongTensor [batch, tokens] with at least one token, got "
                          f"{prompt.dtype} of shape {tuple(prompt.shape)}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or not 1 <= new_tokens <= MAX_NEW_TOKENS:
        raise OptlabError(f"new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS}, got {new_tokens!r}")
    if prompt.size(1) + new_tokens - 1 > model.config.block_size:
        raise OptlabError(f"a {prompt.size(1)}-token prompt plus {new_tokens} new tokens exceeds the GPT's block_size "
                          f"{model.config.block_size}: at most {model.config.block_size - prompt.size(1) + 1} new")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise OptlabError(f"temperature must be 0 (greedy) or a positive number, got {temperature!r}")
    vocab = model.config.vocab_size
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise OptlabError(f"top_k must be None or a whole number from 1 to the vocabulary's {vocab}, got {top_k!r}")


def next_token(logits: torch.Tensor, temperature: float, top_k: "int | None",
               generator: "torch.Generator | None") -> torch.Tensor:
    """The next token ``[B, 1]`` from the last position's logits ``[B, V]``: argmax when ``temperature`` is 0, else
    a draw from the softmax of ``logits / temperature`` (over the ``top_k`` largest, if given)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


def _decode_logits(model: GPT, token: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    return forward_tokens(model, token, cache)[:, -1]


_COMPILED: dict[str, Callable] = {}


DECODE_RECOMPILE_LIMIT = 64  # one compiled decode serves every model, dtype, batch and linear type of a process


def _many_shapes(compiled: Callable) -> Callable:
    """``compiled`` with its own recompile limit: Dynamo's default (8) counts every model, dtype and batch the one
    decode function meets, and under ``fullgraph=True`` the ninth raises. A call that hits it compiles again under
    :data:`DECODE_RECOMPILE_LIMIT`; calls that find their compiled version pay nothing."""
    def step(model: GPT, token: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        try:
            return compiled(model, token, cache)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            with torch._dynamo.config.patch(recompile_limit=DECODE_RECOMPILE_LIMIT):
                return compiled(model, token, cache)
    return step


def compiled_decode(device: torch.device) -> Callable:
    """The decode step ``(model, token [B, 1], static cache) -> logits [B, V]`` under ``torch.compile``:
    ``mode="reduce-overhead"`` (CUDA graphs) on a GPU, the default mode elsewhere; compiled once per process and
    mode (a new model or shape recompiles on its first call, up to ``DECODE_RECOMPILE_LIMIT`` versions)."""
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    if mode not in _COMPILED:
        _COMPILED[mode] = _many_shapes(torch.compile(_decode_logits, mode=mode, fullgraph=True))
    return _COMPILED[mode]


def make_cache(model: GPT, kind: str, batch: int, max_len: int) -> "StaticKVCache | DynamicKVCache | None":
    """A cache of ``kind`` (one of ``CACHES``) for ``batch`` rows of up to ``max_len`` positions."""
    if kind not in CACHES:
        raise choice_error("cache", kind, CACHES)
    if kind == "static":
        return StaticKVCache(model, batch, max_len)
    return DynamicKVCache(model, batch) if kind == "dynamic" else None


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, new_tokens: int, cache: str = "static", temperature: float = 0.0,
             top_k: "int | None" = None, seed: "int | None" = None, compiled: bool = False,
             reuse: "StaticKVCache | None" = None) -> Generation:
    """``new_tokens`` tokens after ``prompt`` ``[B, T0]``, prefill and each decode step timed apart (the book's
    timer: CUDA events on a GPU). Greedy when ``temperature`` is 0, else sampled with a generator seeded by
    ``seed``. ``cache`` is one of ``CACHES``; ``compiled`` compiles the decode step and needs the static cache.
    ``reuse`` is a static cache of the prompt's batch to empty and fill instead of a new one: its storage stays where
    it was, so CUDA graphs recorded on it replay instead of recording again."""
    _check_generate(model, prompt, new_tokens, cache, temperature, top_k)
    if compiled and cache != "static":
        raise OptlabError(f"compiled decoding needs fixed shapes: use cache='static', got cache={cache!r}")
    if reuse is not None and (cache != "static" or reuse.batch != prompt.size(0)
                              or reuse.max_len < prompt.size(1) + new_tokens - 1):
        raise OptlabError(f"reuse needs cache='static' and a StaticKVCache of the prompt's batch {prompt.size(0)} "
                          f"holding at least {prompt.size(1) + new_tokens - 1} positions")
    _, device = _model_dtype_device(model)
    prompt = prompt.to(device)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else seed)
    if reuse is not None:
        reuse.reset_rows(list(range(reuse.batch)))
    store = reuse if reuse is not None else make_cache(model, cache, prompt.size(0), prompt.size(1) + new_tokens - 1)
    step = compiled_decode(device) if compiled else _decode_logits
    timer = StepTimer(device)
    timer.start()
    token = next_token(forward_cached(model, prompt, store)[:, -1], temperature, top_k, generator)
    timer.mark()
    pieces = [prompt, token]
    for _ in range(new_tokens - 1):
        if store is None:
            logits = model(torch.cat(pieces, dim=1))[:, -1]
        else:
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            logits = step(model, token, store)
            store.longest += 1
        token = next_token(logits, temperature, top_k, generator)
        pieces.append(token)
        timer.mark()
    seconds, _ = timer.finish()
    return Generation(torch.cat(pieces, dim=1), prompt.size(1), seconds[0], seconds[1:])


@torch.no_grad()
def greedy_reference(model: GPT, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with no cache (the whole sequence recomputed every step): the tokens ``[B, T0 + new_tokens]``
    every variant must reproduce."""
    return generate(model, prompt, new_tokens, cache="none").tokens
