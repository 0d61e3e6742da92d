"""Whether a decoding's tokens are a reference decoding's up to rounding: the one check every comparison of greedy
decodings uses (the KV cache's variants, speculative decoding, the batching schedulers).

Two decodings of one model that sum their matmuls in another order (a static cache, a batched step, Inductor's
kernels, CUDA graphs) give logits that differ by rounding; where the greedy choice is a near-tie, that flips the token,
and the text after it is another text. A token that differs is accepted only where the reference model's logits for
the two tokens lie within ``TIE_MARGIN`` of each other in the model's dtype; every such token is counted as a tie.

The reference's logits at each position come from one no-cache forward pass of the model over the compared text: up to
the first differing token the context is the reference decoding's own, so there the choice expected is the reference's
token; after it the text is another, and the choice expected is the model's greedy choice on that text. A decoder that
keeps a wrong token anywhere (a stale key, a rejected draft) moves its logit far from the best and is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Iterable, Sequence

import torch

from ...core.errors import OptlabError
from ...core.gpt.transformer import GPT

# The largest gap between two logits that rounding in the model's dtype can close: bf16 keeps 8 bits of mantissa, so
# near a logit of 16-32 one step is 0.125 and two steps are 0.25; fp16 keeps 11; fp32 reorders sums at ~1e-6.
TIE_MARGIN = {torch.float32: 1e-3, torch.float16: 0.125, torch.bfloat16: 0.25}


@dataclass(frozen=True)
class TokenAgreement:
    """How far compared tokens stand from a reference decoding: how many were compared, how many differ from the
    reference's choice within the margin (``ties``), the largest logit gap at a differing token (0 where none, inf
    where the lengths differ) and the margin in which a gap counts as a tie."""

    compared: int
    ties: int
    worst_gap: float
    margin: float

    @property
    def agrees(self) -> bool:
        """True where every token is the reference's, or differs only at a near-tie (a gap within ``margin``)."""
        return self.worst_gap <= self.margin

    def line(self) -> str:
        """One line: the tokens compared and the ties among them, with the margin."""
        return (f"{self.compared} tokens compared with the reference, {self.ties} taken at a near-tie (the two "
                f"logits within {self.margin:g}), largest gap at a differing token {self.worst_gap:.3g}")


def combined(agreements: Iterable[TokenAgreement]) -> TokenAgreement:
    """Several comparisons as one: the tokens and ties summed, the worst gap the largest, the widest margin."""
    items = list(agreements)
    if not items:
        raise OptlabError("combined needs at least one TokenAgreement, got none")
    return TokenAgreement(sum(a.compared for a in items), sum(a.ties for a in items),
                          max(a.worst_gap for a in items), max(a.margin for a in items))


def _rows(tokens: "torch.Tensor | Sequence[int]") -> torch.Tensor:
    rows = torch.as_tensor(tokens, dtype=torch.long)
    if rows.dim() not in (1, 2):
        raise OptlabError(f"tokens must be one sequence or a [rows, positions] tensor, got {rows.dim()} dimensions")
    return rows.reshape(-1, rows.size(-1)).cpu()


@torch.no_grad()
def token_agreement(model: GPT, tokens: "torch.Tensor | Sequence[int]", reference: "torch.Tensor | Sequence[int]",
                    prompt_len: int) -> TokenAgreement:
    """``tokens`` (whole sequences, prompt first: ``[rows, T]`` or one list) against ``reference``, the same prompt's
    greedy decoding without a cache: a token that differs from the reference's choice is a tie where the model's
    logits for the two lie within ``TIE_MARGIN`` of its dtype (the module's docstring says how each position's
    choice is found), else a disagreement."""
    compared, expected_rows = _rows(tokens), _rows(reference)
    margin = TIE_MARGIN[model.token_embedding.weight.dtype]
    new = compared.size(1) - prompt_len
    if compared.shape != expected_rows.shape or new < 0:
        return TokenAgreement(max(new, 0) * compared.size(0), 0, math.inf, margin)
    differs = compared[:, prompt_len:] != expected_rows[:, prompt_len:]
    if not differs.any():
        return TokenAgreement(differs.numel(), 0, 0.0, margin)
    device = model.token_embedding.weight.device
    logits = model(compared[:, :-1].to(device))[:, prompt_len - 1:].float().cpu()  # position p predicts token p + 1
    positions = torch.arange(new)
    first = torch.where(differs.any(1), differs.float().argmax(1), new)
    expected = torch.where(positions <= first[:, None], expected_rows[:, prompt_len:], logits.argmax(-1))
    taken = compared[:, prompt_len:]
    gaps = (logits.gather(-1, expected[..., None]) - logits.gather(-1, taken[..., None])).abs()[..., 0]
    other = taken != expected
    worst = float(gaps[other].max()) if other.any() else 0.0
    return TokenAgreement(differs.numel(), int((other & (gaps <= margin)).sum()), worst, margin)
