"""What a chapter prints: the active set-up in one line, and the code each technique switches."""
from __future__ import annotations

import inspect
import re

from ..core import data, loops, store, variants
from ..core.config import RunConfig, changed_knobs
from ..core.device import resolve_device
from ..core.registry import Experiment, get_experiment
from ..core.experiments import ExperimentResult, run_experiment
from ..core.profiles import Profile, get_profile

CODE_FUNCTIONS = (loops.make_optimizer, loops.backend_flags, loops.to_device, loops.train_step, loops.eval_step, loops.prepare_model, loops.make_scaler,
                  loops.train_phase, loops.eval_phase, data.make_loader, variants.build_state,
                  RunConfig.images_per_step.fget)


def setup_line(profile: "str | Profile | None" = None, device: str = "auto") -> str:
    """One line naming the profile and the device a chapter runs on."""
    info = resolve_device(device)
    return f"{get_profile(profile, info.is_cuda).describe()}\ndevice: {info.describe()}"


def knob_lines(knob: str) -> list[str]:
    """The lines of the code that runs (loops, loader, model set-up) that read ``config.<knob>``."""
    pattern = re.compile(rf"\b(config|self)\.{re.escape(knob)}\b")
    found = []
    for function in CODE_FUNCTIONS:
        lines, start = inspect.getsourcelines(function)
        module = function.__module__.replace(".", "/") + ".py"
        found += [f"{module}:{start + i} {function.__name__}: {line.strip()}" for i, line in enumerate(lines)
                  if pattern.search(line)]
    return found


def code_changes(experiment: "str | Experiment", model: str = "resnet18", profile: "str | Profile | None" = "smoke",
                 stacked: bool = False) -> str:
    """Each variant's knobs against the baseline (``stacked``: against the variant before it, for a cumulative
    stack), and the loop lines those knobs switch, read from the running code."""
    experiment = get_experiment(experiment)
    configs = experiment.configs(model, get_profile(profile))
    out = [f"baseline: {experiment.baseline_label}"]
    knobs: dict[str, None] = {}
    labels = list(configs)
    for before, label in zip(labels, labels[1:]):
        diff = changed_knobs(configs[before if stacked else experiment.baseline_label], configs[label])
        out.append(f"{label}: " + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()))
        knobs.update(dict.fromkeys(diff))
    for knob in knobs:
        lines = knob_lines(knob)
        out.append(f"\nthe lines that read config.{knob}:")
        out.extend(f"    {line}" for line in lines)
    return "\n".join(out)


def run(experiment: "str | Experiment", **options) -> ExperimentResult:
    """Run a chapter's comparison and keep its record in ``results/live/`` for the book's summary page."""
    experiment = get_experiment(experiment)
    return run_experiment(experiment, out=store.LIVE_DIR, filename=f"{experiment.name}.json", **options)
