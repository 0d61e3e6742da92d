"""The model's inputs, of any shape and kind, made at any batch size: one tensor, a tuple of positional tensors or a
dict of keyword tensors (integer ids and masks included).

They come from a description (``float:3,224,224``, ``tokens:32000:128:mask``, ``input_ids=tokens:...``) or from an
example batch the reader gives; either way :class:`Examples` makes a batch of ``n`` by scaling the first dimension.
For training, each batch comes with its targets: random class labels, the next token of a token input (padding and
the last position ignored by cross-entropy), or the rows of the targets given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ...core.errors import OptlabError
from ...core.knobs.limits import check_count
from ...core.measuring.loops import Inputs, input_tensors

MAX_DIM = 65_536  # one dimension of one input
MAX_CLASSES = 1_000_000
MAX_VOCAB = 10_000_000
MAX_INPUTS = 16  # tensors in one example
IGNORE = -100  # cross-entropy's ignore_index: targets at padding and at the last position
INPUT_FORMS = "float:D1,D2,... or tokens:VOCAB:LEN[:mask], each with an optional NAME= for a keyword input"
TOKEN_MASK = "attention_mask"


@dataclass(frozen=True)
class InputSpec:
    """One described input: random normal floats of ``shape``, or token ids below ``vocab`` of length ``shape[0]``
    (with an attention mask beside them if ``mask``); ``name`` makes it a keyword input."""

    kind: str  # "float" or "tokens"
    shape: tuple[int, ...]
    vocab: int | None = None
    mask: bool = False
    name: str | None = None


@dataclass(frozen=True)
class Examples:
    """How a tune run makes the model's inputs: ``make(n, index)`` gives batch ``index`` (0, 1, ...) of ``n`` samples
    as ``(inputs, targets)`` on the host (targets None where there are none); ``values_per_sample`` and
    ``bytes_per_sample`` count one sample's inputs; ``classes`` bounds class-label targets (None if unknown)."""

    description: str
    make: Callable[[int, int], tuple[Inputs, torch.Tensor | None]]
    values_per_sample: int
    bytes_per_sample: int
    classes: int | None = None
    has_targets: bool = True


def parse_input(text: str) -> InputSpec:
    """One ``--input`` description: ``[NAME=]float:D1,D2,...`` or ``[NAME=]tokens:VOCAB:LEN[:mask]``."""
    name, sep, body = text.partition("=")
    if not sep:
        name, body = None, text
    elif not name.isidentifier():
        raise OptlabError(f"--input {text!r}: {name!r} is not a keyword name; the forms are {INPUT_FORMS}")
    kind, _, rest = body.partition(":")
    parts = rest.split(":") if rest else []
    numbers = _whole_numbers(parts[0].split(",") if kind == "float" and len(parts) == 1 else
                             parts[:2] if kind == "tokens" and len(parts) in (2, 3) and parts[2:] in ([], ["mask"])
                             else None)
    if numbers is None:
        raise OptlabError(f"--input {text!r} is not an input description; the forms are {INPUT_FORMS}, such as "
                          "tokens:32000:128:mask or float:3,224,224")
    if kind == "float":
        return InputSpec("float", check_shape(numbers), name=name)
    check_count("the vocabulary size", numbers[0], 2, MAX_VOCAB, "token ids")
    return InputSpec("tokens", check_shape(numbers[1:]), numbers[0], len(parts) == 3, name)


def _whole_numbers(texts: list[str] | None) -> list[int] | None:
    try:
        return None if texts is None else [int(text) for text in texts]
    except ValueError:
        return None


def parse_shape(text: str) -> tuple[int, ...]:
    """One input's shape from ``"3,224,224"`` (the batch dimension is not part of it)."""
    try:
        shape = tuple(int(part) for part in text.replace(" ", "").strip("()[]").split(","))
    except ValueError:
        raise OptlabError(f"input shape must be whole numbers separated by commas, such as 3,224,224; "
                          f"got {text!r}") from None
    return check_shape(shape)


def check_shape(shape: Iterable[int]) -> tuple[int, ...]:
    """``shape`` (one sample's, no batch dimension) as a tuple of 1 to 4 dimensions, each within bounds."""
    shape = tuple(shape)
    if not 1 <= len(shape) <= 4:
        raise OptlabError(f"input shape must have 1 to 4 dimensions (no batch dimension), got {list(shape)}")
    for size in shape:
        check_count("each input dimension", size, 1, MAX_DIM, "values along one dimension of one input")
    return shape


