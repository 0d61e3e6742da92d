"""A variant's live objects: its workload's model built from the same seed, its optimizer, scaler and loaders."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.data import RandomSampler

from ..knobs.config import RunConfig
from ..machine.device import DeviceInfo
from ..process.loader import make_loader
from ..measuring.loops import make_optimizer, make_scaler, prepare_model
from ..workload import get_workload


@dataclass
class VariantState:
    """A variant's live objects during a run: its model, optimizer, scaler and loaders; and each phase's CPU memory
    figure once measured (the same shapes every repeat, so one profiled step per variant and phase)."""

    config: RunConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loaders: dict[str, torch.utils.data.DataLoader]
    step_increase_mb: dict[str, float] = field(default_factory=dict)  # phase -> its profiled CPU step's peak


def build_state(config: RunConfig, info: DeviceInfo, train_set, test_set, seed: int) -> VariantState:
    """A fresh model of ``config.workload`` (same weights for every seed), its optimizer, scaler and loaders, as
    ``config`` asks."""
    workload = get_workload(config.workload)
    torch.manual_seed(seed)  # every variant starts from the same weights
    model = prepare_model(workload.build(config), config, info.device)
    train_set, test_set = workload.dataset_for(train_set, config), workload.dataset_for(test_set, config)
    if config.data_on_device:
        loaders = {phase: workload.device_loader(dataset, config.samples_per_step, info.device, phase == "train",
                                                 config.drop_last, seed)
                   for phase, dataset in (("train", train_set), ("test", test_set))}
    else:
        sampler = (RandomSampler(train_set, replacement=True, generator=torch.Generator().manual_seed(seed))
                   if workload.train_with_replacement else None)
        loaders = {
            "train": make_loader(train_set, config, train=True, seed=seed, sampler=sampler),
            "test": make_loader(test_set, config, train=False, seed=seed),
        }
    return VariantState(config, model, make_optimizer(model, config), make_scaler(config, info.device), loaders)
