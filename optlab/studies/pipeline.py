"""The data pipeline chapter's pieces: its experiment sized to a machine's cores, and its starvation profile."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..core.results import store
from ..core.machine.device import resolve_device
from ..core.errors import OptlabError
from ..core.techniques.registry import Experiment, get_experiment
from ..core.knobs.profiles import Profile, get_profile
from .profiling import breakdown_table, profile_configs

TABLE = "data-pipeline-breakdown"


def with_workers(experiment: Experiment, workers: int) -> Experiment:
    """A copy of ``experiment`` whose variants that set loader workers use ``workers`` of them, relabelled to say so
    (for a machine with fewer cores than the registry's worker count)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise OptlabError(f"workers must be an integer >= 1, got {workers!r}")
    variants = []
    for label, changes in experiment.variants:
        old = changes.get("num_workers", 0)
        if old > 0:
            named = f"{old} " in label
            label = label.replace(f"{old} ", f"{workers} ", 1) if named else f"{label} ({workers} workers)"
            changes = {**changes, "num_workers": workers}
        variants.append((label, changes))
    return experiment.with_variants(*variants)


def starvation(experiment: Experiment, model: str = "resnet18", device: str = "auto",
               profile: str | Profile | None = None) -> pd.DataFrame:
    """One profiled breakdown row per variant of ``experiment`` for ``model`` at ``profile``'s size (default: the
    active profile of this device)."""
    sized = get_profile(profile, resolve_device(device).is_cuda)
    return breakdown_table(profile_configs(experiment.configs(model, sized), device))


def run_reference(out: str | Path, device: str = "cuda") -> list[Path]:
    """The GPU reference: the breakdown of every ``data_pipeline`` variant (ResNet18, quick size), saved as
    ``data-pipeline-breakdown.csv`` under ``out``."""
    frame = starvation(get_experiment("data_pipeline"), "resnet18", device, "quick")
    return [store.save_table(frame, out, TABLE)]
