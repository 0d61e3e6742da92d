"""Tie-aware comparison of greedy decodings: a token that differs from the reference's choice is accepted only where
the model's logits for the two lie within the dtype's margin, it is counted, and every later token is checked too."""
import math

import pytest
import torch
from torch import nn

from optlab.core.errors import OptlabError
from optlab.core.gpt.transformer import GPT, GPTConfig
from optlab.studies.serving import agreement, generation

VOCAB, PROMPT = 8, 2


class Scripted(nn.Module):
    """A stand-in model whose next token is the last one plus 1 (logit 10), with near-ties placed by hand: the logits
    at position t are row t of ``offsets``, rolled by the token at t (column j: the token t's plus j). Its embedding
    carries the dtype the margin is read from."""

    def __init__(self, offsets: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.offsets = offsets
        self.token_embedding = nn.Embedding(VOCAB, 2).to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        columns = (torch.arange(VOCAB) - tokens[..., None]) % VOCAB  # [B, T, V]: token v is the last one plus this
        return self.offsets[:tokens.size(1)].expand(tokens.size(0), -1, -1).gather(-1, columns)


def scripted() -> Scripted:
    """Best at every position: the last token plus 1, at 10. At position 2 the token plus 4 is 0.2 below it (a
    near-tie in bf16, whose margin is 0.25) and the token plus 5 is 2 below; at position 4 the token plus 6 is a
    whole logit below (no tie)."""
    offsets = torch.zeros(7, VOCAB)
    offsets[:, 1] = 10.0
    offsets[2, 4], offsets[2, 5], offsets[4, 6] = 9.8, 8.0, 9.0
    return Scripted(offsets, torch.bfloat16)


def greedy_after(prefix: list[int], length: int = 8) -> list[int]:
    """``prefix`` continued by the scripted model's greedy choice (the last token plus 1) up to ``length`` tokens."""
    tokens = list(prefix)
    while len(tokens) < length:
        tokens.append((tokens[-1] + 1) % VOCAB)
    return tokens


REFERENCE = greedy_after([0, 1])  # 0 1 2 3 4 5 6 7
TIE = greedy_after([0, 1, 2, 6])  # at position 2 (token 2) the near-tie 2 + 4, then greedy on its own text
NO_TIE = greedy_after([0, 1, 2, 3, 4, 2])  # at position 4 (token 4) 4 + 6 = 2 (mod 8), a whole logit below


def test_a_near_tie_is_accepted_and_counted_and_a_real_difference_is_refused():
    model = scripted()
    assert agreement.token_agreement(model, REFERENCE, REFERENCE, PROMPT) == agreement.TokenAgreement(6, 0, 0.0, 0.25)
    accepted = agreement.token_agreement(model, TIE, REFERENCE, PROMPT)
    assert accepted.agrees and accepted.ties == 1 and accepted.worst_gap == pytest.approx(0.2)
    refused = agreement.token_agreement(model, NO_TIE, REFERENCE, PROMPT)
    assert not refused.agrees and refused.ties == 0 and refused.worst_gap == pytest.approx(1.0)
    assert "6 tokens compared with the reference, 1 taken at a near-tie (the two logits within 0.25)" in accepted.line()


def test_the_gap_is_to_the_token_taken_and_every_token_after_a_tie_is_checked():
    model = scripted()
    third = greedy_after([0, 1, 2, 7])  # the two best are close at position 2, but 2 + 5 is third, 2 below
    assert agreement.token_agreement(model, third, REFERENCE, PROMPT).worst_gap == pytest.approx(2.0)
    after = greedy_after([0, 1, 2, 6, 7, 5])  # the tie, then at position 4 (token 7) 7 + 6 = 5, a logit below
    late = agreement.token_agreement(model, after, REFERENCE, PROMPT)
    assert not late.agrees and late.ties == 1 and late.worst_gap == pytest.approx(1.0)


def test_the_margin_is_the_models_dtypes():
    model = scripted()
    model.token_embedding.float()
    assert not agreement.token_agreement(model, TIE, REFERENCE, PROMPT).agrees  # 0.2 is no tie in fp32
    assert agreement.TIE_MARGIN[torch.float32] < 0.2 < agreement.TIE_MARGIN[torch.bfloat16]


def test_rows_are_checked_apart_and_combined_by_sum_and_worst():
    model = scripted()
    both = agreement.token_agreement(model, torch.tensor([REFERENCE, TIE]), torch.tensor([REFERENCE, REFERENCE]),
                                     PROMPT)
    assert both == agreement.TokenAgreement(12, 1, pytest.approx(0.2), 0.25)
    parts = [agreement.token_agreement(model, t, REFERENCE, PROMPT) for t in (TIE, NO_TIE, REFERENCE)]
    assert agreement.combined(parts) == agreement.TokenAgreement(18, 1, pytest.approx(1.0), 0.25)


def test_a_decoding_of_another_length_is_refused():
    short = agreement.token_agreement(scripted(), REFERENCE[:-1], REFERENCE, PROMPT)
    assert not short.agrees and short.worst_gap == math.inf
    with pytest.raises(OptlabError, match="at least one"):
        agreement.combined([])


def test_a_real_gpts_cached_decoding_agrees_with_its_reference():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    prompt = torch.randint(16, (2, 4), generator=torch.Generator().manual_seed(1))
    reference = generation.greedy_reference(model, prompt, 6)
    cached = generation.generate(model, prompt, 6, cache="static").tokens
    assert agreement.token_agreement(model, cached, reference, 4).agrees
    wrong = cached.clone()
    wrong[0, 6] = (wrong[0, 6] + 1) % 16
    assert not agreement.token_agreement(model, wrong, reference, 4).agrees
