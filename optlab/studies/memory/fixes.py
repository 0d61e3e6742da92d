"""The fixes for a training step's memory, each measured against the breakdown of the same step.

A *setting* is one way to train the same model on the same batch: ``zero_grad(set_to_none=...)``, activation
checkpointing (the book's GPT has the knob), 16-bit autocast, AdamW's implementation (for-loop, foreach, fused) and
gradient accumulation (the same effective batch in micro-batches). A *fix* is a pair of settings, before and after,
with the category of the breakdown it should move: set_to_none frees the gradients before the next forward,
checkpointing drops the activations a block keeps, autocast stores many activations in 16 bits (but keeps a 16-bit
copy of each weight it casts for the backward, and the norms, softmax and loss in fp32), the optimizer's
implementation changes its step's temporaries, accumulation shrinks the activations to a micro-batch's. The
activation fixes are read at the forward's end, where they act (what the backward will need): at the peak a
checkpointed block's recomputation is under way and its tensors are counted there too; the peak is beside each.

Each setting's breakdown comes from ``breakdown.step_breakdown`` (with MemTracker's independent count of its peak,
``tracker.tracked_peak``); each fix's time cost from the same settings timed in mirrored rounds
(``optlab.core.stats.sequential.visit_order``) and read by ``optlab.core.measuring.timing.speed_up``: the speed-up of
the fix over its before, with its interval and one of the four verdicts. ``summary_rows`` reads the fixes' stored
tables back for the summary page.

On a GPU three more answers: the allocator's reserved memory against the allocated with and without
``expandable_segments`` (in a fresh process each: the allocator reads its setting once, at start), the largest batch
each setting fits, and the share of parameters, gradients and optimizer state one rank keeps under FSDP2 (which a
fake process group also measures on a CPU).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from ...core.knobs.config import CHECKPOINTINGS
from ...core.errors import OptlabError, choice_error
from ...core.gpt import build_gpt
from ...core.knobs.limits import check_count
from ...core.cifar.models import build_model
from ...core.knobs.profiles import get_profile
from ...core.process.children import child_environment
from ...core.process.quiet import fix_threads
from ...core.stats.sequential import visit_order
from ...core.measuring.timing import interval_text, speed_up, too_wide_to_tell
from ...core.results import store
from ...core.workload import get_workload
from ..distributed.shard_scaling import fake_rank_bytes
from ..distributed.sharding import Workload as ShardWorkload
from ..transformer.largest_batch import fits_in_memory, free_memory, largest_fitting
from .breakdown import SUM_RTOL, Breakdown, step_breakdown
from .tracker import TRACKER_RTOL, tracked_peak, tracker_table

OPTIMIZERS = ("for_loop", "foreach", "fused")
MAX_ACCUMULATION = 64  # micro-batches a step is split into
MAX_ROUNDS, MAX_STEPS = 200, 100  # timing: rounds of every setting, steps per visit
MAX_BATCH = 4096  # samples in the batch a subject trains on
AUTOCAST_DTYPE = torch.bfloat16  # the 16-bit type both a CPU and a recent GPU run autocast in
MiB = 2**20


@dataclass(frozen=True)
class Setting:
    """One way to train the same step: the knobs the fixes change."""

    set_to_none: bool = True
    checkpointing: str = "none"
    autocast: bool = False
    optimizer: str = "for_loop"
    accumulation: int = 1

    def __post_init__(self) -> None:
        if self.checkpointing not in CHECKPOINTINGS:
            raise choice_error("checkpointing", self.checkpointing, CHECKPOINTINGS)
        if self.optimizer not in OPTIMIZERS:
            raise choice_error("AdamW implementation", self.optimizer, OPTIMIZERS)
        check_count("accumulation", self.accumulation, 1, MAX_ACCUMULATION, "micro-batches of one step")


BASELINE = "baseline"
SETTINGS: dict[str, Setting] = {
    BASELINE: Setting(),
    "set_to_none=False": Setting(set_to_none=False),
    "checkpointing full": Setting(checkpointing="full"),
    "checkpointing selective": Setting(checkpointing="selective"),
    "bf16 autocast": Setting(autocast=True),
    "foreach AdamW": Setting(optimizer="foreach"),
    "fused AdamW": Setting(optimizer="fused"),
    "2 micro-batches": Setting(accumulation=2),
}


@dataclass(frozen=True)
class Fix:
    """A fix: the setting before, the setting after, the category it should move and which way ("down" or "up"),
    and whether the step's measured peak must fall with it (a category can also fall by being counted as another:
    tensors that checkpointing keeps may be seen as autograd's detail rather than activations; the peak cannot).
    ``during`` names a phase where the category is read at its largest during that phase rather than at the step's
    peak: an optimizer's temporaries live only in its step, which is not where a small model's step peaks.
    ``at_end_of`` names a phase at whose end it is read instead: the activations at the forward's end."""

    name: str
    before: str
    after: str
    category: str
    direction: str = "down"
    during: str | None = None
    lowers_peak: bool = True
    at_end_of: str | None = None

    @property
    def measured_at(self) -> str:
        if self.at_end_of is not None:
            return f"the {self.at_end_of}'s end"
        return "the step's peak" if self.during is None else f"its largest in the {self.during} phase"


