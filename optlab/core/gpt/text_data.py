"""A character-level corpus for the GPT: tiny Shakespeare when it is on disk (or fetched when asked), else a stand-in.

The stand-in is real English text that ships with every Python: the interactive help's topics
(``pydoc_data/topics.py``) and the docstrings of a fixed list of standard-library modules (:data:`STANDIN_MODULES`),
read from their source without importing them. It is mapped onto tiny Shakespeare's 65-character alphabet and cut to
its 1,115,394 characters, so a training window costs the same on either (both go through :class:`TokenWindows`).
The text follows the Python that runs it: another Python version's help and docstrings give another text.
"""
from __future__ import annotations

import ast
import platform
import re
import string
import sysconfig
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import OptlabError
from ..knobs.limits import check_count
from ..workload import data_dir

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_ALPHABET = "\n !$&',-.3:;?" + string.ascii_uppercase + string.ascii_lowercase  # 65 characters
SHAKESPEARE_SIZE = 1_115_394  # characters in input.txt
TRAIN_FRACTION = 0.9
MAX_VOCAB = 1_048_576  # far above any tokenizer's vocabulary; a larger number is a typo
DOWNLOAD_TIMEOUT_S = 30


def corpus_path() -> Path:
    """Where tiny Shakespeare is looked for: ``tinyshakespeare/input.txt`` under :func:`optlab.core.workload.data_dir`."""
    return data_dir() / "tinyshakespeare" / "input.txt"


@dataclass(frozen=True)
class CharCorpus:
    """A text and its character vocabulary; ``description`` says in one line which text it is."""

    kind: str  # "tinyshakespeare" or "stand-in"
    description: str
    text: str

    @cached_property
    def alphabet(self) -> str:
        """The distinct characters of the text, sorted: token id i is character i."""
        return "".join(sorted(set(self.text)))

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64) of ``text``, one per character."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        known = np.array([ord(char) for char in self.alphabet])
        lookup = np.full(max(codes.max(initial=0), known.max()) + 1, -1, dtype=np.int64)
        lookup[known] = np.arange(len(known))
        ids = lookup[codes]
        if (ids < 0).any():
            unknown = sorted(set(text) - set(self.alphabet))
            raise OptlabError(f"characters {unknown!r} are not in this corpus's alphabet of {len(self.alphabet)}")
        return torch.from_numpy(ids)

    def decode(self, tokens: torch.Tensor) -> str:
        """The text of token ids (ids past the alphabet, from a padded vocabulary, are refused)."""
        alphabet = self.alphabet
        ids = tokens.tolist()
        if any(not 0 <= i < len(alphabet) for i in ids):
            raise OptlabError(f"token ids must be in [0, {len(alphabet)}) to decode")
        return "".join(alphabet[i] for i in ids)


# Modules whose docstrings the stand-in reads, in this order (each present in Python 3.9 to 3.14); after the help
# topics they hold more text than the stand-in needs.
STANDIN_MODULES = ("argparse", "collections/__init__", "dataclasses", "difflib", "functools", "inspect",
                   "logging/__init__", "pathlib", "random", "statistics", "subprocess", "tarfile", "textwrap",
                   "threading", "typing", "unittest/case", "urllib/request", "zipfile", "_pydecimal", "doctest",
                   "pickle", "shutil", "os", "string", "calendar", "csv", "datetime", "enum", "fractions", "heapq",
                   "ipaddress", "json/__init__", "smtplib", "socket", "ssl", "tempfile", "turtle", "uuid", "weakref",
                   "asyncio/events", "email/message", "http/client", "imaplib", "mailbox", "optparse", "pdb",
                   "pydoc", "configparser", "contextlib", "abc", "base64", "bdb", "cmd", "codecs", "copy", "ftplib",
                   "gettext", "glob", "locale", "operator", "platform", "poplib", "pprint", "shlex", "symtable",
                   "timeit", "trace", "traceback", "warnings", "wave", "xml/dom/minidom")
