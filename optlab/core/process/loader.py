"""A DataLoader with the run's loader knobs (workers, pinning, prefetching), for any workload's data set."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from . import shutdown
from ..knobs.config import RunConfig

WORKER_TIMEOUT_S = 300  # a stuck worker becomes an error instead of a hang


class SignalSafeLoader(DataLoader):
    """A DataLoader whose iterator, with its workers, is built whole: a signal that arrives while the workers start
    waits until they have (:func:`shutdown.held`), so that no half-built iterator is left for the clean-up; and whose
    workers end as soon as an error leaves the iterator (:class:`WorkersEndWithAnError`)."""

    def __iter__(self):  # noqa: ANN204  (DataLoader's own signature)
        with shutdown.held():
            batches = super().__iter__()
        return batches if self.num_workers == 0 else WorkersEndWithAnError(self, batches)


class WorkersEndWithAnError:
    """A worker loader's batches, whose workers are ended at once when an error comes out of them (a sample that
    raises, a signal). Left to the garbage collector, torch's iterator would end them much later: the error's
    traceback holds it in a reference cycle, and by the time the collector breaks the cycle, the queues that tell the
    workers to stop are closed, so it waits five seconds for each worker before killing it. Every other attribute is
    torch's iterator's."""

    def __init__(self, source: DataLoader, batches: Iterator) -> None:
        self._source, self._batches = source, batches

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batches, name)

    def __iter__(self) -> "WorkersEndWithAnError":
        return self

    def __len__(self) -> int:
        return len(self._batches)

    def __next__(self) -> Any:
        try:
            return next(self._batches)
        except StopIteration:
            raise
        except BaseException:
            self._batches._shutdown_workers()  # torch's own clean-up, the one its iterator's __del__ runs
            if self._source._iterator is self._batches:  # persistent workers: the next pass starts new ones
                self._source._iterator = None
            raise


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