def described(specs: Sequence[InputSpec], num_classes: int | None, seed: int) -> Examples:
    """Inputs made from descriptions: positional in order, or all keyword (a token input's mask beside it, as
    ``attention_mask``). Targets: the next token of the first token input, else labels below ``num_classes``."""
    if not specs:
        raise OptlabError(f"give at least one input; the forms are {INPUT_FORMS}")
    if len(specs) > MAX_INPUTS:
        raise OptlabError(f"{len(specs)} inputs given; at most {MAX_INPUTS}")
    named = [spec.name is not None for spec in specs]
    if any(named) and not all(named):
        raise OptlabError("name every input (NAME=..., keyword inputs) or none (positional inputs), not some")
    names = [spec.name for spec in specs] + [TOKEN_MASK for spec in specs if spec.mask]
    if all(named) and len(set(names)) != len(names):
        raise OptlabError(f"two inputs share a name: {sorted(names)}")
    tokens = next((spec for spec in specs if spec.kind == "tokens"), None)
    if num_classes is not None:
        check_count("num_classes", num_classes, 2, MAX_CLASSES, "classes of the synthetic labels")

    def make(n: int, index: int) -> tuple[Inputs, torch.Tensor | None]:
        generator = torch.Generator().manual_seed(seed + 7919 * index)
        made: list[tuple[str | None, torch.Tensor]] = []
        targets = None
        for spec in specs:
            if spec.kind == "float":
                made.append((spec.name, torch.randn(n, *spec.shape, generator=generator)))
                continue
            ids, mask = token_batch(n, spec.shape[0], spec.vocab, spec.mask, generator)
            made.append((spec.name, ids))
            if spec.mask:
                made.append((TOKEN_MASK if spec.name else None, mask))
            if spec is tokens:
                targets = next_tokens(ids, mask)
        if tokens is None and num_classes is not None:
            targets = torch.randint(0, num_classes, (n,), generator=generator)
        inputs = dict(made) if all(named) else tuple(t for _, t in made)
        return (inputs[0] if isinstance(inputs, tuple) and len(inputs) == 1 else inputs), targets

    values = sum(math.prod(spec.shape) * (2 if spec.mask else 1) for spec in specs)
    value_bytes = sum(math.prod(spec.shape) * (4 if spec.kind == "float" else 8 * (2 if spec.mask else 1))
                      for spec in specs)  # float32; int64 ids and masks
    words = ", ".join(describe_spec(spec) for spec in specs)
    return Examples(f"synthetic inputs: {words}", make, values, value_bytes, tokens.vocab if tokens else num_classes,
                    tokens is not None or num_classes is not None)


def describe_spec(spec: InputSpec) -> str:
    prefix = f"{spec.name}=" if spec.name else ""
    if spec.kind == "float":
        return f"{prefix}{list(spec.shape)} (random normal)"
    mask = f", with {TOKEN_MASK if spec.name else 'a mask'} (random lengths, padded at the end)" if spec.mask else ""
    return f"{prefix}token ids of length {spec.shape[0]} below {spec.vocab}{mask}"


