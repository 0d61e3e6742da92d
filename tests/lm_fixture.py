"""A small causal language model for the tune tests: token ids in, scores over the vocabulary for every position
out. ``TinyCausalLM`` takes ``(input_ids, attention_mask)`` positionally and returns ``[N, T, V]`` logits;
``keyword_lm()`` builds one whose ``forward`` takes keyword tensors and returns ``{"logits": ...}``, as Hugging Face
models do."""
import torch
from torch import nn

VOCAB, LENGTH = 48, 12


class TinyCausalLM(nn.Module):
    """An embedding, a GRU (each position sees only the ones before it) and a head over the vocabulary; padded
    positions (mask 0) are zeroed before the GRU."""

    def __init__(self, vocab: int = VOCAB, width: int = 16, return_dict: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)
        self.return_dict = return_dict

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        hidden = self.embed(input_ids)
        if attention_mask is not None:
            hidden = hidden * attention_mask.unsqueeze(-1).to(hidden.dtype)
        hidden, _ = self.rnn(hidden)
        logits = self.head(hidden)
        return {"logits": logits} if self.return_dict else logits


def keyword_lm() -> TinyCausalLM:
    """The same model, called as ``model(input_ids=..., attention_mask=...)`` and returning a dict."""
    return TinyCausalLM(return_dict=True)


def example_tokens() -> dict[str, torch.Tensor]:
    """An example batch of keyword inputs: 3 rows of ids and their mask (the last row padded)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, LENGTH), generator=generator)
    mask = torch.ones(3, LENGTH, dtype=torch.long)
    mask[2, LENGTH // 2:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


def example_training_batch() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """An example training batch: positional (ids, mask) and the next tokens as targets."""
    batch = example_tokens()
    ids = batch["input_ids"]
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    return (ids, batch["attention_mask"]), targets