FIXES = (
    Fix("set_to_none", "set_to_none=False", BASELINE, "gradient"),
    Fix("checkpointing (full)", BASELINE, "checkpointing full", "activation", at_end_of="forward"),
    Fix("checkpointing (selective)", BASELINE, "checkpointing selective", "activation", at_end_of="forward"),
    Fix("bf16 autocast", BASELINE, "bf16 autocast", "activation", at_end_of="forward"),
    Fix("foreach AdamW", BASELINE, "foreach AdamW", "temporary", "up", "optimizer", False),  # lists of intermediates
    Fix("fused AdamW", BASELINE, "fused AdamW", "temporary", "down", "optimizer", False),  # one pass, in place
    Fix("gradient accumulation", BASELINE, "2 micro-batches", "activation", at_end_of="forward"),
)


def category_bytes(breakdown: Breakdown, category: str, during: str | None = None,
                   at_end_of: str | None = None) -> int:
    """Bytes of ``category`` at the step's peak, at its largest during the phase ``during``, or at the end of the
    phase ``at_end_of``."""
    if at_end_of is not None:
        return breakdown.at_end_of(at_end_of)[category]
    if during is None:
        return breakdown.categories[category]
    rows = breakdown.timeline.query("phase == @during and category == @category")
    return int(rows["bytes"].max()) if len(rows) else 0


