"""The GPT workload: a decoder-only transformer (``transformer``) learning the next character of a play
(``text_data``: tiny Shakespeare when present, else a stand-in of its format), throughput in tokens.

Its sizes come from the profile: ``gpt_tiny`` (2 layers, 64 wide, 64 tokens) on a CPU, ``gpt2_small`` (GPT-2's
124M: 12 layers, 768 wide, 1024 tokens) on a GPU. Its model knobs are the attention kernel, activation
checkpointing, the sequence length and the vocabulary size (a padded vocabulary only widens the embedding and head;
the tokens still come from the corpus's alphabet).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from . import text_data
from ..errors import OptlabError
from .transformer import GPT, GPT_SIZES, GPTConfig
from ..workload import DataSource, Workload, register_workload

MODEL_KNOBS = ("attention", "checkpointing", "seq_len", "vocab_size")
TRAIN_TEXT = int(text_data.SHAKESPEARE_SIZE * text_data.TRAIN_FRACTION)
TEST_TEXT = text_data.SHAKESPEARE_SIZE - TRAIN_TEXT


def gpt_config(model: str, width: float = 1.0, seq_len: int | None = None, vocab_size: int | None = None) -> GPTConfig:
    """The sizes of ``model`` (a name of ``GPT_SIZES``), ``width`` times as wide (kept a multiple of its heads), with a
    block of ``seq_len`` tokens (at most the size's own) and ``vocab_size`` rows of embedding when given."""
    size = GPT_SIZES[model]
    if seq_len is not None and seq_len > size.block_size:
        raise OptlabError(f"seq_len={seq_len}: {model} holds at most {size.block_size} tokens per sequence")
    embd = max(size.n_head, round(size.n_embd * width / size.n_head) * size.n_head)
    return replace(size, n_embd=embd, block_size=seq_len or size.block_size,
                   vocab_size=vocab_size or size.vocab_size)


def sequence_length(config: Any) -> int:
    """Tokens in one sequence under a run config: its ``seq_len``, else its model's block size."""
    return config.seq_len or GPT_SIZES[config.model].block_size


def build_gpt(model: str, variant: str = "base", width: float = 1.0, attention: str = "sdpa",
              checkpointing: str = "none", seq_len: int | None = None, vocab_size: int | None = None) -> nn.Module:
    """A fresh :class:`~optlab.core.gpt.transformer.GPT` of ``model``'s sizes with the knobs given."""
    if variant != "base":
        raise OptlabError(f"model variant {variant!r}: the GPT has only the 'base' variant")
    return GPT(gpt_config(model, width, seq_len, vocab_size), attention=attention, checkpointing=checkpointing)


def example_tokens(batch: int, config: Any = None) -> torch.Tensor:
    """``batch`` sequences of token ids (zeros) as long as ``config`` asks (gpt_tiny's block without one)."""
    length = sequence_length(config) if config is not None else GPT_SIZES["gpt_tiny"].block_size
    return torch.zeros(batch, length, dtype=torch.long)


def find_source(download: bool = False) -> DataSource:
    corpus = text_data.load_corpus(download)
    return DataSource(corpus.kind, corpus.description)


def datasets(source: DataSource, download: bool = False) -> tuple[text_data.TokenWindows, text_data.TokenWindows]:
    """The corpus's train and validation token streams, as windows of one token (a config reads them through
    :func:`windows_for`, at its own sequence length)."""
    train, test, _ = text_data.text_datasets(block_size=1, download=download)
    return train, test


def windows_for(dataset: text_data.TokenWindows, config: Any) -> text_data.TokenWindows:
    """``dataset``'s token stream as windows of ``config``'s sequence length."""
    return text_data.TokenWindows(dataset.tokens, sequence_length(config), config.vocab_size or dataset.vocab_size)


GPT_WORKLOAD = register_workload(Workload(
    name="gpt",
    description="next-character prediction on a play with a nanoGPT-shaped transformer",
    unit="tokens",
    sample_name="sequences",
    model_names=tuple(GPT_SIZES),
    build_model=build_gpt,
    example_input=example_tokens,
    find_source=find_source,
    datasets=datasets,
    train_size=TRAIN_TEXT - GPT_SIZES["gpt2_small"].block_size,  # windows of the longest sequence in each part
    test_size=TEST_TEXT - GPT_SIZES["gpt2_small"].block_size,
    items_per_sample=1,  # the data set's samples are single tokens: a config reads them as windows (windows_for)
    module=__name__,
    model_knobs=MODEL_KNOBS,
    config_input=lambda batch, config: example_tokens(batch, config),
    view_dataset=windows_for,
    items_of=sequence_length,
    counting_knobs={"attention": "manual", "checkpointing": "none"},  # FlopCounterMode knows matmuls, not every kernel
    profile_models={"smoke": ("gpt_tiny",), "quick": ("gpt2_small",), "full": ("gpt2_small",)},
    train_with_replacement=True,  # random windows, as nanoGPT draws them
    # bf16 autocast on a GPU, as GPTs are trained today (and flash attention needs 16-bit inputs); fp32 on a CPU,
    # whose autocast has no bf16 units to run on (5x slower on the CI machine)
    profile_knobs={"smoke": {"batch_size": 8, "width": 1.0},
                   "quick": {"batch_size": 16, "width": 1.0, "amp_dtype": "bf16"},
                   "full": {"batch_size": 16, "width": 1.0, "amp_dtype": "bf16"}},
))
