"""The registry of techniques: an :class:`Experiment` is a baseline and its labelled variants, as data.

``techniques`` fills the registry (importing :mod:`optlab.core` does it); ``experiments`` and everything above read
it. This module imports nothing of the measurement itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd

from ..knobs.config import PHASE_KNOBS, RunConfig, apply_changes, changed_knobs
from ..errors import OptlabError, choice_error
from ..knobs.profiles import Profile, chosen_sizes
from ..workload import get_workload

PHASES = ("train", "test")


@dataclass(frozen=True)
class Experiment:
    """One technique: shared knobs, then labelled variants whose first entry is the baseline."""

    name: str
    title: str
    section: str  # the seed article's section, "" for techniques beyond the seed
    variants: tuple[tuple[str, dict[str, Any]], ...]  # (label, knob changes)
    phases: tuple[str, ...] = PHASES
    base: dict[str, Any] = field(default_factory=dict)  # knob changes shared by every variant
    description: str = ""
    needs_cuda: bool = False  # meaningless without a GPU: refused on the CPU instead of pretending
    models: tuple[str, ...] | None = None  # the profile's models to run by default (None: all of them)
    variant_models: dict[str, tuple[str, ...]] = field(default_factory=dict)  # label -> the only models it runs on
    isolate_variants: bool = False  # each variant in a fresh process of its own (state that lives per process)
    references: dict[str, str] = field(default_factory=dict)  # label -> the variant it is compared with (baseline)
    workload: str = "cifar"  # what it trains (workload.WORKLOADS)

    def __post_init__(self) -> None:
        get_workload(self.workload)
        if len(self.variants) < 2:
            raise OptlabError(f"experiment {self.name!r} needs a baseline and at least one variant")
        bad = set(self.phases) - set(PHASES)
        if bad:
            raise choice_error("phase", sorted(bad)[0], PHASES)
        for label, reference in self.references.items():
            if label not in self.labels or reference not in self.labels or label == reference:
                raise OptlabError(f"experiment {self.name!r}: {label!r} cannot be compared with {reference!r}; "
                                  f"both must be two of its variants: {', '.join(self.labels)}")

    @property
    def labels(self) -> list[str]:
        return [label for label, _ in self.variants]

    @property
    def baseline_label(self) -> str:
        return self.variants[0][0]

    def reference_of(self, label: str) -> str:
        """The variant ``label`` is compared with: its own reference where the entry names one, else the baseline."""
        return self.references.get(label, self.baseline_label)

    @property
    def comparisons(self) -> dict[str, str]:
        """Every variant but the baseline, mapped to the variant it is compared with."""
        return {label: self.reference_of(label) for label in self.labels[1:]}

    @property
    def control_phases(self) -> tuple[str, ...]:
        """The timed phases that no variant's knobs reach (the evaluation loop of a technique that changes only the
        optimizer step): there the variants run the same code, so the comparison is an A/A control, not a claim."""
        first = RunConfig(workload=self.workload, model=get_workload(self.workload).model_names[0])
        configs = [apply_changes(apply_changes(first, self.base), changes) for _, changes in self.variants]
        changed = {knob for config in configs[1:] for knob in changed_knobs(configs[0], config)}
        return tuple(phase for phase in self.phases if not changed & PHASE_KNOBS[phase])

    def default_models(self, profile: Profile) -> tuple[str, ...]:
        """The models a run uses when none are given: the profile's that belong to this technique's workload,
        narrowed to the technique's own if it has any (compiling every model would take a GPU reference run past its
        time budget); a workload none of the profile's models belong to runs the models it names for the profile, else
        its first model."""
        workload = get_workload(self.workload)
        names = workload.model_names
        ours = (tuple(m for m in profile.models if m in names) or workload.profile_models.get(profile.name)
                or names[:1])
        chosen = tuple(m for m in ours if self.models is None or m in self.models)
        return chosen or ours

    def configs(self, model: str, profile: Profile, overrides: dict[str, Any] | None = None) -> dict[str, RunConfig]:
        """The requested config of every variant for ``model`` under ``profile`` and user ``overrides``."""
        common = RunConfig(workload=self.workload, model=model, batch_size=profile.batch_size, width=profile.width,
                           num_workers=profile.num_workers)
        sized = get_workload(self.workload).profile_knobs.get(profile.name, {})  # a workload's own sizes per profile
        sized = {**sized, **chosen_sizes()}  # the reader's, from a chapter's parameter cell, win
        common = apply_changes(apply_changes(apply_changes(common, sized), self.base), overrides or {})
        return {label: apply_changes(common, changes) for label, changes in self.variants
                if model in self.variant_models.get(label, (model,))}

    def with_variants(self, *variants: tuple[str, dict[str, Any]], name: str | None = None,
                      references: dict[str, str] | None = None) -> "Experiment":
        """A copy with other variants (a chapter's own comparison), keeping everything else; the references kept are
        those whose two variants are both still there, unless ``references`` are given."""
        labels = {label for label, _ in variants}
        kept = {k: v for k, v in self.references.items() if k in labels and v in labels}
        return replace(self, name=name or self.name, variants=tuple(variants),
                       references=kept if references is None else references)

    def for_phases(self, *phases: str) -> "Experiment":
        """A copy that times only ``phases`` (a CPU chapter that cannot afford every phase)."""
        return replace(self, phases=tuple(phases))

    def with_base(self, **changes: Any) -> "Experiment":
        """A copy whose every variant also takes ``changes`` (a chapter's own precision on a device)."""
        return replace(self, base={**self.base, **changes})


def chained(labels: "list[str] | tuple[str, ...]") -> dict[str, str]:
    """A stack's references: every step compared with the step before it, so that the rule waits for each step's own
    effect (the first step's reference is the baseline)."""
    return dict(zip(labels[1:], labels))


REGISTRY: dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    """Add ``experiment`` to the registry under its name (``techniques`` does this for every entry)."""
    REGISTRY[experiment.name] = experiment
    return experiment


def get_experiment(name: str | Experiment) -> Experiment:
    """The registered technique ``name`` (an :class:`Experiment` is returned as it is)."""
    if isinstance(name, Experiment):
        return name
    if name not in REGISTRY:
        raise choice_error("technique", name, list(REGISTRY))
    return REGISTRY[name]


def list_experiments() -> pd.DataFrame:
    """Every registered technique with its seed section, timed phases and variants."""
    return pd.DataFrame(
        [
            {"technique": e.name, "section": e.section or "beyond", "title": e.title, "timed": "+".join(e.phases),
             "device": "cuda" if e.needs_cuda else "any", "variants": " | ".join(e.labels)}
            for e in REGISTRY.values()
        ]
    )