def token_batch(n: int, length: int, vocab: int, with_mask: bool,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``n`` rows of random token ids (int64) and, if ``with_mask``, a mask of ones then zeros (lengths from half to
    all of ``length``; ids 0 at the padding)."""
    ids = torch.randint(0, vocab, (n, length), generator=generator)
    if not with_mask:
        return ids, None
    lengths = torch.randint((length + 1) // 2, length + 1, (n, 1), generator=generator)
    mask = (torch.arange(length) < lengths).long()
    return ids * mask, mask


def next_tokens(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A causal language model's targets: each position's next token; the last position and padding ignored."""
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = IGNORE
    if mask is not None:
        targets[mask.roll(-1, dims=1).eq(0) | mask.eq(0)] = IGNORE
    return targets


def given(inputs: Any, targets: torch.Tensor | None = None, num_classes: int | None = None, seed: int = 0,
          what: str = "inputs") -> Examples:
    """Inputs made from an example batch the reader gives (a tensor, a tuple or list of tensors, a dict of keyword
    tensors), with its ``targets`` (or random labels below ``num_classes``): a batch of ``n`` takes the example's
    rows in turn, from a different row for each batch index."""
    inputs = checked_example(inputs, what)
    rows = len(input_tensors(inputs)[0])
    if targets is not None:
        if not isinstance(targets, torch.Tensor) or targets.dim() == 0 or len(targets) != rows:
            kind = f"shape {list(targets.shape)}" if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise OptlabError(f"the targets must be a tensor with the example's {rows} rows first, got {kind}")

    if num_classes is not None:
        check_count("num_classes", num_classes, 2, MAX_CLASSES, "classes of the synthetic labels")

    def make(n: int, index: int) -> tuple[Inputs, torch.Tensor | None]:
        take = (torch.arange(n) + index * n) % rows
        if targets is not None:
            return select_rows(inputs, take), targets[take]
        labels = None if num_classes is None else \
            torch.randint(0, num_classes, (n,), generator=torch.Generator().manual_seed(seed + index))
        return select_rows(inputs, take), labels

    values = sum(t[0].numel() for t in input_tensors(inputs))
    value_bytes = sum(t[0].numel() * t.element_size() for t in input_tensors(inputs))
    classes = num_classes
    if targets is not None and not targets.is_floating_point() and targets.numel():
        classes = int(targets.max()) + 1
    return Examples(f"your example batch ({describe_inputs(inputs)}), its rows taken in turn", make, values,
                    value_bytes, classes, targets is not None or num_classes is not None)


def examples_from(inputs: Any, targets: torch.Tensor | None, input_shape: Iterable[int] | None,
                  num_classes: int | None, seed: int) -> Examples:
    """The model's inputs from what a tune call was given: ``input_shape`` (random normal floats), ``inputs`` as
    descriptions (a string or a list of strings: :func:`parse_input`) or as an example batch (with ``targets``)."""
    if input_shape is not None:
        if inputs is not None:
            raise OptlabError("give input_shape or inputs, not both")
        return described([InputSpec("float", check_shape(input_shape))], num_classes, seed)
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and
                                   all(isinstance(text, str) for text in inputs)):
        if targets is not None:
            raise OptlabError("targets= goes with an example batch of tensors; described inputs make their own")
        return described([parse_input(text) for text in ([inputs] if isinstance(inputs, str) else inputs)],
                         num_classes, seed)
    if inputs is None:
        raise OptlabError("give input_shape (one input's shape, such as (3, 224, 224)), inputs (an example batch, or "
                          f"descriptions: {INPUT_FORMS}) or data= (a DataLoader or a map-style dataset)")
    return given(inputs, targets, num_classes, seed)


def checked_example(inputs: Any, what: str = "inputs") -> Inputs:
    """An example batch as the model takes it, or one error that says what it was."""
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    tensors = list(inputs.values()) if isinstance(inputs, dict) else \
        list(inputs) if isinstance(inputs, tuple) else [inputs]
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        kinds = ", ".join(type(t).__name__ for t in tensors) or "nothing"
        raise OptlabError(f"{what} must be a tensor, a tuple of tensors or a dict of keyword tensors, each with the "
                          f"batch first; got {type(inputs).__name__} ({kinds})")
    if isinstance(inputs, dict) and not all(isinstance(key, str) and key.isidentifier() for key in inputs):
        raise OptlabError(f"{what}: a dict's keys are the model's keyword names; got {list(inputs)}")
    if len(tensors) > MAX_INPUTS:
        raise OptlabError(f"{what} holds {len(tensors)} tensors; at most {MAX_INPUTS}")
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        raise OptlabError(f"every tensor of {what} must have the same first (batch) dimension; got "
                          f"{describe_inputs(inputs)}")
    return inputs


def select_rows(inputs: Inputs, rows: torch.Tensor) -> Inputs:
    """The same inputs with the rows ``rows`` of every tensor."""
    if isinstance(inputs, dict):
        return {key: tensor[rows] for key, tensor in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(tensor[rows] for tensor in inputs)
    return inputs[rows]


def describe_inputs(inputs: Inputs) -> str:
    """``input_ids [8, 16] int64, attention_mask [8, 16] int64``."""
    def one(tensor: torch.Tensor) -> str:
        return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
    if isinstance(inputs, dict):
        return ", ".join(f"{key} {one(t)}" for key, t in inputs.items())
    return ", ".join(one(t) for t in (inputs if isinstance(inputs, tuple) else (inputs,)))
