"""A character-level corpus for the GPT: tiny Shakespeare when it is on disk (or fetched when asked), else a stand-in.

The stand-in has the real file's format: 1,115,394 characters over the same 65-character alphabet, laid out as a
play (a speaker's name in capitals and a colon, lines of words ending in punctuation, a blank line between speeches),
generated from a seeded lexicon, so a model can learn its spelling and layout. Both go through the same code path
(:class:`TokenWindows`), so a training window costs the same on either.
"""
from __future__ import annotations

import string
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .data import data_dir
from .errors import OptlabError
from .limits import check_count

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_ALPHABET = "\n !$&',-.3:;?" + string.ascii_uppercase + string.ascii_lowercase  # 65 characters
SHAKESPEARE_SIZE = 1_115_394  # characters in input.txt
TRAIN_FRACTION = 0.9
MAX_VOCAB = 1_048_576  # far above any tokenizer's vocabulary; a larger number is a typo
DOWNLOAD_TIMEOUT_S = 30


def corpus_path() -> Path:
    """Where tiny Shakespeare is looked for: ``tinyshakespeare/input.txt`` under :func:`optlab.core.data.data_dir`."""
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


@lru_cache(maxsize=2)
def standin_text(seed: int = 0, size: int = SHAKESPEARE_SIZE) -> str:
    """``size`` characters of a made-up play over :data:`SHAKESPEARE_ALPHABET`, the same for the same ``seed``."""
    rng = np.random.default_rng(seed)
    lower = np.array(list(string.ascii_lowercase))
    lexicon = ["".join(rng.choice(lower, size=rng.integers(1, 9))) for _ in range(2000)]
    lexicon += ["'tis", "o'er", "ne'er", "well-a-day", "&c", "3", "$"]
    weights = 1.0 / np.arange(1, len(lexicon) + 1)  # Zipf-like word frequencies
    weights[-7:] = weights[-8] / 4
    weights /= weights.sum()
    speakers = [letter + "".join(rng.choice(lower, size=rng.integers(3, 8))).upper()
                for letter in string.ascii_uppercase]  # one per capital, so every capital occurs
    endings = ",.;:!?"
    draws = size // 2  # more of each draw than the text can use: one word takes at least two characters
    words = np.array(lexicon)[rng.choice(len(lexicon), size=draws, p=weights)].tolist()
    line_lengths, speeches = rng.integers(3, 10, size=draws), rng.integers(1, 6, size=draws)
    who, ends = rng.integers(len(speakers), size=draws).tolist(), rng.integers(len(endings), size=draws).tolist()
    parts, length, word, line = [], 0, 0, 0
    for speech in range(draws):
        lines = [speakers[who[speech]] + ":"]
        for _ in range(speeches[speech]):
            chosen = words[word:word + line_lengths[line]]
            word += line_lengths[line]
            lines.append(" ".join([chosen[0].capitalize(), *chosen[1:]]) + endings[ends[line]])
            line += 1
        parts.append("\n".join(lines) + "\n\n")
        length += len(parts[-1])
        if length >= size:
            break
    return "".join(parts)[:size]


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


def load_corpus(download: bool = False, seed: int = 0) -> CharCorpus:
    """Tiny Shakespeare from ``$OPTLAB_DATA/tinyshakespeare/input.txt``, fetched first when ``download`` is asked
    for and it is missing; else the stand-in (made from ``seed``). The corpus's ``description`` says which."""
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
    return CharCorpus("stand-in", f"stand-in (synthetic tiny Shakespeare format, {len(SHAKESPEARE_ALPHABET)} "
                                  f"characters; {why})", standin_text(seed))


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


def text_datasets(block_size: int, vocab_size: int | None = None, download: bool = False,
                  seed: int = 0) -> tuple[TokenWindows, TokenWindows, CharCorpus]:
    """The train (first 90 %) and validation (last 10 %) windows of the corpus, and the corpus itself.

    ``vocab_size`` pads the vocabulary past the alphabet (for example 50304 instead of 50257, the shapes chapter):
    the model's embedding and head grow, the tokens still come from the alphabet.
    """
    corpus = load_corpus(download, seed)
    alphabet = len(corpus.alphabet)
    vocab_size = alphabet if vocab_size is None else check_count(
        "vocab_size", vocab_size, alphabet, MAX_VOCAB, "the vocabulary holds the alphabet; more is a typo")
    tokens = corpus.encode(corpus.text)
    split = int(len(tokens) * TRAIN_FRACTION)
    return (TokenWindows(tokens[:split], block_size, vocab_size),
            TokenWindows(tokens[split:], block_size, vocab_size), corpus)


def random_batch(windows: TokenWindows, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``batch_size`` windows drawn at random (as nanoGPT does), stacked to (x [N, T], y [N, T])."""
    starts = torch.randint(len(windows), (batch_size,), generator=generator)
    xs, ys = zip(*(windows[int(i)] for i in starts))
    return torch.stack(xs), torch.stack(ys)