@dataclass(frozen=True)
class Subject:
    """What the fixes train: a model builder (given the checkpointing setting), a batch maker and the loss."""

    name: str
    build: Callable[[str], nn.Module]
    batch: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int
    checkpointing: bool  # whether the model has the knob

    def applies(self, setting: Setting) -> str | None:
        """None when ``setting`` runs on this subject, else why not."""
        if setting.checkpointing != "none" and not self.checkpointing:
            return f"{self.name} has no checkpointing knob (the book's GPT has one)"
        if self.batch_size % setting.accumulation:
            return f"a batch of {self.batch_size} does not split into {setting.accumulation} equal micro-batches"
        return None


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position of ``[N, T, V]`` logits against ``[N, T]`` targets, in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def class_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``[N, classes]`` logits against ``[N]`` labels, in fp32."""
    return F.cross_entropy(logits.float(), targets)


def gpt_subject(cuda: bool, batch_size: int | None = None) -> Subject:
    """The book's GPT at the device's size (the profile's: the tiny GPT on a CPU, GPT-2 small on a GPU), batches of
    random tokens as long as its block."""
    profile = get_profile(None, cuda)
    workload = get_workload("gpt")
    size = workload.profile_models[profile.name][0]
    batch_size = check_count("batch size", batch_size or workload.profile_knobs[profile.name]["batch_size"], 1,
                             MAX_BATCH, "sequences in one step")
    config = build_gpt(size).config

    def batch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(n)
        tokens = torch.randint(config.vocab_size, (n, config.block_size + 1), generator=generator)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    return Subject(size, lambda checkpointing: build_gpt(size, checkpointing=checkpointing), batch, next_token_loss,
                   batch_size, checkpointing=True)


def cnn_subject(cuda: bool, batch_size: int | None = None) -> Subject:
    """The book's CIFAR ResNet18 at the profile's width (1/8 on a CPU), batches of random 32x32 images."""
    profile = get_profile(None, cuda)
    batch_size = check_count("batch size", batch_size or profile.batch_size, 1, MAX_BATCH, "images in one step")

    def batch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(n)
        images = torch.randn(n, 3, 32, 32, generator=generator)
        return images.to(device), torch.randint(10, (n,), generator=generator).to(device)

    return Subject("resnet18", lambda checkpointing: build_model("resnet18", width=profile.width), batch, class_loss,
                   batch_size, checkpointing=False)


def make_optimizer(model: nn.Module, implementation: str) -> torch.optim.Optimizer:
    """AdamW as nanoGPT sets it (lr 6e-4, betas 0.9 and 0.95), in ``implementation``."""
    flags = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[implementation]
    return torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), **flags)


def prepared(subject: Subject, setting: Setting, device: torch.device, seed: int = 0
             ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model with ``seed``'s weights (the same for every setting) and its optimizer, on ``device``."""
    torch.manual_seed(seed)
    model = subject.build(setting.checkpointing).to(device)
    return model, make_optimizer(model, setting.optimizer)


def autocast_dtype(setting: Setting) -> torch.dtype | None:
    return AUTOCAST_DTYPE if setting.autocast else None


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, subject: Subject, setting: Setting,
               inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One training step under ``setting``: the batch in ``accumulation`` micro-batches (each loss scaled by its
    share), autocast where asked, the optimizer's step, then ``zero_grad`` with the setting's ``set_to_none``."""
    parts = setting.accumulation
    for x, y in zip(inputs.chunk(parts), targets.chunk(parts)):
        with torch.autocast(x.device.type, dtype=AUTOCAST_DTYPE, enabled=setting.autocast):
            loss = subject.loss(model(x), y) / parts
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=setting.set_to_none)


def breakdown_of(subject: Subject, setting: Setting, device: torch.device, seed: int = 0,
                 snapshot: bool = False) -> Breakdown:
    """The breakdown of one settled training step of ``subject`` under ``setting``: a first step, not profiled,
    creates the optimizer's state (and, without set_to_none, leaves the gradients), the second is broken down (on a
    GPU with the allocator's snapshot where ``snapshot`` asks for it)."""
    model, optimizer = prepared(subject, setting, device, seed)
    inputs, targets = subject.batch(subject.batch_size, device)
    train_step(model, optimizer, subject, setting, inputs, targets)
    options = {"device": device, "set_to_none": setting.set_to_none, "autocast_dtype": autocast_dtype(setting),
               "accumulation": setting.accumulation}
    measured = step_breakdown(model, (inputs, targets), subject.loss, optimizer, steps=1, snapshot=snapshot, **options)
    return replace(measured, tracked=tracked_peak(model, (inputs, targets), subject.loss, optimizer, **options))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timings:
    """Each setting's mean step time per round, and how many slots after the baseline it ran in each round."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    shifts: dict[str, list[int]] = field(default_factory=dict)

    def cost(self, before: str, after: str):
        """``optlab.core.measuring.timing.speed_up`` of ``after`` over ``before`` (below 1: the fix costs time)."""
        shifts = [a - b for a, b in zip(self.shifts[after], self.shifts[before])]
        return speed_up(self.seconds[before], self.seconds[after], shifts)


def time_settings(subject: Subject, settings: dict[str, Setting], device: torch.device, rounds: int = 8,
                  steps: int = 2, seed: int = 0) -> Timings:
    """Every setting timed ``steps`` steps per visit, the settings visited in mirrored rounds (a first round warms
    each up and is not kept)."""
    check_count("rounds", rounds, 2, MAX_ROUNDS, "an interval needs two rounds; more only narrow it")
    check_count("steps", steps, 1, MAX_STEPS, "steps timed per visit")
    inputs, targets = subject.batch(subject.batch_size, device)
    runs = {label: prepared(subject, setting, device, seed) for label, setting in settings.items()}
    timings, labels = Timings(), list(settings)
    for round_index in range(rounds + 1):
        order = visit_order(labels, round_index)
        for slot, label in enumerate(order):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(steps):
                train_step(*runs[label], subject, settings[label], inputs, targets)
            synchronize(device)
            if round_index:
                timings.seconds.setdefault(label, []).append((time.perf_counter() - start) / steps)
                timings.shifts.setdefault(label, []).append(slot)
    return timings


@dataclass(frozen=True)
class FixStudy:
    """The breakdown of every setting that applies, their timings, and why the others were left out."""

    subject: str
    device: str
    breakdowns: dict[str, Breakdown]
    timings: Timings
    skipped: dict[str, str]

    def table(self) -> pd.DataFrame:
        """One row per fix: the category it should move (MiB before and after, where ``measured at`` says), the peak
        before and after, the MiB and share of the peak saved, and the time it costs (speed-up over its before, with
        the interval and the verdict). A fix that does not apply here, or was not studied, has why and no numbers."""
        return pd.DataFrame([self.row(fix) for fix in FIXES]).set_index("fix")

    def speedups(self) -> pd.DataFrame:
        """Each measured fix's time cost as tidy rows, in the columns ``optlab.book.report`` plots: its speed-up over
        the setting before it (below 1: the fix costs time), with the interval and the verdict."""
        rows = [dict(fix_row) | {"fix": name} for name, fix_row in self.table().iterrows()
                if not fix_row["not measured"]]
        for row in rows:  # an interval too wide to mean anything is not drawn (its verdict says so)
            if too_wide_to_tell(row["ci_low"], row["ci_high"]):
                row["ci_low"] = row["ci_high"] = float("nan")
        return pd.DataFrame({"model": self.subject, "phase": "train", "variant": [row["fix"] for row in rows],
                             "source": "live", "speedup": [row["speed-up"] for row in rows],
                             "ci_low": [row["ci_low"] for row in rows], "ci_high": [row["ci_high"] for row in rows],
                             "verdict": [row["verdict"] for row in rows], "role": None,
                             "versus": "the setting before the fix"})

    def record_table(self) -> pd.DataFrame:
        """The fixes' table as it is kept for download and for the summary page: one row per fix, with the model
        and the device type it ran on."""
        return self.table().reset_index().assign(model=self.subject, device=self.device)

    def describe(self) -> list[str]:
        """What each measured fix did, as a sentence from its row: the category where it was read, the peak, and
        the time as its verdict says it (no adjective the verdict does not support)."""
        return [fix_sentence(name, row) for name, row in self.table().iterrows() if not row["not measured"]]

    def row(self, fix: Fix) -> dict[str, Any]:
        row: dict[str, Any] = {"fix": fix.name, "category": fix.category}
        reason = self.skipped.get(fix.after) or self.skipped.get(fix.before)
        if reason:
            return row | {"not measured": reason}
        before, after = self.breakdowns[fix.before], self.breakdowns[fix.after]
        was, now = (category_bytes(b, fix.category, fix.during, fix.at_end_of) for b in (before, after))
        cost = self.timings.cost(fix.before, fix.after)
        rounds = len(self.timings.seconds[fix.after])
        return row | {
            "measured at": fix.measured_at, "category MiB before": was / MiB, "category MiB after": now / MiB,
            "peak MiB before": before.peak_bytes / MiB, "peak MiB after": after.peak_bytes / MiB,
            "MiB saved": (before.peak_bytes - after.peak_bytes) / MiB,
            "share of the peak saved": 1 - after.peak_bytes / before.peak_bytes,
            "speed-up": cost.ratio, "interval": interval_text(cost.low, cost.high, rounds), "ci_low": cost.low,
            "ci_high": cost.high, "verdict": cost.verdict,
            "moved as expected": (now < was if fix.direction == "down" else now > was)
                                 and (after.peak_bytes < before.peak_bytes or not fix.lowers_peak),
            "not measured": "",
        }


def fix_sentence(name: str, row: "pd.Series | dict[str, Any]") -> str:
    """One measured fix in words: its category before and after where it was read, the peak before and after, and
    the time cost as the verdict has it (with the interval where one can be read)."""
    def change(before: float, after: float) -> str:
        return f"{after / before - 1:+.0%}" if before else "from nothing"

    interval = f", interval {row['interval']}" if row["interval"] else ""
    return (f"{name}: {row['category']} {row['category MiB before']:.3g} -> {row['category MiB after']:.3g} MiB at "
            f"{row['measured at']} ({change(row['category MiB before'], row['category MiB after'])}); the peak "
            f"{row['peak MiB before']:.3g} -> {row['peak MiB after']:.3g} MiB "
            f"({change(row['peak MiB before'], row['peak MiB after'])}); time: {row['speed-up']:.2f}x the step before "
            f"({row['verdict']}{interval})")


SUMMARY_TABLE = "memory-fixes"  # the name the chapter keeps its fixes' table under (``record_table``)
SUMMARY_COLUMNS = ["source", "model", "fix", "category", "measured at", "category change", "peak MiB before",
                   "peak change", "speed-up", "ci_low", "ci_high", "verdict"]


def summary_rows(reference_dir: "str | Path | None" = None, live_dir: "str | Path | None" = None) -> pd.DataFrame:
    """The memory fixes' compact rows for the summary page, from the stored tables: every GPU folder's
    ``memory-fixes.csv`` under the reference folder (source: its machine) and the live run's page table (source:
    "live"), one row per measured fix: what it moves, where, by how much, what it does to the peak, and its time
    cost with the interval and the verdict. Empty (with the columns) where none is stored."""
    frames = []
    stored = store.reference_tables(SUMMARY_TABLE, reference_dir)
    if stored is not None:
        frames.append(stored.rename(columns={"machine": "source"}))
    live = Path(live_dir) if live_dir is not None else store.LIVE_DIR / "pages"
    if (live / f"{SUMMARY_TABLE}.csv").is_file():
        frames.append(pd.read_csv(live / f"{SUMMARY_TABLE}.csv").assign(source="live"))
    if not frames:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    table = pd.concat(frames, ignore_index=True)
    table = table[table["not measured"].fillna("").eq("")] if "not measured" in table else table
    return table.assign(**{"category change": table["category MiB after"] / table["category MiB before"] - 1,
                           "peak change": table["peak MiB after"] / table["peak MiB before"] - 1},
                        ).reindex(columns=SUMMARY_COLUMNS).reset_index(drop=True)


def study_fixes(subject: Subject, device: "torch.device | str", rounds: int = 8, steps: int = 2, seed: int = 0,
                labels: Sequence[str] = tuple(SETTINGS)) -> FixStudy:
    """The breakdown and timing of each setting of ``labels`` on ``subject``; a setting that does not apply is
    skipped with why, and so is a fix whose settings were not asked for."""
    device = torch.device(device)
    for label in labels:
        if label not in SETTINGS:
            raise choice_error("setting", label, tuple(SETTINGS))
    if BASELINE not in labels:
        raise OptlabError(f"the settings studied must include {BASELINE!r}: every fix is measured against it")
    fix_threads(device.type == "cuda")
    skipped = {label: subject.applies(setting) or "not in this study" for label, setting in SETTINGS.items()
               if label not in labels or subject.applies(setting)}
    settings = {label: setting for label, setting in SETTINGS.items() if label not in skipped}
    breakdowns = {label: breakdown_of(subject, setting, device, seed, snapshot=label == BASELINE)  # the one kept
                  for label, setting in settings.items()}
    timings = time_settings(subject, settings, device, rounds, steps, seed)
    return FixStudy(subject.name, device.type, breakdowns, timings, skipped)


def fix_failures(study: FixStudy) -> list[str]:
    """One line per fix that did not move its category the way it should (or left the peak where it was, where it
    must lower it), per setting whose categories do not add up to its measured peak (within ``SUM_RTOL``), per
    setting whose measured peak and MemTracker's differ by more than ``TRACKER_RTOL``, and per setting whose
    parameters at the peak differ from the baseline's (no fix here changes the weights a model keeps)."""
    table = study.table()
    lines = [f"{name}: {row['category']} went from {row['category MiB before']:.3f} to "
             f"{row['category MiB after']:.3f} MiB at {row['measured at']}, the peak from {row['peak MiB before']:.3f} "
             f"to {row['peak MiB after']:.3f} MiB" for name, row in table.iterrows()
             if not row["not measured"] and not row["moved as expected"]]
    weights = study.breakdowns[BASELINE].categories["parameter"]
    lines += [f"{label}: parameters {b.categories['parameter'] / MiB:.3f} MiB at the peak, the baseline's "
              f"{weights / MiB:.3f}" for label, b in study.breakdowns.items() if b.categories["parameter"] != weights]
    lines += [f"{label}: the categories add up to {b.total / MiB:.3f} MiB, the measured peak is "
              f"{b.peak_bytes / MiB:.3f} MiB (tolerance {SUM_RTOL:.0%})" for label, b in study.breakdowns.items()
              if not b.adds_up(SUM_RTOL)]
    checked = tracker_table(study.breakdowns)
    lines += [f"{label}: MemTracker's peak is {row['peak MiB (MemTracker)']:.3f} MiB, the measured "
              f"{row['peak MiB (profiler)']:.3f} MiB (tolerance {TRACKER_RTOL:.0%})"
              for label, row in checked.iterrows() if not row["agrees"]]
    return lines


