"""A DataLoader with the run's loader knobs (workers, pinning, prefetching), for any workload's data set."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from . import shutdown
from ..knobs.config import RunConfig

WORKER_TIMEOUT_S = 300  # a stuck worker becomes an error instead of a hang


class SignalSafeLoader(DataLoader):
    """A DataLoader whose iterator, with its workers, is built whole: a signal that arrives while the workers start
    waits until they have (:func:`shutdown.held`), so that no half-built iterator is left for the clean-up."""

    def __iter__(self):  # noqa: ANN204  (DataLoader's own signature)
        with shutdown.held():
            batches = super().__iter__()
        return batches


def make_loader(
    dataset: Dataset,
    config: RunConfig,
    train: bool,
    seed: int = 0,
    multiprocessing_context: str | None = None,
    sampler: Sampler | None = None,
) -> DataLoader:
    """A DataLoader with the config's knobs. The shuffle order depends only on ``seed`` (or on ``sampler``). Made
    within a run that handles the ending signals (:func:`shutdown.signals_interrupt`), its workers leave the clean-up
    to the run (:func:`shutdown.leave_to_the_run`)."""
    workers = config.num_workers > 0
    return SignalSafeLoader(
        dataset,
        batch_size=config.samples_per_step,
        shuffle=train if sampler is None else None,
        sampler=sampler,
        num_workers=config.num_workers,
        pin_memory=config.pin_memory,
        drop_last=config.drop_last,
        persistent_workers=config.persistent_workers,
        prefetch_factor=config.prefetch_factor if workers else None,
        timeout=WORKER_TIMEOUT_S if workers else 0,
        multiprocessing_context=multiprocessing_context if workers else None,
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=shutdown.leave_to_the_run if workers and shutdown.active() else None,
    )
