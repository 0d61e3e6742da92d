"""Run sizes: ``smoke`` for CPU CI, ``quick`` for a GPU, ``full`` for the seed's protocol; ``auto`` picks one."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .errors import choice_error
from .limits import MAX_REPEATS, MAX_STEPS, check_count

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
    repeats: int  # timed repeats per variant, interleaved, the order rotating from repeat to repeat
    warmup_repeats: int = 0  # whole repeats run first and discarded (the seed's excluded first epoch)
    num_workers: int = 4  # the seed's base DataLoader workers; techniques that study workers set their own

    def __post_init__(self) -> None:
        check_count("warm-up steps", self.warmup_steps, 0, MAX_STEPS, "steps per repeat")
        for name, steps in (("steps", self.steps), ("test steps", self.test_steps)):
            if steps is not None:
                check_count(name, steps, 1, MAX_STEPS, "timed steps per repeat")
        check_count("repeats", self.repeats, 1, MAX_REPEATS, "a paired interval hardly narrows past that")
        check_count("warm-up repeats", self.warmup_repeats, 0, MAX_REPEATS, "discarded repeats")
        check_count("batch size", self.batch_size, 1, MAX_STEPS, "images per batch")

    def with_sizes(self, steps: int | None = None, repeats: int | None = None) -> "Profile":
        """A copy with other timed steps (train and test) or repeats, as a user typed them; checked like any profile."""
        changes = {"steps": steps, "test_steps": steps, "repeats": repeats}
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def describe(self, models: "tuple[str, ...] | None" = None) -> str:
        """One line: the profile's name and sizes, with the ``models`` a run actually uses."""
        steps = "whole epochs" if self.steps is None else f"{self.warmup_steps} warm-up + {self.steps} timed steps"
        return (
            f"profile {self.name}: models {', '.join(models or self.models)}; batch {self.batch_size}; width {self.width}; "
            f"{self.num_workers} workers; "
            f"{steps}; {self.repeats} repeats" + (f" after {self.warmup_repeats} discarded" if self.warmup_repeats else "")
        )


ALL_MODELS = ("resnet18", "resnet50", "resnet101", "mobilenet_v2")
PROFILES = {
    # smoke: two models at 1/8 width on few steps, data loaded in the main process (2-core CI machines)
    # A paired t interval over n repeats uses t(n-1) at 99.5 %: 14.1 for n = 3, 7.45 for n = 4, 5.60 for n = 5. A busy
    # CPU's noise needs five repeats; a GPU's is small enough for four, which keeps the seed set within 9 minutes.
    "smoke": Profile("smoke", ("resnet18", "mobilenet_v2"), batch_size=16, width=0.125, warmup_steps=1, steps=2,
                     test_steps=2, repeats=5, num_workers=0),
    "quick": Profile("quick", ALL_MODELS, batch_size=128, width=1.0, warmup_steps=3, steps=10, test_steps=6, repeats=4),
    "full": Profile("full", ALL_MODELS, batch_size=128, width=1.0, warmup_steps=0, steps=None, test_steps=None,
                    repeats=4, warmup_repeats=1),
}
PROFILE_CHOICES = ("auto",) + tuple(PROFILES)


def get_profile(name: "str | Profile | None" = None, cuda: bool = False) -> Profile:
    """The profile ``name``, else ``$OPTLAB_PROFILE``, else ``auto``: ``quick`` on CUDA and ``smoke`` on the CPU.

    A :class:`~optlab.core.profiles.Profile` object is returned as it is (custom sizes for tests and chapters)."""
    if isinstance(name, Profile):
        return name
    chosen = name or os.environ.get(PROFILE_ENV) or "auto"
    if chosen == "auto":
        chosen = "quick" if cuda else "smoke"
    if chosen not in PROFILES:
        raise choice_error("profile", chosen, PROFILE_CHOICES)
    return PROFILES[chosen]
