"""Models for ``optlab tune --compile``'s tests, written the way readers write them (the book ships none of them):
``TrimmedTagger`` trims the padding off each batch with ``.item()`` (a graph break, and a new length for each
batch); ``Counting`` counts its calls in an attribute (a guard that fails
at every call); ``PerPosition`` loops over positions in Python (a graph for every length); ``Untraceable`` asks for a random number in forward, which makes Dynamo skip the whole frame."""
import random

import torch
from torch import nn

VOCAB, LENGTH = 64, 16


class TrimmedTagger(nn.Module):
    """Token ids ``[N, T]`` (0 is padding) to per-token tags: an embedding, a small MLP, a head; the batch is cut to
    its longest row first."""

    def __init__(self, vocab: int = VOCAB, width: int = 32, tags: int = 8) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, tags)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        longest = int((ids != 0).sum(dim=1).max().item())
        hidden = self.embed(ids[:, :max(longest, 1)])
        hidden = hidden + self.mlp(hidden)
        return self.head(hidden).mean(dim=1)


class Counting(TrimmedTagger):
    """The tagger, counting its calls in a Python attribute of the module."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(ids)


class PerPosition(TrimmedTagger):
    """The tagger with a running mean over positions, one position at a time in a Python loop."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, total = self.embed(ids), 0
        for position in range(ids.shape[1]):
            total = total + hidden[:, position]
        return self.head(self.mlp(total / ids.shape[1]))


class Untraceable(nn.Module):
    """A linear layer whose output is scaled by a Python random number drawn in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (1.0 + 0.0 * random.random())
