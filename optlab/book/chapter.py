"""What a chapter calls: its set-up line, the code each technique switches, its run, and what it shows beside it."""
from __future__ import annotations

import ast
import html
import inspect
import os
import posixpath
import re
import textwrap
from dataclasses import dataclass

import pandas as pd

from ..core.cifar import data
from ..core.measuring import loops
from ..core.results import store
from ..core.run import variants
from ..core.knobs.config import RunConfig, changed_knobs
from ..core.machine.device import resolve_device
from ..core.techniques.registry import Experiment, get_experiment
from ..core.run.experiments import ExperimentResult, run_experiment
from ..core.knobs.profiles import Profile, get_profile
from ..core.workload import get_workload
from ..core.run.progress import BOOK_ENV
from . import report
from .downloads import Downloads, downloads
from .parameters import Setup, apply, workload_line

CODE_FUNCTIONS = (loops.make_optimizer, loops.backend_flags, loops.to_device, loops.train_step, loops.eval_step, loops.prepare_model, loops.make_scaler,
                  loops.train_pass, loops.eval_pass, data.make_loader, variants.build_state,
                  RunConfig.samples_per_step.fget)
SUMMARY_PAGE = "../book/summary.html"  # from a chapter's page (notebooks/NN.html)
SITE = "https://optlab.github.io/optlab/"  # the published book, for its pages that a notebook has no copy of
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")  # [text](url)


def use(models: "list[str] | None" = None, profile: str | None = None, batch_size: int | None = None,
        time_budget_s: float | None = None, page: str | None = None) -> Setup:
    """Apply chapter ``page``'s parameter cell (``page``: the notebook's stem; ``None``: any CNN comparison) to every
    run below it (a value ``None``: the page's default on this device): the models, sizes and budget the page runs, checked against what it can run, with
    its setup line (``print(setup)``) naming them and any value that has no effect there."""
    return apply(page, models, profile, batch_size, time_budget_s)


def setup_line(profile: "str | Profile | None" = None, device: str = "auto", workload: str = "cifar") -> str:
    """One line naming the profile (with the models and sizes ``workload`` runs under it, the reader's choice from
    :func:`use` applied) and the device a chapter runs on."""
    info = resolve_device(device)
    return f"{workload_line(get_profile(profile, info.is_cuda), workload)}\ndevice: {info.describe()}"


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


def model_knob_lines(knob: str, workload: str) -> list[str]:
    """The lines of ``workload``'s model builder whose statements (not its signature or docstring) pass its model
    knob ``knob`` on to the model it builds."""
    builder = get_workload(workload).build_model
    lines, start = inspect.getsourcelines(builder)
    function = ast.parse(textwrap.dedent("".join(lines))).body[0]
    first = function.body[1 if ast.get_docstring(function) else 0].lineno - 1
    module = builder.__module__.replace(".", "/") + ".py"
    pattern = re.compile(rf"\b{re.escape(knob)}\b")
    return [f"{module}:{start + i} {builder.__name__}: {line.strip()}" for i, line in enumerate(lines)
            if i >= first and pattern.search(line)]


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
    model_knobs = get_workload(experiment.workload).model_knobs
    for knob in knobs:
        lines = knob_lines(knob)
        if lines:
            out.append(f"\nthe lines that read config.{knob}:")
        elif knob in model_knobs:
            lines = model_knob_lines(knob, experiment.workload)
            out.append(f"\nconfig.{knob} is read inside the model: the {experiment.workload} workload builds the "
                       "model with it, in these lines:")
        else:
            out.append(f"\nno line of the training loop or the model's builder reads config.{knob}")
        out.extend(f"    {line}" for line in lines)
    return "\n".join(out)


def run(experiment: "str | Experiment", **options) -> ExperimentResult:
    """Run a chapter's comparison and keep its record in ``results/live/`` for the book's summary page."""
    experiment = get_experiment(experiment)
    return run_experiment(experiment, out=store.LIVE_DIR, filename=f"{experiment.name}.json", **options)


def page_href(link: str) -> str:
    """``link`` as written for a chapter's page in the built book; in a notebook opened from the checkout, a page of
    the book (``../book/summary.html``) is the published book's, since the checkout holds only its source."""
    if os.environ.get(BOOK_ENV) == "1" or "://" in link or not link.endswith(".html"):
        return link
    return SITE + posixpath.normpath(posixpath.join("notebooks", link))


@dataclass(frozen=True)
class Note:
    """One line for a page, with `code` and [links](url): HTML in a notebook, plain text anywhere else."""

    text: str

    def _repr_html_(self) -> str:
        line = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(self.text, quote=False))
        linked = LINK.sub(lambda match: f'<a href="{page_href(match[2])}">{match[1]}</a>', line)
        return f'<p class="optlab-note">{linked}</p>'

    def __repr__(self) -> str:
        return LINK.sub(r"\1", self.text)


@dataclass(frozen=True)
class Notes:
    """Several things shown as one output, one after the other."""

    parts: tuple["Note | Downloads", ...]

    def _repr_html_(self) -> str:
        return "".join(part._repr_html_() for part in self.parts)

    def __repr__(self) -> str:
        return "\n".join(map(repr, self.parts))


def built_on(result: ExperimentResult) -> Notes:
    """The line above a chapter's live results: the device that built the page, the stored GPU references of the
    technique (or that none exists yet), and a link to the summary, where every technique stands side by side; what
    the run measured and what that lets the rule tell (:func:`report.noise_line`); then the records behind the page,
    to download (:func:`downloads`)."""
    environment, name = result.record["environment"], result.experiment.name
    device = environment["gpu_name"] or f"{environment['device_name']} (CPU)"
    references = report.reference_summary(name)
    stored = (f"none yet ({report.reference_command(name)} on a GPU machine makes one)" if references is None
              else ", ".join(sorted(set(references["machine"]))))
    line = Note(f"Live numbers on this page: {device}, {result.record['profile']['name']} profile. Stored GPU "
                f"references of {name}: {stored}. Every technique side by side: [the summary]({SUMMARY_PAGE}).")
    return Notes((line, Note(report.noise_line(result.summary)), downloads(name, live=result.path)))


def speedups(result: ExperimentResult) -> pd.DataFrame:
    """A chapter's speed-ups for :func:`report.plot_speedups`: the live run, every stored reference, the seed's V100."""
    return report.speedups(result.experiment, result.summary)


def beside_references(result: ExperimentResult) -> "pd.DataFrame | Note":
    """A technique beyond the seed: the live numbers beside every stored reference machine's, or one line saying that
    there is none to set beside them yet."""
    if report.reference_summary(result.experiment.name) is None:
        return Note("Nothing to set beside the live numbers yet: no GPU machine has a stored reference of "
                    f"{result.experiment.name} (see the line above the live results).")
    return report.reference_comparison(result.experiment.name, live=result.summary)
