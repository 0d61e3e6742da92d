"""The character corpus: real tiny Shakespeare when present, else real text of its format shipped with Python;
windows and their shift; the entropy levels a learning check is judged against."""
import math
import platform
import urllib.error

import pytest
import torch

from optlab.core.gpt import text_data
from optlab.core.errors import OptlabError
from optlab.core.gpt.text_data import (
    SHAKESPEARE_ALPHABET, SHAKESPEARE_SIZE, entropy_levels, load_corpus, text_datasets, to_alphabet,
)


@pytest.fixture
def empty_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTLAB_DATA", str(tmp_path))
    return tmp_path


def test_the_stand_in_is_real_text_of_the_real_format_and_says_so(empty_data_dir):
    corpus = load_corpus()
    assert corpus.kind == "stand-in" and corpus.description.startswith(
        f"stand-in (real text: Python {platform.python_version()}'s help topics and standard-library docstrings")
    assert "\n" not in corpus.description
    assert corpus.alphabet == SHAKESPEARE_ALPHABET and len(corpus.alphabet) == 65
    assert len(corpus.text) == SHAKESPEARE_SIZE and corpus.text == load_corpus().text
    words = corpus.text.split()
    common = {"the", "of", "a", "is", "to", "and", "in", "that", "be", "it", "for", "are", "if", "not"}
    assert sum(word in common for word in words) > 0.1 * len(words), "not English prose: too few common words"
    assert "The 'assert' statement" in corpus.text and "Return a new" in corpus.text  # help topics and docstrings


def test_text_is_mapped_onto_the_alphabet_keeping_close_characters():
    assert to_alphabet("\u201cf(x)\u201d \u2014 it\u2019s 42,\tok\n\n\n\n  Next  ") == "'f x ' - it's , ok\n\nNext "
    assert set(to_alphabet("any \u00e9 text {with} <odd> [marks] 0123456789")) <= set(SHAKESPEARE_ALPHABET)


def test_the_entropy_levels_are_those_of_known_texts():
    alternating = torch.tensor([0, 1] * 500)
    levels = entropy_levels(alternating, 4)
    assert levels["uniform"] == pytest.approx(math.log(4))
    assert levels["unigram"] == pytest.approx(math.log(2)) and levels["bigram"] == pytest.approx(0, abs=1e-12)
    generator = torch.Generator().manual_seed(0)
    random = torch.randint(8, (200_000,), generator=generator)
    levels = entropy_levels(random, 8)
    assert levels["unigram"] == pytest.approx(math.log(8), abs=1e-3)
    assert levels["bigram"] == pytest.approx(math.log(8), abs=2e-3)  # no pair is likelier than another
    with pytest.raises(OptlabError, match="at least 2 tokens"):
        entropy_levels(torch.tensor([0, 9]), 4)


def test_the_stand_in_sits_between_the_levels_of_real_text(empty_data_dir):
    _, val, _ = text_datasets(block_size=8)
    levels = entropy_levels(val.tokens, val.vocab_size)
    assert levels["uniform"] == pytest.approx(math.log(65))
    assert 2.0 < levels["bigram"] < levels["unigram"] - 0.3 < levels["uniform"] - 0.6  # English letters: ~4.1 bits


def test_windows_are_long_ids_with_the_target_shifted_by_one(empty_data_dir):
    train, val, corpus = text_datasets(block_size=16)
    total = len(corpus.text)
    assert len(train.tokens) == int(total * 0.9) and len(train.tokens) + len(val.tokens) == total
    assert len(train) == len(train.tokens) - 16
    for dataset in (train, val):
        for index in (0, 7, len(dataset) - 1):
            x, y = dataset[index]
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
            assert torch.equal(x, dataset.tokens[index:index + 16])
            assert torch.equal(y, dataset.tokens[index + 1:index + 17])
    assert corpus.decode(train[0][0]) == corpus.text[:16]
    with pytest.raises(IndexError):
        train[len(train)]


def test_the_real_text_is_read_when_it_is_in_the_data_folder(empty_data_dir):
    path = empty_data_dir / "tinyshakespeare" / "input.txt"
    path.parent.mkdir()
    path.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20)
    train, val, corpus = text_datasets(block_size=8)
    assert corpus.kind == "tinyshakespeare" and corpus.description == "tiny Shakespeare (real) from $OPTLAB_DATA"
    assert corpus.decode(train.tokens) + corpus.decode(val.tokens) == corpus.text


def test_a_failed_download_falls_back_to_the_stand_in_saying_why(empty_data_dir, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(text_data.urllib.request, "urlopen", offline)
    corpus = load_corpus(download=True)
    assert corpus.kind == "stand-in" and "download failed" in corpus.description


def test_a_padded_vocabulary_keeps_the_tokens_in_the_alphabet(empty_data_dir):
    train, _, _ = text_datasets(block_size=8, vocab_size=50304)
    assert train.vocab_size == 50304 and int(train.tokens.max()) < 65
    with pytest.raises(OptlabError, match="vocab_size must be at least 65"):
        text_datasets(block_size=8, vocab_size=64)
    with pytest.raises(OptlabError, match="block_size 10000000 is more than this run can use"):
        text_datasets(block_size=10_000_000)
