"""The reference run: every technique of a set, one stable JSON file per technique in one folder per machine."""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import Iterator

from . import microbench, store
from .device import resolve_device
from .errors import OptlabError, choice_error
from .experiments import REGISTRY, ExperimentResult, get_experiment, run_experiment


def technique_set(name: str) -> list[str]:
    """``seed``: the nine seed techniques; ``beyond``: the modern ones; ``all``: every registered technique."""
    from .techniques import BEYOND_TECHNIQUES, SEED_TECHNIQUES

    get_experiment(SEED_TECHNIQUES[0])  # fills the registry
    sets = {"seed": list(SEED_TECHNIQUES), "beyond": list(BEYOND_TECHNIQUES), "all": list(REGISTRY)}
    if name not in sets:
        raise choice_error("technique set", name, list(sets))
    return sets[name]


def run_reference(out: str | Path, set_name: str = "seed", profile: str | None = None, device: str = "auto",
                  progress: bool = True, download: bool = False) -> Iterator[ExperimentResult]:
    """Run every technique of the set, writing ``OUT/TECHNIQUE.json`` after each one.

    A technique that crashes is reported and the run goes on; the files of the others are kept.
    """
    folder = store.writable_dir(out)
    failures = []
    for name in technique_set(set_name):
        try:
            yield run_experiment(name, profile=profile, device=device, out=folder, progress=progress,
                                 download=download, filename=f"{name}.json")
        except OptlabError:
            raise
        except Exception:  # keep the other techniques' results; say what failed
            failures.append(name)
            traceback.print_exc()
    if resolve_device(device).is_cuda:
        microbench.run_reference(folder, device)
    if failures:
        raise OptlabError(f"these techniques failed and have no new results: {', '.join(failures)}")
