"""A decoder-only transformer in nanoGPT's shape, with the attention kernel and activation checkpointing as knobs.

Token embedding plus learned positions, pre-norm blocks (LayerNorm, causal self-attention, LayerNorm, a 4x MLP with
GELU), a final LayerNorm and a head that shares the embedding's weight. ``attention`` picks how the causal attention
is computed (all give the same numbers within rounding); ``checkpointing`` picks what the backward pass recomputes.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import cache, partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..knobs.config import ATTENTIONS, CHECKPOINTINGS
from ..errors import OptlabError, choice_error

SDPA_BACKENDS = {
    "sdpa_math": SDPBackend.MATH,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
}
MAX_LAYERS, MAX_HEADS, MAX_EMBD, MAX_BLOCK, MAX_VOCAB = 96, 128, 16_384, 131_072, 1_048_576


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a :class:`GPT`: vocabulary, sequence length (``block_size``), depth, heads and width."""

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name, limit in (("vocab_size", MAX_VOCAB), ("block_size", MAX_BLOCK), ("n_layer", MAX_LAYERS),
                            ("n_head", MAX_HEADS), ("n_embd", MAX_EMBD)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise OptlabError(f"GPTConfig.{name} must be a whole number from 1 to {limit}, got {value!r}")
        if self.n_embd % self.n_head:
            raise OptlabError(f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise OptlabError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


GPT_SIZES = {
    "gpt_tiny": GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "gpt2_small": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}

# Ops whose outputs selective checkpointing keeps: the matmuls and the fused attention kernels. Everything else
# (LayerNorm, GELU, softmax, adds, views) is recomputed in the backward pass.
_SAVED_OP_NAMES = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention")
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _SAVED_OP_NAMES
                      if hasattr(torch.ops.aten, name))


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's policy: keep the outputs of ``SAVED_OPS``, recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def check_choice(what: str, given: str, allowed: tuple[str, ...]) -> str:
    if given not in allowed:
        raise choice_error(what, given, allowed)
    return given


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


def flex_attention_for(device: torch.device):
    """FlexAttention's kernel for ``device``: on CUDA ``torch.compile(flex_attention)``, the documented way to run
    it (compiled once per process; it generates a fused Triton kernel from the mask), elsewhere the eager
    ``flex_attention``, a slow reference that materialises the scores (on a CPU it has no backward)."""
    if device.type == "cuda":
        return _compiled_flex_attention()
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; ``attention`` names the kernel (see ``ATTENTIONS``)."""

    def __init__(self, config: GPTConfig, attention: str = "sdpa") -> None:
        super().__init__()
        self.attention = check_choice("attention", attention, ATTENTIONS)
        self.n_head, self.dropout = config.n_head, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj_dropout = nn.Dropout(config.dropout)
        self._block_masks: dict[tuple[int, str], object] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = (part.view(n, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for part in self.qkv(x).split(c, dim=2))
        y = self.attend(q, k, v)
        return self.proj_dropout(self.proj(y.transpose(1, 2).contiguous().view(n, t, c)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if self.attention == "manual":
            t = q.size(-2)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            weights = F.dropout(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1), dropout, self.training)
            return weights @ v
        if self.attention == "flex":  # compiled on CUDA, eager elsewhere: see flex_attention_for
            return flex_attention_for(q.device)(q, k, v, block_mask=self.block_mask(q.size(-2), q.device))
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        with sdpa_kernel(SDPA_BACKENDS[self.attention]):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)

    def block_mask(self, t: int, device: torch.device):
        """FlexAttention's causal block mask for ``t`` tokens, built once per (length, device)."""
        key = (t, str(device))
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask
            self._block_masks[key] = create_block_mask(causal, None, None, t, t, device=device)
        return self._block_masks[key]


class MLP(nn.Module):
    """The block's feed-forward part: widen 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig, attention: str = "sdpa") -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, attention)
        self.norm2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """nanoGPT's decoder-only transformer: ``forward(idx [N, T] of token ids) -> logits [N, T, vocab_size]``.

    ``attention`` is one of ``ATTENTIONS``; ``checkpointing`` one of ``CHECKPOINTINGS`` ("full" recomputes
    every block in the backward pass, "selective" keeps the matmul outputs and recomputes the pointwise ops).
    ``.blocks`` holds the blocks, so a sharding wrapper can wrap each one.
    """

    def __init__(self, config: GPTConfig, attention: str = "sdpa", checkpointing: str = "none") -> None:
        super().__init__()
        self.config = config
        self.checkpointing = check_choice("checkpointing", checkpointing, CHECKPOINTINGS)
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # the tied head
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of the residual projections
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def attention(self) -> str:
        return self.blocks[0].attn.attention

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n, t = idx.shape
        if t > self.config.block_size:
            raise OptlabError(f"a sequence of {t} tokens is longer than this GPT's block_size {self.config.block_size}")
        positions = torch.arange(t, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = self.run_block(block, x)
        return self.head(self.norm(x))

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "none" or not torch.is_grad_enabled():
            return block(x)
        if self.checkpointing == "full":
            return checkpoint(block, x, use_reentrant=False)
        contexts = partial(create_selective_checkpoint_contexts, save_matmuls_policy)
        return checkpoint(block, x, use_reentrant=False, context_fn=contexts)


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters of ``model`` (the tied head counted once, as GPT-2's 124M is)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def attention_support(attention: str, device: torch.device | str, backward: bool = True,
                      dtype: torch.dtype = torch.float32) -> str | None:
    """None when ``attention`` runs on ``device`` with inputs of ``dtype`` (forward and, with ``backward``, backward),
    else one line saying why not. A tiny call is tried: on a CPU the flash SDPA kernel runs, the memory-efficient and
    cuDNN ones find no viable backend, and FlexAttention runs its forward (slowly, without ``torch.compile``) but has
    no backward; on a GPU the flash and cuDNN kernels need 16-bit inputs."""
    check_choice("attention", attention, ATTENTIONS)
    device = torch.device(device)
    layer = CausalSelfAttention(GPTConfig(vocab_size=8, block_size=16, n_layer=1, n_head=1, n_embd=16),
                                attention).to(device, dtype)
    x = torch.zeros(1, 16, 16, device=device, dtype=dtype, requires_grad=backward)
    try:
        with torch.set_grad_enabled(backward), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FlexAttention's eager-mode warning: the answer here is the line
            out = layer(x)
            if backward:
                out.sum().backward()
    except (RuntimeError, NotImplementedError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"{attention} does not run {'training' if backward else 'inference'} on {device.type}: {first}"
    return None


def forward_flops(config: GPTConfig, batch_size: int, seq_len: int) -> int:
    """FLOPs of one forward pass over ``batch_size`` sequences of ``seq_len`` tokens, attention included, counted by
    ``torch.utils.flop_counter`` on a shapes-only (meta) copy with the hand-written attention: the counter has no
    formula for the CPU's flash SDPA kernel or FlexAttention, while the arithmetic is the same."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = GPT(config, attention="manual")
        idx = torch.zeros(batch_size, seq_len, dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(idx)
    return counter.get_total_flops()
