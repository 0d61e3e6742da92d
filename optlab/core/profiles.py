"""Run sizes: ``smoke`` for CPU CI, ``quick`` for a GPU, ``full`` for the seed's protocol; ``auto`` picks one."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import choice_error

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
    repeats: int  # timed repeats per variant, interleaved A B A B
    warmup_repeats: int = 0  # whole repeats run first and discarded (the seed's excluded first epoch)
    num_workers: int = 4  # the seed's base DataLoader workers; techniques that study workers set their own

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
    "smoke": Profile("smoke", ("resnet18", "mobilenet_v2"), batch_size=16, width=0.125, warmup_steps=1, steps=3,
                     test_steps=3, repeats=3, num_workers=0),
    "quick": Profile("quick", ALL_MODELS, batch_size=128, width=1.0, warmup_steps=8, steps=20, test_steps=12, repeats=3),
    "full": Profile("full", ALL_MODELS, batch_size=128, width=1.0, warmup_steps=0, steps=None, test_steps=None,
                    repeats=4, warmup_repeats=1),
}
PROFILE_CHOICES = ("auto",) + tuple(PROFILES)


def get_profile(name: "str | Profile | None" = None, cuda: bool = False) -> Profile:
    """The profile ``name``, else ``$OPTLAB_PROFILE``, else ``auto``: ``quick`` on CUDA and ``smoke`` on the CPU.

    A :class:`Profile` object is returned as it is (custom sizes for tests and chapters)."""
    if isinstance(name, Profile):
        return name
    chosen = name or os.environ.get(PROFILE_ENV) or "auto"
    if chosen == "auto":
        chosen = "quick" if cuda else "smoke"
    if chosen not in PROFILES:
        raise choice_error("profile", chosen, PROFILE_CHOICES)
    return PROFILES[chosen]
