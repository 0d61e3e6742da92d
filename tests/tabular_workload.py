"""A third workload in one module: an MLP on tabular rows. Importing it registers it (the one registry line is the
``register_workload`` call); ``tests/test_workloads.py`` runs a registered technique on it."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from optlab.core.workload import DataSource, Workload, register_workload

FEATURES, CLASSES, HIDDEN = 12, 3, 64
TRAIN_ROWS, TEST_ROWS = 512, 128


def build_mlp(name: str, variant: str = "base", width: float = 1.0) -> nn.Module:
    """Two hidden layers of ``HIDDEN * width`` units."""
    hidden = max(1, round(HIDDEN * width))
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


def rows(count: int, seed: int) -> TensorDataset:
    """Rows whose class is which of three feature groups has the largest sum (learnable), under noise."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(count, FEATURES, generator=generator)
    labels = features.view(count, CLASSES, -1).sum(-1).argmax(-1)
    return TensorDataset(features, labels)


def find_source(download: bool = False) -> DataSource:
    return DataSource("stand-in", "stand-in (synthetic tabular rows)")


def datasets(source: DataSource, download: bool = False) -> tuple[TensorDataset, TensorDataset]:
    return rows(TRAIN_ROWS, 0), rows(TEST_ROWS, 1)


TABULAR = register_workload(Workload(
    name="tabular", description="an MLP on tabular rows", unit="rows", sample_name="rows", model_names=("mlp",),
    build_model=build_mlp, example_input=lambda batch: torch.randn(batch, FEATURES), find_source=find_source,
    datasets=datasets, train_size=TRAIN_ROWS, test_size=TEST_ROWS, module=__name__,
))
