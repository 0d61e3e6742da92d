"""optlab: measured PyTorch training and inference speed-ups, from the seed article to modern GPUs."""
from .config import RunConfig, changed_knobs
from .device import resolve_device
from .environment import capture as capture_environment, report as environment_report
from .errors import OptlabError
from .experiments import Experiment, ExperimentResult, get_experiment, list_experiments, run_experiment
from .profiles import get_profile
from .store import load_record, load_samples, load_summaries

__all__ = [
    "Experiment", "ExperimentResult", "OptlabError", "RunConfig", "capture_environment", "changed_knobs",
    "environment_report", "get_experiment", "get_profile", "list_experiments", "load_record", "load_samples",
    "load_summaries", "resolve_device", "run_experiment",
]
__version__ = "0.1.0"
