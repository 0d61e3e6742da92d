"""The reference run: every technique of a set, one stable JSON file per technique in one folder per machine,
then the set's extra tables (sweeps, micro-benchmarks, profiles) on a GPU."""
from __future__ import annotations

import importlib
import traceback
from pathlib import Path
from typing import Iterator

from ..core import store
from ..core.device import resolve_device
from ..core.errors import OptlabError
from ..core.experiments import ExperimentResult, run_experiment
from ..core.techniques import technique_set

# The extra tables of each set: modules whose ``run_reference(out, device)`` measures and saves them (CUDA only).
EXTRAS = {
    "seed": ("microbench",),
    "beyond": ("numerics", "tf32", "optimizer_bench", "cuda_graphs", "pipeline"),
    "compile": (),
    "stack": ("profiling", "learning"),  # profiling's "after" configuration compiles
}
def extras(set_name: str) -> list[str]:
    """The modules whose extra tables belong to ``set_name`` (``all``: every set's)."""
    if set_name == "all":
        return [module for modules in EXTRAS.values() for module in modules]
    return list(EXTRAS.get(set_name, ()))


def run_reference(out: str | Path, set_name: str = "seed", profile: str | None = None, device: str = "auto",
                  progress: bool = True, download: bool = False) -> Iterator[ExperimentResult]:
    """Run every technique of the set, writing ``OUT/TECHNIQUE.json`` after each one, then the set's extras.

    A technique or extra that crashes is reported and the run goes on; the files of the others are kept.
    """
    names = technique_set(set_name)
    folder = store.writable_dir(out)
    failures = []
    for name in names:
        try:
            yield run_experiment(name, profile=profile, device=device, out=folder, progress=progress,
                                 download=download, filename=f"{name}.json")
        except OptlabError:
            raise
        except Exception:  # keep the other techniques' results; say what failed
            failures.append(name)
            traceback.print_exc()
    if resolve_device(device).is_cuda:
        for module in extras(set_name):
            try:
                for path in importlib.import_module(f"optlab.studies.{module}").run_reference(folder, device):
                    print(f"wrote {path}")
            except Exception:
                failures.append(f"{module} (extra tables)")
                traceback.print_exc()
    if failures:
        raise OptlabError(f"these parts failed and have no new results: {', '.join(failures)}")
