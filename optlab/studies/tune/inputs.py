"""What ``optlab tune`` is given, checked before any work: the reader's model (a callable, or
``PACKAGE.MODULE:CALLABLE`` with keyword arguments), its batches (synthetic, a map-style dataset or a DataLoader) and
sizes within bounds.

Every bad input becomes one :class:`OptlabError` that says what was given, and nothing is allocated before the sizes
are checked: a batch is bounded in samples, in input values and by the device's memory (:func:`batch_limit`). The
model is built once and run on two samples (the probe) so that a model that rejects the input shape
fails here, with its own error and the shape tried, instead of inside a timed run.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.dataloader import default_collate

from ...core.cifar import data
from ...core.measuring import loops
from ...core.measuring.loops import Inputs
from ...core.knobs.config import RunConfig
from ...core.errors import OptlabError
from ...core.run.experiments import failure_status
from ...core.knobs.limits import check_count
from ...core.measuring.memory import device_memory_bytes
from .examples import Examples, checked_example, describe_inputs

MAX_BATCH_SIZE = 65_536
MAX_BATCH_ELEMENTS = 2**30  # input values in one batch: 4 GiB in fp32, and activations a few times larger stay
# within the 2**31 elements that torch's 32-bit indexing kernels take
POOL_BATCHES = 4  # synthetic batches made once and given in turn
POOL_BYTES = 2**30

Batch = tuple[Inputs, torch.Tensor]
ModelFn = Callable[[], nn.Module]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def parse_kwargs(text: str) -> dict[str, Any]:
    """The model's keyword arguments from a JSON object such as ``{"num_classes": 10}``."""
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as error:
        raise OptlabError(f"--kwargs must be a JSON object such as '{{\"num_classes\": 10}}': {error}") from None
    if not isinstance(kwargs, dict):
        raise OptlabError(f"--kwargs must be a JSON object such as '{{\"num_classes\": 10}}', got {text!r}")
    return kwargs


def model_from_spec(spec: str, kwargs: dict[str, Any] | None = None) -> ModelFn:
    """The callable named by ``PACKAGE.MODULE:CALLABLE`` (for example ``torchvision.models:resnet50``), bound to
    ``kwargs``. Importing it runs that module's code, as ``import`` would."""
    return functools.partial(callable_from_spec(spec, "--model", "builds a model", "torchvision.models:resnet50"),
                             **(kwargs or {}))