# (category, the phase at whose end it is read, or None for the step's peak, and the relative tolerance). The
# activations' count comes from the storages behind the tensors autograd saves for the backward (attention's q, k and
# v are views of one projection's output: the storage is what memory holds); at the forward's end the profiler sees
# every storage the forward still holds. 2 % bounds what the two may differ by at the book's sizes; parameters,
# AdamW's state and the gradients are counted exactly.
ARITHMETIC = (("parameter", None, 0.0), ("optimizer_state", None, 0.0), ("gradient", "backward", 0.0),
              ("activation", "forward", 0.02))


def arithmetic(breakdown: Breakdown) -> pd.DataFrame:
    """The measurement beside the count: parameters and optimizer state at the peak, the gradients at the
    backward's end (all of them exist there), the activations at the forward's end (all that the backward will need),
    each against the bytes arithmetic gives (``Breakdown.expected``), with the relative difference and its tolerance."""
    rows = []
    for category, phase, tolerance in ARITHMETIC:
        measured = breakdown.categories[category] if phase is None else breakdown.at_end_of(phase)[category]
        counted = breakdown.expected[category]
        difference = (measured - counted) / counted if counted else float(measured != 0)
        rows.append({"category": category, "measured at": "the peak" if phase is None else f"the {phase}'s end",
                     "measured MiB": measured / MiB, "counted MiB": counted / MiB, "difference": difference,
                     "tolerance": tolerance, "agrees": abs(difference) <= tolerance})
    return pd.DataFrame(rows).set_index("category")


