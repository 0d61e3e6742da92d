"""The character corpus: real tiny Shakespeare when present, else a stand-in of its format; windows and their shift."""
import urllib.error

import pytest
import torch

from optlab.core import text_data
from optlab.core.errors import OptlabError
from optlab.core.text_data import SHAKESPEARE_ALPHABET, SHAKESPEARE_SIZE, load_corpus, text_datasets


@pytest.fixture
def empty_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTLAB_DATA", str(tmp_path))
    return tmp_path


def test_the_stand_in_has_the_real_format_and_says_so(empty_data_dir):
    corpus = load_corpus()
    assert corpus.kind == "stand-in" and corpus.description.startswith("stand-in (synthetic tiny Shakespeare")
    assert "\n" not in corpus.description
    assert corpus.alphabet == SHAKESPEARE_ALPHABET and len(corpus.alphabet) == 65
    assert len(corpus.text) == SHAKESPEARE_SIZE
    assert corpus.text == load_corpus(seed=0).text and corpus.text != load_corpus(seed=1).text


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