def callable_from_spec(spec: str, flag: str, job: str, example: str) -> Callable:
    """The callable that ``PACKAGE.MODULE:CALLABLE`` names, for the option ``flag`` (a callable that does ``job``),
    or one error line that says what was wrong."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise OptlabError(f"{flag} must be PACKAGE.MODULE:CALLABLE, such as {example}; got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001  (any import failure is the user's module, said in one line)
        raise OptlabError(f"cannot import {module_name!r} for {flag} {spec!r}: {describe_error(error)}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            close = difflib.get_close_matches(part, [n for n in dir(target) if not n.startswith("_")], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise OptlabError(f"{module_name!r} has no attribute {attribute!r}{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise OptlabError(f"{flag} {spec!r} is a {type(target).__name__}, not a callable that {job}")
    return target


def example_from_spec(spec: str, training: bool) -> tuple[Any, torch.Tensor | None]:
    """The example batch that the callable ``PACKAGE.MODULE:CALLABLE`` returns, called without arguments: for
    training ``(inputs, targets)``, at inference the inputs (a tensor, a tuple or a dict of keyword tensors)."""
    make = callable_from_spec(spec, "--example-batch", "returns an example batch", "mypackage.serving:example")
    try:
        batch = make()
    except Exception as error:  # noqa: BLE001  (the user's code: its error, in one line)
        raise OptlabError(f"--example-batch {spec}() failed: {describe_error(error)}") from None
    if not training:
        return batch, None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor)):
        raise OptlabError(f"for training, --example-batch {spec} must return (inputs, targets), the targets a tensor; "
                          f"it returned a {type(batch).__name__}")
    return batch[0], batch[1]


def model_name(model_fn: ModelFn) -> str:
    """A readable name for the callable that builds the model."""
    function = model_fn.func if isinstance(model_fn, functools.partial) else model_fn
    return getattr(function, "__qualname__", None) or type(function).__name__


def describe_error(error: BaseException) -> str:
    """An error in one line: ``out of memory``, or its type and first line."""
    return failure_status(error).removeprefix("failed: ")


def build_model(model_fn: ModelFn, seed: int) -> nn.Module:
    """A fresh model from ``model_fn``, with the weights that ``seed`` gives every variant."""
    if isinstance(model_fn, nn.Module):
        raise OptlabError("pass a function that builds the model (such as `lambda: MyNet()`), not a model: every "
                          "variant starts from the same fresh weights")
    if not callable(model_fn):
        raise OptlabError(f"model_fn must be a callable that builds the model, got a {type(model_fn).__name__}")
    torch.manual_seed(seed)
    try:
        model = model_fn()
    except Exception as error:  # noqa: BLE001  (the user's code: its error, in one line)
        raise OptlabError(f"building the model with {model_name(model_fn)}() failed: {describe_error(error)}") from None
    if not isinstance(model, nn.Module):
        raise OptlabError(f"{model_name(model_fn)}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


class SyntheticBatches:
    """A few fixed batches, rows ``[i * batch_size, (i + 1) * batch_size)`` of ``inputs`` and ``targets``, given in
    turn for ``count`` steps: every variant sees the same ones. The tensors are fields, so a variant that holds them
    on the device is charged their memory. With ``copy_to``, each batch is copied there as it is given,
    ``non_blocking`` (from pinned host memory, as a pinned DataLoader hands them over), inside the step that reads
    it."""

    def __init__(self, inputs: Inputs, targets: torch.Tensor, batch_size: int, count: int,
                 copy_to: torch.device | None = None) -> None:
        self.inputs, self.targets, self.batch_size, self.count = inputs, targets, batch_size, count
        self.copy_to = copy_to
        self.pool = len(targets) // batch_size

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.count):
            rows = slice((i % self.pool) * self.batch_size, (i % self.pool + 1) * self.batch_size)
            inputs, targets = loops.map_inputs(lambda t: t[rows], self.inputs), self.targets[rows]
            if self.copy_to is not None:
                inputs = loops.inputs_to(inputs, self.copy_to, non_blocking=True)
                targets = targets.to(self.copy_to, non_blocking=True)
            yield inputs, targets


@dataclass(frozen=True)
class Batches:
    """Where a tune run's batches come from, and how one variant's loader is made."""

    kind: str  # "synthetic", "dataset" or "loader"
    description: str
    batch_size: int
    epoch_images: int  # samples in one pass (for synthetic batches: the timed steps of one repeat)
    first: Batch  # the probe's batch, on the host
    labels: int  # class labels run below this: num_classes for synthetic batches, else the first batch's largest + 1
    loader: Callable[[RunConfig, torch.device], Iterable[Batch]]


def gib(size: float) -> str:
    """A size in bytes as people read it: ``4 GiB``, ``1.5 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} bytes"