# --- the GPU's answers ---------------------------------------------------------------------------------------------

ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOCATORS = {"default": "", "expandable_segments": "expandable_segments:True"}
LENGTH_FRACTIONS = (1.0, 0.5, 0.75, 0.25, 1.0, 0.625, 0.375, 0.875)  # the varying sequences that fragment memory
ALLOCATOR_SETTING = Setting(autocast=True, optimizer="fused")  # a GPU's usual step: the allocator is the question


def allocator_child(batch_size: int, steps: int) -> None:
    """In a fresh process (the allocator's setting comes from its environment): GPT training steps on sequences whose
    length varies step to step; prints the allocator's peak allocated and reserved bytes as JSON."""
    device = torch.device("cuda")
    subject = gpt_subject(True, batch_size)
    model, optimizer = prepared(subject, ALLOCATOR_SETTING, device)
    inputs, targets = subject.batch(batch_size, device)
    for step in range(steps):
        length = max(1, int(inputs.shape[1] * LENGTH_FRACTIONS[step % len(LENGTH_FRACTIONS)]))
        train_step(model, optimizer, subject, ALLOCATOR_SETTING, inputs[:, :length], targets[:, :length])
    torch.cuda.synchronize()
    print(json.dumps({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}))


def run_python(code: str, extra: dict[str, str]) -> subprocess.CompletedProcess:
    """``code`` run by this Python in a fresh process with ``child_environment(extra)``; its output captured."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_environment(extra),
                          check=False)


def allocator_table(device: "torch.device | str", batch_size: int = 8, steps: int = 16) -> "pd.DataFrame | str":
    """Peak reserved against peak allocated GiB, with and without ``expandable_segments``, each in a fresh process
    training the GPU's GPT on sequences of varying length; on any other device, one line saying why not."""
    check_count("batch size", batch_size, 1, MAX_BATCH, "sequences in one step")
    check_count("steps", steps, 1, MAX_STEPS, "steps of varying length")
    if torch.device(device).type != "cuda":
        return "reserved against allocated needs a GPU's caching allocator: a CPU allocates from the system directly"
    rows = []
    for name, setting in ALLOCATORS.items():
        code = f"from {__name__} import allocator_child; allocator_child({batch_size}, {steps})"
        done = run_python(code, {ALLOCATOR_ENV: setting})
        if done.returncode:
            raise OptlabError(f"the {name} allocator's run failed: {done.stderr.strip().splitlines()[-1:]}")
        peaks = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({"allocator": name, "allocated GiB": peaks["allocated"] / 2**30,
                     "reserved GiB": peaks["reserved"] / 2**30,
                     "reserved beyond allocated": peaks["reserved"] / peaks["allocated"] - 1})
    return pd.DataFrame(rows).set_index("allocator")


