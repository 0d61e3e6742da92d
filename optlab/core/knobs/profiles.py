"""Run sizes: ``smoke`` for CPU CI, ``quick`` for a GPU, ``full`` for the seed's protocol; ``auto`` picks one."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Iterable

from ..errors import OptlabError, choice_error
from .limits import MAX_REPEATS, MAX_STEPS, MAX_TIME_BUDGET_S, check_count

PROFILE_ENV = "OPTLAB_PROFILE"


@dataclass(frozen=True)
class Profile:
    """How much to run. ``steps=None`` means whole epochs."""

    name: str
    models: tuple[str, ...]
    batch_size: int
    width: float
    warmup_steps: int  # untimed steps at the start of every repeat (after the loader's start-up is timed)
    steps: int | None  # timed training steps per repeat; None: the whole epoch
    test_steps: int | None
    repeats: int  # the minimum of timed repeats (rounds) per variant, interleaved in a counterbalanced order
    max_repeats: int | None = None  # more rounds, in pairs, while any answer is unclear, up to this cap (None: repeats)
    time_budget_s: float = math.inf  # no new pair of rounds once one model's comparison would pass this many seconds
    warmup_repeats: int = 0  # whole repeats run first and discarded (the seed's excluded first epoch)
    num_workers: int = 4  # the seed's base DataLoader workers; techniques that study workers set their own
    lockstep_steps: int | None = None  # CPU: timed steps per variant where a round's variants alternate step by step

    def __post_init__(self) -> None:
        check_count("warm-up steps", self.warmup_steps, 0, MAX_STEPS, "steps per repeat")
        for name, steps in (("steps", self.steps), ("test steps", self.test_steps)):
            if steps is not None:
                check_count(name, steps, 1, MAX_STEPS, "timed steps per repeat")
        if self.lockstep_steps is not None:
            check_count("lockstep steps", self.lockstep_steps, 1, MAX_STEPS, "timed steps per variant in a round")
        check_count("repeats", self.repeats, 2, MAX_REPEATS, "a paired interval needs two and hardly narrows past that")
        if self.max_repeats is None:
            object.__setattr__(self, "max_repeats", self.repeats)
        check_count("maximum repeats", self.max_repeats, self.repeats, MAX_REPEATS,
                    f"at least the minimum of {self.repeats} repeats")
        if not (0 < self.time_budget_s <= MAX_TIME_BUDGET_S or math.isinf(self.time_budget_s)):
            raise OptlabError(f"time budget must be between 0 and {MAX_TIME_BUDGET_S:,} seconds (a day) a model, "
                              f"got {self.time_budget_s}")
        check_count("warm-up repeats", self.warmup_repeats, 0, MAX_REPEATS, "discarded repeats")
        check_count("batch size", self.batch_size, 1, MAX_STEPS, "images per batch")

    def with_sizes(self, steps: int | None = None, repeats: int | None = None, max_repeats: int | None = None,
                   time_budget_s: float | None = None) -> "Profile":
        """A copy with other timed steps (train and test, and a lockstep round's), minimum or maximum repeats or time
        budget, as a user typed them; checked like any profile. A minimum above the profile's cap raises the cap with
        it."""
        lockstep = steps if self.lockstep_steps is not None else None
        changes = {"steps": steps, "test_steps": steps, "lockstep_steps": lockstep, "repeats": repeats,
                   "max_repeats": max_repeats, "time_budget_s": time_budget_s}
        changes = {k: v for k, v in changes.items() if v is not None}
        if repeats is not None and max_repeats is None:
            changes["max_repeats"] = max(repeats, self.max_repeats or repeats)
        return replace(self, **changes)

    def describe_repeats(self) -> str:
        """How many repeats: "4 repeats", or "4-48 repeats (more while an answer is unclear, 150 s a model)"."""
        if self.max_repeats == self.repeats:
            return f"{self.repeats} repeats"
        budget = "" if math.isinf(self.time_budget_s) else f", at most {self.time_budget_s:g} s a model"
        return f"{self.repeats}-{self.max_repeats} repeats (more while an answer is unclear{budget})"

    def describe(self, models: "tuple[str, ...] | None" = None, sizes: "dict | None" = None) -> str:
        """One line: the profile's name and sizes, with the ``models`` a run actually uses and the ``sizes`` (batch
        size, width, workers) its workload sets for this profile or the user typed."""
        steps = ("whole epochs" if self.steps is None
                 else f"{self.warmup_steps} warm-up + {self.steps} timed step{'s' if self.steps != 1 else ''}")
        if self.lockstep_steps is not None:
            steps = (f"{self.lockstep_steps} timed steps a variant in lockstep rounds, after {self.warmup_steps} "
                     f"warm-up in the first ({steps} where a variant needs a pass of its own)")
        sizes = sizes or {}
        return (
            f"profile {self.name}: models {', '.join(models or self.models)}; "
            f"batch {sizes.get('batch_size', self.batch_size)}; "
            f"width {sizes.get('width', self.width)}; "
            f"{sizes.get('num_workers', self.num_workers)} workers; "
            f"{steps}; {self.describe_repeats()}"
            + (f" after {self.warmup_repeats} discarded" if self.warmup_repeats else "")
        )


ALL_MODELS = ("resnet18", "resnet50", "resnet101", "mobilenet_v2")
PROFILES = {
    # At least 4 repeats, then pairs of rounds while an answer is unclear, until the time budget (a model's share of a
    # CI notebook's time in smoke, of a reference part's in quick) or the hard cap (96 in smoke, 48 in quick): the
    # budget, not the cap, ends a cheap comparison (tests/test_sequential.py checks the error rates for any budget).
    # On a fast 2-core machine a round of the bench's live power check (ResNet18 training, two variants) takes about
    # 0.2 s, and a cap of 48 ended it after about 8 s of its 12.
    # Smoke times 1 step a round after 1 warm-up step where each variant runs a pass of its own (loader workers,
    # compiled code, separate processes). Elsewhere on a CPU its rounds run in lockstep (experiments.lockstep_round):
    # the variants take turns step by step, 3 timed steps each (one warm-up step each in a model's first round only:
    # one in every round cost a quarter of the round and did not lower the noise). The machine's speed
    # drifts within a second, and the steps of one pass share that drift, so a pass's second and third steps hardly
    # lower its noise; alternating steps spreads the drift over every variant alike. On a 2-core machine whose A/A
    # ResNet18 round noise was 10 % (training) and 14 % (test) with a pass of 1 + 1 steps (0.25 s a round), lockstep
    # rounds of 1 + 3 had 5.2 % and 6.4 % (0.41 s a round): two to three times as much told per second
    # (rounds / noise^2; benchmarks/noise.py, 5 runs of 16 rounds each).
    # smoke: two models at 1/8 width on few steps, data loaded in the main process (2-core CI machines)
    "smoke": Profile("smoke", ("resnet18", "mobilenet_v2"), batch_size=16, width=0.125, warmup_steps=1, steps=1,
                     test_steps=1, repeats=4, max_repeats=96, time_budget_s=12.0, num_workers=0,
                     lockstep_steps=3),
    "quick": Profile("quick", ALL_MODELS, batch_size=128, width=1.0, warmup_steps=3, steps=10, test_steps=6, repeats=4,
                     max_repeats=48, time_budget_s=150.0),
    "full": Profile("full", ALL_MODELS, batch_size=128, width=1.0, warmup_steps=0, steps=None, test_steps=None,
                    repeats=4, max_repeats=8, warmup_repeats=1),
}
PROFILE_CHOICES = ("auto",) + tuple(PROFILES)


@dataclass(frozen=True)
class Choice:
    """What a reader set in a chapter's parameter cell; ``None``: the device's default."""

    profile: str | None = None
    models: tuple[str, ...] | None = None
    batch_size: int | None = None
    time_budget_s: float | None = None


_choice = Choice()


def choose(profile: str | None = None, models: "Iterable[str] | None" = None, batch_size: int | None = None,
           time_budget_s: float | None = None) -> Choice:
    """Set the reader's choice for this process: every later :func:`optlab.get_profile` without a name, and every run's
    configs (``chosen_sizes``), use it. All ``None`` restores the defaults. Checked like a typed profile."""
    global _choice
    if profile is not None and profile not in PROFILE_CHOICES:
        raise choice_error("profile", profile, PROFILE_CHOICES)
    if isinstance(models, str):
        raise OptlabError(f"models must be a list of model names, got the string {models!r}: write [{models!r}]")
    choice = Choice(profile, tuple(models) if models is not None else None, batch_size, time_budget_s)
    _apply(choice, PROFILES["smoke"])  # a bad batch size or budget is told now, not at the first run
    _choice = choice
    return choice


def choice() -> Choice:
    """The reader's choice now in force (:func:`~optlab.core.knobs.profiles.choose`)."""
    return _choice