def batch_limit(examples: Examples, device: torch.device) -> tuple[int, str]:
    """The most samples one batch of ``examples`` may hold on ``device``, and the bound that sets it, in words:
    :data:`MAX_BATCH_SIZE` samples, :data:`MAX_BATCH_ELEMENTS` input values, and the device's memory
    (:func:`~optlab.core.measuring.memory.device_memory_bytes`) for the inputs alone. A sample that is alone beyond them is
    refused here, with the limit, before any model is built."""
    values, size = examples.values_per_sample, examples.bytes_per_sample
    bounds = [(MAX_BATCH_SIZE, f"{MAX_BATCH_SIZE:,} samples a batch"),
              (MAX_BATCH_ELEMENTS // values, f"{MAX_BATCH_ELEMENTS:,} input values a batch")]
    memory = device_memory_bytes(device)
    if memory:
        bounds.append((memory // size, f"the {gib(memory)} of memory of {device}"))
    most, limit = min(bounds)
    if most < 1:
        raise OptlabError(f"one sample of {values:,} input values ({gib(size)}) is more than one batch may hold "
                          f"on {device}: at most {limit}")
    return most, limit if most == MAX_BATCH_SIZE else f"{limit}: {most} inputs of {values:,} values ({gib(size)})"


def check_batch(name: str, batch: int, examples: Examples, device: torch.device) -> int:
    """``batch`` (``name``: the batch size a user typed) within :func:`batch_limit`, or one error naming the limit."""
    return check_count(name, batch, 1, *batch_limit(examples, device))


def batch_does_not_fit(what: str, batch: int, device: torch.device) -> OptlabError:
    """One line for a batch that does not fit: ``what`` ran out of memory at ``batch`` on ``device``, its memory,
    and what to do."""
    memory = device_memory_bytes(device)
    held = f" ({gib(memory)})" if memory else ""
    return OptlabError(f"{what} runs out of memory at batch {batch} on {device}{held}: pass a smaller batch size "
                       "(--batch-size)")


def synthetic_batches(examples: Examples, batch_size: int, steps_per_run: int) -> Batches:
    """A few batches of ``examples`` (random inputs and targets, or the rows of an example batch), made once on the
    host (on the device for a config with ``data_on_device``); ``batch_size`` is within :func:`batch_limit`. On CUDA
    the host batches are pinned and each is copied ``non_blocking`` in its step, as a pinned DataLoader's are: the
    steps before "+ data on device" pay what a good loader pays, and that step is credited with the copy alone."""
    if not examples.has_targets:
        raise OptlabError("training needs targets: give num_classes (random class labels) with described inputs, "
                          "targets= with an example batch, or data= (batches of inputs and targets)")
    count = max(1, min(POOL_BATCHES, steps_per_run, POOL_BYTES // (batch_size * examples.bytes_per_sample)))
    inputs, targets = examples.make(count * batch_size, 0)

    pinned: list = []  # pinned once, on the first config that copies to a GPU

    def loader(config: RunConfig, device: torch.device) -> SyntheticBatches:
        if config.data_on_device:
            return SyntheticBatches(loops.inputs_to(inputs, device), targets.to(device), batch_size, steps_per_run)
        if device.type == "cuda":  # pageable batches would pay a blocking staging copy that "+ data on device" saves
            pinned[:] = pinned or [loops.map_inputs(torch.Tensor.pin_memory, inputs), targets.pin_memory()]
            return SyntheticBatches(*pinned, batch_size, steps_per_run, copy_to=device)
        return SyntheticBatches(inputs, targets, batch_size, steps_per_run)

    first = (loops.map_inputs(lambda t: t[:batch_size], inputs), targets[:batch_size])
    classes = f", {examples.classes} classes" if examples.classes else ""
    return Batches("synthetic", f"{examples.description}: batches of {batch_size}{classes} ({count} made once, given "
                   "in turn)", batch_size, batch_size * steps_per_run, first, examples.classes or 0, loader)


def dataset_batches(dataset: Dataset, batch_size: int, steps_per_run: int, seed: int) -> Batches:
    """Batches of a map-style dataset, through a DataLoader that each config's knobs build (workers, pinning)."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise OptlabError("data must be a DataLoader or a map-style dataset (with __len__ and __getitem__)")
    full = len(dataset) // batch_size
    _enough(full, steps_per_run, f"the dataset's {len(dataset)} samples make {full} full batches of {batch_size}")
    try:
        first = default_collate([dataset[i] for i in range(min(2, len(dataset)))])
    except Exception as error:  # noqa: BLE001  (the user's dataset: its error, in one line)
        raise OptlabError(f"reading the first samples of the dataset failed: {describe_error(error)}") from None
    first = _pair(first)
    return Batches("dataset", f"your dataset ({type(dataset).__name__}, {len(dataset)} samples), batches of "
                   f"{batch_size}", batch_size, len(dataset), first, _label_bound(first[1]),
                   lambda config, device: data.make_loader(dataset, config, train=True, seed=seed))


def loader_batches(loader: DataLoader, batch_size: int | None, steps_per_run: int) -> Batches:
    """The reader's own DataLoader, used as it is by every config (its workers and pinning are its own)."""
    if loader.batch_size is None:
        raise OptlabError("the DataLoader has no fixed batch_size (a batch_sampler?); pass a DataLoader with one")
    if batch_size is not None and batch_size != loader.batch_size:
        raise OptlabError(f"batch_size={batch_size} but the DataLoader's batch_size is {loader.batch_size}; "
                          "leave batch_size out to use the DataLoader's")
    size = loader.batch_size
    dataset_size = len(loader.dataset) if hasattr(loader.dataset, "__len__") else None
    if dataset_size is not None:
        _enough(dataset_size // size, steps_per_run,
                f"the DataLoader's {dataset_size} samples make {dataset_size // size} full batches of {size}")
    try:
        first = next(iter(loader))
    except Exception as error:  # noqa: BLE001  (the user's loader: its error, in one line)
        raise OptlabError(f"reading the first batch of the DataLoader failed: {describe_error(error)}") from None
    epoch = dataset_size if dataset_size is not None else size * steps_per_run
    first = _pair(first)
    return Batches("loader", f"your DataLoader ({type(loader.dataset).__name__}, batches of {size}, "
                   f"{loader.num_workers} workers)", size, epoch, first, _label_bound(first[1]),
                   lambda config, device: loader)


def check_seconds(name: str, value: float, most: float) -> float:
    """A duration a user typed: a number of seconds above 0 and at most ``most``."""
    if not (isinstance(value, (int, float)) and 0 < value <= most):
        raise OptlabError(f"{name} must be a number of seconds above 0 and at most {most:g}, got {value!r}")
    return float(value)


def _enough(full_batches: int, steps_per_run: int, what: str) -> None:
    if full_batches < steps_per_run:
        raise OptlabError(f"{what}; each timed run needs {steps_per_run} (warm-up + timed steps): pass more data, "
                          "a smaller batch or fewer steps")


def _label_bound(targets: torch.Tensor) -> int:
    """Class labels run below this: the largest + 1 (0 for targets that are not class labels)."""
    if targets.is_floating_point() or not targets.numel():
        return 0
    return int(targets.max()) + 1


def _pair(batch: Any) -> Batch:
    """A batch as ``(inputs, targets)``: inputs a tensor, a tuple or a dict of tensors; targets a tensor."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor)):
        kind = f"a {type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        raise OptlabError(f"each batch must be (inputs, targets), the targets a tensor; the first was {kind}")
    return checked_example(batch[0], "a batch's inputs"), batch[1]


def first_inputs(data: DataLoader | Dataset, rows: int) -> Inputs:
    """The inputs of the first batch of a DataLoader, or of the first ``rows`` samples of a map-style dataset, as an
    example batch: a batch of two is ``(inputs, targets)``, as for training; a tensor or a dict is the inputs."""
    try:
        if isinstance(data, DataLoader):
            batch = next(iter(data))
        elif isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
            raise OptlabError("data must be a DataLoader or a map-style dataset (with __len__ and __getitem__)")
        else:
            batch = default_collate([data[i] for i in range(min(rows, len(data)))])
    except OptlabError:
        raise
    except Exception as error:  # noqa: BLE001  (the user's data: its error, in one line)
        raise OptlabError(f"reading the first batch of data failed: {describe_error(error)}") from None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:  # (inputs, targets), as for training
        batch = batch[0]
    return checked_example(batch, "the data's inputs")


def main_output(raw: Any) -> Any:
    """The tensor a model's output is judged by: the output itself, a dict's ``logits`` (or its only tensor), a
    tuple's first tensor; anything else as it is."""
    if isinstance(raw, dict):
        if "logits" in raw:
            return raw["logits"]
        tensors = [value for value in raw.values() if isinstance(value, torch.Tensor)]
        return tensors[0] if len(tensors) == 1 else raw
    if isinstance(raw, (tuple, list)) and raw and isinstance(raw[0], torch.Tensor):
        return raw[0]
    return raw


def cross_entropy(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """The default loss: cross-entropy of the main output (:func:`main_output`), over every token for ``[N, T, V]``
    outputs with ``[N, T]`` targets (targets of -100 ignored: padding, a last position)."""
    logits = main_output(output)
    if isinstance(logits, torch.Tensor) and logits.dim() >= 3 and logits.shape[:-1] == targets.shape:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    return F.cross_entropy(logits, targets)


@dataclass(frozen=True)
class Probe:
    """What running the model on two samples showed: its FLOPs, parameters and whether layouts matter to it."""

    forward_flops_per_image: float
    parameters: int
    has_conv2d: bool
    input_dims: int  # dimensions of a batch of inputs (4 for images)


def probe(model_fn: ModelFn, batches: Batches, loss_fn: LossFn, device: torch.device, seed: int) -> Probe:
    """Build the model and run a forward and the loss on two samples of the first batch, counting the FLOPs.

    The model's own error, with the shape tried, becomes one OptlabError; so does a label the model's output
    cannot hold (checked before the device sees it: on CUDA it would be a device-side assert)."""
    model = build_model(model_fn, seed).to(device)
    inputs = loops.map_inputs(lambda t: t[:2], batches.first[0])
    targets = batches.first[1][:2]
    shape = str(list(inputs.shape)) if isinstance(inputs, torch.Tensor) else describe_inputs(inputs)
    from torch.utils.flop_counter import FlopCounterMode  # on first use: it imports triton, 0.4 s a process

    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            output = loops.call_model(model, loops.inputs_to(inputs, device))
    except Exception as error:  # noqa: BLE001  (the user's model: its error, in one line)
        raise OptlabError(f"the model rejected inputs of shape {shape}: {describe_error(error)}") from None
    logits = main_output(output)
    classes = None
    if isinstance(logits, torch.Tensor) and logits.dim() >= 2:
        classes = logits.shape[-1] if logits.dim() >= 3 and logits.shape[:-1] == targets.shape else logits.shape[1]
    if (loss_fn in (F.cross_entropy, cross_entropy) or isinstance(loss_fn, nn.CrossEntropyLoss)) \
            and classes is not None and batches.labels > classes:
        raise OptlabError(f"the model gives {classes} outputs per sample, but the labels go up to "
                          f"{batches.labels - 1}: pass a matching num_classes (or the model's own, in --kwargs)")
    try:
        loss = loss_fn(output, targets.to(device))
    except Exception as error:  # noqa: BLE001  (the user's loss or an output it cannot take)
        kind = list(logits.shape) if isinstance(logits, torch.Tensor) else type(output).__name__
        raise OptlabError(f"the loss failed on the model's output ({kind}) for inputs of shape {shape}: "
                          f"{describe_error(error)}") from None
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        kind = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise OptlabError(f"the loss must be a single number (a tensor of one element), got {kind}")
    has_conv2d = any(isinstance(module, nn.Conv2d) for module in model.modules())
    parameters = sum(p.numel() for p in model.parameters())
    first = loops.input_tensors(inputs)[0]
    return Probe(counter.get_total_flops() / len(first), parameters, has_conv2d, first.dim())