def largest_batches(subject: Subject, device: "torch.device | str", labels: Sequence[str] = tuple(SETTINGS),
                    limit: int = 256) -> "pd.DataFrame | str":
    """The largest batch one training step of each setting fits on a GPU (doubling, then bisecting; see
    ``largest_batch.largest_fitting``); on any other device, one line saying why not."""
    device = torch.device(device)
    for label in labels:
        if label not in SETTINGS:
            raise choice_error("setting", label, tuple(SETTINGS))
    largest_fitting(lambda n: True, limit)  # refuses a bad limit before any model is built
    if device.type != "cuda":
        return "not bounded on a CPU: running out of memory there swaps or ends the process instead of raising"
    rows = []
    for label in labels:
        setting = SETTINGS[label]
        if reason := subject.applies(setting):
            rows.append({"setting": label, "not measured": reason})
            continue
        batch, tries = largest_batch_of(subject, setting, device, limit)
        rows.append({"setting": label, "largest batch": batch, "tries": tries, "stopped at the limit": batch == limit})
    return pd.DataFrame(rows).set_index("setting")


def largest_batch_of(subject: Subject, setting: Setting, device: torch.device, limit: int) -> tuple[int, int]:
    """The largest batch up to ``limit`` one training step of ``setting`` fits, and the tries it took; a failed try's
    gradients and tensors are freed before the next (``largest_batch.fits_in_memory``)."""
    model, optimizer = prepared(subject, setting, device)

    def step(n: int) -> None:
        n = max(n, setting.accumulation) // setting.accumulation * setting.accumulation
        train_step(model, optimizer, subject, setting, *subject.batch(n, device))

    found = largest_fitting(lambda n: fits_in_memory(step, n, device, optimizer), limit)
    del model, optimizer
    free_memory(device)
    return found


def sharded_share(subject: Subject, world_sizes: Sequence[int] = (1, 2, 4, 8), batch_size: int = 2) -> pd.DataFrame:
    """MiB of parameters, gradients and AdamW state one rank keeps after an FSDP2 step of ``subject`` at each world
    size (measured under a fake process group: ``shard_scaling.fake_rank_bytes``), and the share of one rank's. The
    model must have ``.blocks``, the units FSDP2 shards (the book's GPT has)."""
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return subject.loss(model(batch[0]), batch[1])

    workload = ShardWorkload(lambda: subject.build("none"), lambda n, seed: subject.batch(n, torch.device("cpu")), loss)
    table = pd.DataFrame(fake_rank_bytes(world_sizes, batch_size, workload)).set_index("ranks") / MiB
    table["total"] = table.sum(axis=1)
    table["share of one rank"] = table["total"] / table["total"].iloc[0]
    return table
