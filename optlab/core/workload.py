"""What a run trains: a :class:`Workload` is one object (data, models, loss, FLOPs, example input, unit of
throughput), and the registry of workloads.

The loops, timing, FLOPs, samples and experiments take a workload and never ask which one it is. A workload module
(``cifar``) builds its :class:`Workload` and calls :func:`register_workload`; ``optlab.core`` imports it, which is
the one line that makes a new workload available. Nothing here knows what a sample is made of.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .errors import OptlabError, choice_error


DEFAULT_DATA_DIR = Path.home() / ".cache" / "optlab" / "data"


def data_dir() -> Path:
    """Where every workload's data sets are looked for: ``$OPTLAB_DATA`` if set, else ``~/.cache/optlab/data``."""
    return Path(os.environ.get("OPTLAB_DATA", DEFAULT_DATA_DIR)).expanduser()


@dataclass(frozen=True)
class DataSource:
    """Which data a run used, in the words every record stores."""

    kind: str  # the real data set's name (e.g. "cifar10"), or "stand-in"
    description: str


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ModelBuilder = Callable[..., nn.Module]  # (model name, variant, width, **model knobs) -> a fresh model


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension: ``[N, C]`` logits against ``[N]`` labels, or ``[N, T, V]`` against
    ``[N, T]`` token ids (flattened to one prediction per token)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def correct_predictions(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many predictions (argmax over the last dimension) equal their targets, as a device tensor; there are
    ``targets.numel()`` predictions (one per sample, or one per token)."""
    return (outputs.argmax(dim=-1) == targets).sum()


@dataclass(frozen=True, eq=False)
class Workload:
    """One thing to train: its data, models, loss, FLOPs and the unit its throughput is counted in.

    ``unit`` is what throughput counts ("images", "tokens"); each sample of the data set holds ``items_per_sample`` of
    them (1 for an image; ``items_of(config)`` where a config reads the samples otherwise, as token windows). ``sample_name`` names one sample in messages ("images",
    "sequences"). ``find_source(download)`` says which data a run gets (the real data set when present, else a
    stand-in of the same format and per-sample cost) and ``datasets(source, download)`` builds the train and test
    sets, of ``train_size`` and ``test_size`` samples. ``example_input(batch)`` is a model input of ``batch``
    samples (token ids ``[N, T]`` as a long tensor, images ``[N, 3, H, W]``); inside ``torch.device("meta")`` it is
    built on the meta device, which is how ``optlab.core.measuring.flops`` counts one sample's forward FLOPs.
    ``device_loader(dataset, batch, device, train, drop_last, seed)``, if given, holds the data set on the device
    (the ``data_on_device`` knob); a workload without one refuses that knob.

    A workload whose models take more knobs than (name, variant, width) names them in ``model_knobs`` (``RunConfig``
    fields, passed to ``build_model`` as keywords; every other workload refuses them). Then ``config_input(batch,
    config)`` is the example input for a config, ``view_dataset(dataset, config)`` the data set as that config reads it
    (token windows of its sequence length), ``items_of(config)`` the items in one of its samples, and
    ``counting_knobs`` the knob values under which its FLOPs are counted (the same arithmetic in kernels the counter
    knows). ``profile_models`` and ``profile_knobs`` size it per profile (a GPT-2 on a GPU, a tiny GPT on a CPU).
    ``train_with_replacement``: the training loader draws samples at random with replacement, as many a pass as the
    data set holds, instead of shuffling them.
    """

    name: str
    description: str
    unit: str
    sample_name: str
    model_names: tuple[str, ...]
    build_model: ModelBuilder
    example_input: Callable[[int], Any]
    find_source: Callable[[bool], DataSource]
    datasets: Callable[[DataSource, bool], tuple[Dataset, Dataset]]
    train_size: int
    test_size: int
    items_per_sample: int = 1
    loss: LossFn = cross_entropy
    device_loader: Callable[..., Any] | None = None
    module: str = ""  # the module that registers it (a fresh process imports it to find the workload)
    model_knobs: tuple[str, ...] = ()
    config_input: Callable[[int, Any], Any] | None = None
    view_dataset: Callable[[Dataset, Any], Dataset] | None = None
    items_of: Callable[[Any], int] | None = None
    counting_knobs: dict[str, Any] = field(default_factory=dict)
    profile_models: dict[str, tuple[str, ...]] = field(default_factory=dict)  # profile name -> its default models
    profile_knobs: dict[str, dict[str, Any]] = field(default_factory=dict)  # profile name -> knobs it sets
    train_with_replacement: bool = False  # a shuffled pass over a million windows starts with a 60-120 ms permutation

    def __post_init__(self) -> None:
        if not self.model_names:
            raise OptlabError(f"workload {self.name!r} names no models")
        if self.items_per_sample < 1 or self.train_size < 1 or self.test_size < 1:
            raise OptlabError(f"workload {self.name!r}: items_per_sample, train_size and test_size must be >= 1")

    def validate_models(self, models: Iterable[str]) -> tuple[str, ...]:
        """``models`` as a tuple, each one of :attr:`model_names`; at least one."""
        models = tuple(models)
        for model in models:
            if model not in self.model_names:
                raise choice_error("model", model, self.model_names)
        if not models:
            raise OptlabError(f"no models given; {self.name} models are: " + ", ".join(self.model_names))
        return models

    def knobs_of(self, config: Any) -> dict[str, Any]:
        """The values of this workload's ``model_knobs`` in ``config``."""
        return {knob: getattr(config, knob) for knob in self.model_knobs}

    def build(self, config: Any) -> nn.Module:
        """A fresh model as ``config`` asks (its model, variant, width and this workload's model knobs)."""
        return self.build_model(config.model, config.model_variant, config.width, **self.knobs_of(config))

    def input_for(self, batch: int, config: Any) -> Any:
        """An example input of ``batch`` samples for a model built from ``config``."""
        return self.config_input(batch, config) if self.config_input else self.example_input(batch)

    def dataset_for(self, dataset: Dataset, config: Any) -> Dataset:
        """``dataset`` as ``config`` reads it."""
        return self.view_dataset(dataset, config) if self.view_dataset else dataset

    def items_in(self, config: Any) -> int:
        """Items (in :attr:`unit`) in one sample under ``config``."""
        return self.items_of(config) if self.items_of else self.items_per_sample

    def sizes(self) -> dict[str, int]:
        """Samples in each phase's data set."""
        return {"train": self.train_size, "test": self.test_size}


WORKLOADS: dict[str, Workload] = {}


def register_workload(workload: Workload) -> Workload:
    """Add ``workload`` to ``WORKLOADS`` under its name (its module does this when imported)."""
    WORKLOADS[workload.name] = workload
    return workload


def get_workload(name: str | Workload) -> Workload:
    """The registered workload ``name`` (a :class:`Workload` is returned as it is)."""
    if isinstance(name, Workload):
        return name
    if name not in WORKLOADS:
        raise choice_error("workload", name, list(WORKLOADS))
    return WORKLOADS[name]
