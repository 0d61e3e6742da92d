"""Comparisons that cannot differ on this device: named, not timed.

A variant whose knobs all fall back to its reference's on this device (pinned memory and ``non_blocking`` on a
CPU, ``cudnn.benchmark`` without cuDNN, TF32 without tensor cores) would run the reference's code again: its
comparison is an A/A that costs a chapter's time and can only say "can't tell yet". Such a variant is not run; its
rows carry the status "no effect on this device" with the reason. A variant that asks for the same knobs as its
reference (an A/A control meant as one) is timed as always.
"""
from __future__ import annotations

import re
from typing import Any

from ..knobs.config import RunConfig, changed_knobs

NO_EFFECT = "no effect on this device"
_SKIPPED_NOTE = re.compile(r"^(?P<knobs>[\w/]+): skipped on \w+ \((?P<reason>.*)\)$")


def is_no_effect(status: object) -> bool:
    """Whether a verdict or sample status says "no effect on this device"."""
    return isinstance(status, str) and status.startswith(NO_EFFECT)


def reason(knobs: "set[str] | dict[str, Any]", notes: list[str]) -> str:
    """Why ``knobs`` fall back on this device, from the device's notes (``device.effective_config``): "knob: why"
    for every note that names one of them."""
    reasons = []
    for note in notes:
        match = _SKIPPED_NOTE.match(note)
        if match and set(match["knobs"].split("/")) & set(knobs):
            reasons.append(f"{match['knobs']}: {match['reason']}")
    return "; ".join(reasons) or f"{', '.join(sorted(knobs))} run as the reference's on this device"


def no_effect_variants(requested: dict[str, RunConfig], effective: dict[str, tuple[RunConfig, list[str]]],
                       comparisons: dict[str, str]) -> dict[str, str]:
    """The variants (of one model) not to time, each with its status: "no effect on this device (reason)".

    A variant qualifies when it asks for other knobs than its reference (``comparisons``: variant -> reference) and
    runs the same config on this device. One that a timed variant is compared with is timed all the same."""
    found = {}
    for label, reference in comparisons.items():
        if label not in requested or reference not in requested:
            continue
        knobs = changed_knobs(requested[reference], requested[label])
        if knobs and effective[label][0] == effective[reference][0]:
            found[label] = f"{NO_EFFECT} ({reason(knobs, effective[label][1])})"
    needed = True
    while needed:  # a timed variant's reference is timed too
        needed = {ref for label, ref in comparisons.items() if label in requested and label not in found} & set(found)
        for label in needed:
            del found[label]
    return found
