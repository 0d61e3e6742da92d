"""optlab: measured PyTorch training and inference speed-ups, from the seed article to modern GPUs.

Four layers, imports running downward only:

- ``optlab.core``: the measurement core every measurement goes through (knobs, device, data, models, loops,
  timing, the registry, running an experiment, statistics, the store);
- ``optlab.studies``: each chapter's own measurement, built on the core;
- ``optlab.book``: tables, plots and the helpers a chapter calls;
- ``optlab.commands``: the entry points (``python -m optlab``, the reference run).
"""
from .core.knobs.config import RunConfig, changed_knobs
from .core.machine.device import resolve_device
from .core.machine.environment import capture as capture_environment, report as environment_report
from .core.errors import OptlabError
from .core.run.experiments import ExperimentResult, run_experiment
from .core.techniques.registry import Experiment, get_experiment, list_experiments
from .core.knobs.profiles import get_profile
from .core.results.store import load_record, load_samples, load_summaries
from .core.workload import Workload, get_workload, register_workload
from .studies.tune import InferenceResult, TuneResult, tune
from .studies.limits.ceilings import measure as ceilings

__all__ = [
    "Experiment", "ExperimentResult", "InferenceResult", "OptlabError", "RunConfig", "TuneResult",
    "capture_environment", "ceilings", "changed_knobs", "environment_report", "get_experiment", "get_profile",
    "list_experiments", "load_record", "load_samples", "load_summaries", "register_workload", "resolve_device",
    "run_experiment", "tune", "Workload", "get_workload", "parallel_plan",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``optlab.parallel_plan``, imported on first use: the parallel studies' package imports FSDP2 and DTensor
    (0.7 s of every process's start), which most processes never touch."""
    if name == "parallel_plan":
        from .studies.parallel.planner import parallel_plan

        return parallel_plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