def chosen_sizes() -> dict[str, int]:
    """The sizes the reader chose that win over a workload's own per profile: ``{"batch_size": n}`` or nothing."""
    return {} if _choice.batch_size is None else {"batch_size": _choice.batch_size}


def _apply(choice: Choice, profile: Profile) -> Profile:
    changes = {"models": choice.models, "batch_size": choice.batch_size, "time_budget_s": choice.time_budget_s}
    return replace(profile, **{k: v for k, v in changes.items() if v is not None})


def get_profile(name: "str | Profile | None" = None, cuda: bool = False) -> Profile:
    """The profile ``name``, else the reader's (:func:`~optlab.core.knobs.profiles.choose`), else
    ``$OPTLAB_PROFILE``, else ``auto``: ``quick`` on CUDA and ``smoke`` on the CPU. Without a name, the reader's models, batch size and time budget apply too.

    A :class:`~optlab.core.knobs.profiles.Profile` object is returned as it is (custom sizes for tests and chapters)."""
    if isinstance(name, Profile):
        return name
    if name is None:
        return _apply(_choice, get_profile(_choice.profile or os.environ.get(PROFILE_ENV) or "auto", cuda))
    chosen = name
    if chosen == "auto":
        chosen = "quick" if cuda else "smoke"
    if chosen not in PROFILES:
        raise choice_error("profile", chosen, PROFILE_CHOICES)
    return PROFILES[chosen]
