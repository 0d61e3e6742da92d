"""The reference run: every technique of a set, one stable JSON file per technique in one folder per machine,
then the set's extra tables (sweeps, micro-benchmarks, profiles) on a GPU."""
from __future__ import annotations

import importlib
import traceback
from pathlib import Path
from typing import Iterator

from . import store
from .device import resolve_device
from .errors import OptlabError, choice_error
from .experiments import REGISTRY, ExperimentResult, get_experiment, run_experiment

# The extra tables of each set: modules whose ``run_reference(out, device)`` measures and saves them (CUDA only).
EXTRAS = {
    "seed": ("microbench",),
    "beyond": ("numerics", "tf32", "optimizer_bench", "cuda_graphs", "pipeline"),
    "compile": (),
    "stack": ("profiling", "learning"),  # profiling's "after" configuration compiles
}
SET_NAMES = ("seed", "beyond", "compile", "stack", "all")


def technique_set(name: str) -> list[str]:
    """``seed``: the nine seed techniques; ``beyond``: the modern ones that do not compile; ``compile``: torch.compile
    and CUDA graphs; ``stack``: all of them together (each compiling set kept apart so that every set stays a short
    run); ``all``: every one."""
    from .techniques import BEYOND_TECHNIQUES, COMPILING_TECHNIQUES, SEED_TECHNIQUES

    get_experiment(SEED_TECHNIQUES[0])  # fills the registry
    sets = {"seed": list(SEED_TECHNIQUES), "compile": list(COMPILING_TECHNIQUES), "stack": ["all_together"],
            "beyond": [t for t in BEYOND_TECHNIQUES if t not in COMPILING_TECHNIQUES + ("all_together",)],
            "all": list(REGISTRY)}
    if name not in sets:
        raise choice_error("technique set", name, SET_NAMES)
    return sets[name]


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
                for path in importlib.import_module(f"optlab.{module}").run_reference(folder, device):
                    print(f"wrote {path}")
            except Exception:
                failures.append(f"{module} (extra tables)")
                traceback.print_exc()
    if failures:
        raise OptlabError(f"these parts failed and have no new results: {', '.join(failures)}")