# Characters outside the alphabet that have a close one inside it; every other one becomes a space.
CLOSE_CHARACTERS = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": "'", "\u201d": "'", '"': "'", "`": "'",
                                  "\u2013": "-", "\u2014": "-", "\u2026": "...", "\t": " "})


def to_alphabet(text: str, alphabet: str = SHAKESPEARE_ALPHABET) -> str:
    """``text`` written in ``alphabet``: close characters swapped in (quotes, dashes), any other outside character a
    space, runs of spaces one space, no space at either end of a line and at most one blank line in a row."""
    text = text.translate(CLOSE_CHARACTERS)
    text = "".join(char if char in alphabet else " " for char in text)
    text = re.sub(" *\n *", "\n", re.sub(" +", " ", text))
    return re.sub("\n{3,}", "\n\n", text)


def module_docstrings(name: str) -> str:
    """The docstrings of the standard-library module ``name`` (a path under the library, without ``.py``): the
    module's, then every class's and function's in source order, separated by blank lines; empty if it is absent."""
    path = Path(sysconfig.get_paths()["stdlib"]) / f"{name}.py"
    if not path.is_file():
        return ""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return "\n\n".join(doc for node in ast.walk(tree) if isinstance(node, kinds) and (doc := ast.get_docstring(node)))


@lru_cache(maxsize=1)
def standin_text(size: int = SHAKESPEARE_SIZE) -> str:
    """``size`` characters of Python's own help topics and standard-library docstrings in tiny Shakespeare's
    alphabet (:func:`to_alphabet`)."""
    from pydoc_data.topics import topics  # the text of help("topics"), shipped with every CPython

    parts = [topics[key] for key in sorted(topics)] + [module_docstrings(name) for name in STANDIN_MODULES]
    text = to_alphabet("\n\n".join(parts))
    if len(text) < size:
        raise OptlabError(f"this Python's help topics and docstrings give {len(text):,} characters of text, fewer "
                          f"than the stand-in's {size:,}; put tiny Shakespeare under $OPTLAB_DATA/tinyshakespeare")
    return text[:size]


def fetch(path: Path) -> str | None:
    """Download tiny Shakespeare to ``path``; None with the reason when the network does not allow it."""
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=DOWNLOAD_TIMEOUT_S) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as error:
        return f"the download failed ({error})"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return None


def load_corpus(download: bool = False) -> CharCorpus:
    """Tiny Shakespeare from ``$OPTLAB_DATA/tinyshakespeare/input.txt``, fetched first when ``download`` is asked
    for and it is missing; else the stand-in (``standin_text``: Python's own help text). The corpus's ``description``
    says which."""
    path = corpus_path()
    failure = None
    if download and not path.is_file():
        failure = fetch(path)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise OptlabError(f"tinyshakespeare/input.txt under $OPTLAB_DATA is not UTF-8 text ({error}); remove it "
                              "to use the stand-in, or fetch it again with download") from error
        if len(text) < 2:
            raise OptlabError("tinyshakespeare/input.txt under $OPTLAB_DATA is empty; remove it to use the stand-in")
        return CharCorpus("tinyshakespeare", "tiny Shakespeare (real) from $OPTLAB_DATA", text)
    why = failure or "no tinyshakespeare/input.txt under $OPTLAB_DATA"
    python = platform.python_version()
    return CharCorpus("stand-in", f"stand-in (real text: Python {python}'s help topics and standard-library "
                                  f"docstrings in tiny Shakespeare's alphabet and size; {why})", standin_text())


class TokenWindows(Dataset):
    """Every window of ``block_size`` tokens of a token stream: item ``i`` is (x, y) with x = tokens[i : i+T] and
    y = tokens[i+1 : i+T+1], the next token at each position (both int64)."""

    def __init__(self, tokens: torch.Tensor, block_size: int, vocab_size: int) -> None:
        check_count("block_size", block_size, 1, len(tokens) - 1, "a window and its next token must fit the text")
        self.tokens, self.block_size, self.vocab_size = tokens, block_size, vocab_size

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        index %= len(self)
        chunk = self.tokens[index:index + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def text_datasets(block_size: int, vocab_size: int | None = None,
                  download: bool = False) -> tuple[TokenWindows, TokenWindows, CharCorpus]:
    """The train (first 90 %) and validation (last 10 %) windows of the corpus, and the corpus itself.

    ``vocab_size`` pads the vocabulary past the alphabet (for example 50304 instead of 50257, the shapes chapter):
    the model's embedding and head grow, the tokens still come from the alphabet.
    """
    corpus = load_corpus(download)
    alphabet = len(corpus.alphabet)
    vocab_size = alphabet if vocab_size is None else check_count(
        "vocab_size", vocab_size, alphabet, MAX_VOCAB, "the vocabulary holds the alphabet; more is a typo")
    tokens = corpus.encode(corpus.text)
    split = int(len(tokens) * TRAIN_FRACTION)
    return (TokenWindows(tokens[:split], block_size, vocab_size),
            TokenWindows(tokens[split:], block_size, vocab_size), corpus)


def entropy_levels(tokens: torch.Tensor, alphabet_size: int) -> dict[str, float]:
    """The losses, in nats per token, of three predictors that ignore most of the text, computed on ``tokens`` itself:
    ``uniform`` (every character alike: ln of the alphabet), ``unigram`` (each character's frequency: the entropy of
    the frequencies) and ``bigram`` (the frequency of each character after the one before it: the conditional
    entropy). A model whose loss is below the unigram level uses the context; below the bigram level, more than one
    character of it."""
    if len(tokens) < 2 or alphabet_size < 1 or int(tokens.max()) >= alphabet_size or int(tokens.min()) < 0:
        raise OptlabError(f"entropy levels need at least 2 tokens in [0, {alphabet_size}), got {len(tokens)} tokens")
    ids = tokens.numpy().astype(np.int64)
    counts = np.bincount(ids, minlength=alphabet_size).astype(np.float64)
    pairs = np.bincount(ids[:-1] * alphabet_size + ids[1:], minlength=alphabet_size ** 2).astype(np.float64)
    pairs = pairs.reshape(alphabet_size, alphabet_size)
    unigram = float(-(counts[counts > 0] / len(ids) * np.log(counts[counts > 0] / len(ids))).sum())
    rows = pairs.sum(axis=1, keepdims=True)
    seen = pairs > 0
    bigram = float(-(pairs[seen] * np.log((pairs / np.where(rows > 0, rows, 1))[seen])).sum() / pairs.sum())
    return {"uniform": float(np.log(alphabet_size)), "unigram": unigram, "bigram": bigram}


def random_batch(windows: TokenWindows, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``batch_size`` windows drawn at random (as nanoGPT does), stacked to (x [N, T], y [N, T])."""
    starts = torch.randint(len(windows), (batch_size,), generator=generator)
    xs, ys = zip(*(windows[int(i)] for i in starts))
    return torch.stack(xs), torch.stack(ys)
