"""One training step's memory, broken down: what the peak is made of, when it comes, and what arithmetic predicts.

``step_breakdown`` runs a few training steps (forward, backward, optimizer step, ``zero_grad``) under
``torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)`` and sorts every allocation into
the categories of torch's memory profile (the ones ``export_memory_timeline`` draws): parameters, gradients,
optimizer state, activations, temporaries, inputs, autograd's own detail, and other (allocations the profiler cannot
tie to a tensor). One refinement: whatever the optimizer step creates that is not optimizer state is counted as a
temporary of the step (the profiler's data flow calls some of a for-loop's or foreach's intermediates parameters or
activations, since they are computed from them).

The measured peak is counted apart from the categories: the bytes the model, optimizer and batch hold when the
steps begin plus the largest increase of allocated memory during them (the profiler's raw allocation records on a
CPU; the caching allocator's peak on a GPU). The categories at their own peak add up to it within
``SUM_RTOL``; on a GPU the allocator's reserved memory, the fragmentation, and a snapshot for
pytorch.org/memory_viz come with it.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import json
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd
import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.profiler._memory_profiler import Action, TensorKey

from ...core.measuring import loops
from ...core.errors import OptlabError, choice_error
from ...core.knobs.limits import check_count
from ...core.measuring.memory import resident_mb

CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "autograd_detail",
              "other")
PHASES = ("forward", "backward", "optimizer")
SUM_RTOL = 0.01  # the categories at their peak against the measured peak, relative (exact on a CPU where every
# tensor the step holds is seen by the profiler; a GPU's allocator rounds each block up)
MAX_STEPS = 8  # each step is profiled with its stacks, and the memory profile's analysis grows with its events
MAX_ACCUMULATION = 64
MARKS = {f"optlab.{phase}": phase for phase in PHASES}
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
SNAPSHOT_ENTRIES = 100_000
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this many bytes

COUNTED_WHEN = {  # when each count holds whole: weights from the start; gradients after a backward; the
    # optimizer's state after its first step; the activations the backward needs at the forward's end
    "parameter": "from the start", "gradient": "after each backward", "optimizer_state": "after the first step",
    "activation": "at the forward's end", "input": "while the batch is held"}

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass
class Breakdown:
    """One training step's memory: ``categories`` (bytes of each of ``CATEGORIES`` at the moment the step's
    memory peaked), ``peak_bytes`` (the measured peak), ``peak_time`` (seconds from the first step's start) and
    ``peak_phase``, ``timeline`` (time, phase, category, bytes: every category after each change), and ``expected``
    (bytes that arithmetic predicts, for the categories it can count: ``expected_bytes``). On a GPU,
    ``allocator`` holds the caching allocator's peaks (allocated, reserved) and ``snapshot`` its history;
    ``tracked`` the independent count of ``tracker.tracked_peak`` where it was run."""

    categories: dict[str, int]
    peak_bytes: int
    peak_time: float
    peak_phase: str
    timeline: pd.DataFrame
    expected: dict[str, int]
    device: torch.device
    allocator: dict[str, int] = field(default_factory=dict)
    snapshot: dict | None = None
    tracked: dict[str, int] = field(default_factory=dict)  # MemTracker's peak by its kinds, where it was run

    @property
    def total(self) -> int:
        """The categories' sum at their peak."""
        return sum(self.categories.values())

    def largest(self) -> str:
        """The category that holds the most memory at the peak."""
        return max(self.categories, key=self.categories.__getitem__)

    def adds_up(self, rtol: float = SUM_RTOL) -> bool:
        """Whether the categories add up to the measured peak within ``rtol`` of it."""
        return abs(self.total - self.peak_bytes) <= rtol * self.peak_bytes

    def at_end_of(self, phase: str) -> dict[str, int]:
        """Bytes of each category at the end of the last ``phase`` (one of ``PHASES``): at the forward's end, the
        activations are what autograd saved for the backward."""
        if phase not in PHASES:
            raise choice_error("phase", phase, PHASES)
        times = self.timeline[["time", "phase"]].drop_duplicates()
        later = times["phase"].ne(times["phase"].shift()).cumsum()  # each run of one phase, numbered
        last = times["time"][later == later[times["phase"] == phase].max()].max()
        rows = self.timeline[self.timeline["time"] == last]
        return {name: int(rows.loc[rows["category"] == name, "bytes"].iloc[-1]) for name in CATEGORIES}

    def table(self) -> pd.DataFrame:
        """The categories as a reader sees them: MiB at the peak, share of the peak, and the arithmetic's MiB with
        the moment it counts (``COUNTED_WHEN``: not the peak's, where some may be partly built or already freed)."""
        rows = [{"category": name, "MiB at the peak": size / 2**20,
                 "share": size / self.peak_bytes if self.peak_bytes else 0.0,
                 "counted MiB": self.expected[name] / 2**20 if name in self.expected else None,
                 "counted when": COUNTED_WHEN[name] if name in self.expected else ""}
                for name, size in self.categories.items()]
        return pd.DataFrame(rows).round({"MiB at the peak": 2, "share": 3, "counted MiB": 2})

    def save_timeline(self, path: str | Path) -> Path:
        """Write the timeline as JSON (records of time, phase, category, bytes) with the peak, for a download."""
        path = Path(path)
        record = {"device": str(self.device), "peak_bytes": self.peak_bytes, "peak_time": self.peak_time,
                  "peak_phase": self.peak_phase, "categories": self.categories, "expected": self.expected,
                  "timeline": self.timeline.to_dict(orient="records")}
        path.write_text(json.dumps(record))
        return path

    def save_snapshot(self, path: str | Path) -> Path:
        """Write the allocator's snapshot (a pickle that pytorch.org/memory_viz opens); only a GPU's has one."""
        if self.snapshot is None:
            raise OptlabError(f"a memory snapshot is the CUDA allocator's; this breakdown ran on {self.device}")
        path = Path(path)
        with path.open("wb") as file:
            pickle.dump(self.snapshot, file)
        return path


def step_breakdown(model: nn.Module, inputs: tuple[Any, torch.Tensor], loss_fn: LossFn,
                   optimizer: torch.optim.Optimizer, *, device: str | torch.device, steps: int = 2,
                   set_to_none: bool = True, autocast_dtype: torch.dtype | None = None,
                   accumulation: int = 1, warmup_steps: int = 0, snapshot: bool = True) -> Breakdown:
    """Run ``steps`` training steps of ``model`` on one batch ``inputs`` = ``(model inputs, targets)`` (the inputs a
    tensor, a tuple or a dict of keyword tensors) and break their memory peak down by category.

    Each step runs ``accumulation`` forwards and backwards on as many slices of the batch (the same effective batch)
    under ``autocast_dtype`` (``torch.bfloat16``, ``torch.float16`` or None), then ``optimizer.step()`` and
    ``optimizer.zero_grad(set_to_none=set_to_none)``. The model is moved to ``device`` (the optimizer's parameters
    move with it). The first step creates the optimizer's state and the second finds it there, so ``steps`` of 2 or
    more shows a settled step; so does one step after ``warmup_steps`` of 1, run before the profile (in half the
    time: the profile's analysis grows with its events). On a GPU, ``snapshot`` keeps the allocator's history of the
    steps (with Python stacks) for pytorch.org/memory_viz; give False where it would not be kept.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    check_count("steps", steps, 1, MAX_STEPS, "each step is profiled with its stacks")
    check_count("accumulation", accumulation, 1, MAX_ACCUMULATION, "micro-batches per optimizer step")
    check_count("warmup_steps", warmup_steps, 0, MAX_STEPS, "steps before the profile")
    if autocast_dtype is not None and autocast_dtype not in AUTOCAST_DTYPES:
        raise OptlabError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None, got {autocast_dtype!r}")
    batch = (loops.inputs_to(inputs[0], device), inputs[1].to(device))
    chunks = micro_batches(batch, accumulation)
    model.to(device)
    for _ in range(warmup_steps):
        train_step(model, chunks, loss_fn, optimizer, device, autocast_dtype, set_to_none)
    expected = expected_bytes(model, optimizer, batch, device) | {
        "activation": saved_activation_bytes(model, chunks[0], loss_fn, autocast_dtype)}
    resident = round(resident_mb([model, optimizer, *loops.input_tensors(batch[0]), batch[1]], device) * 2**20)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start_allocated = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        if snapshot:
            record_history(True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
            for _ in range(steps):
                train_step(model, chunks, loss_fn, optimizer, device, autocast_dtype, set_to_none)
            if cuda:
                torch.cuda.synchronize(device)
        allocator, history = (_allocator(device), _cuda_snapshot() if snapshot else None) if cuda else ({}, None)
    finally:
        if cuda and snapshot:
            record_history(False)
    increase = allocator["peak allocated"] - start_allocated if cuda else cpu_increase(prof)
    marks = phase_marks(prof)
    timeline = category_timeline(prof, device, marks)
    return _summarize(timeline, resident + increase, expected, device, allocator, history)


def micro_batches(batch: tuple[Any, torch.Tensor], accumulation: int) -> list[tuple[Any, torch.Tensor]]:
    """``batch`` cut into ``accumulation`` slices along its first dimension (as even as they come)."""
    rows = len(batch[1])
    if accumulation > rows:
        raise OptlabError(f"accumulation {accumulation} needs at least as many samples in the batch; it has {rows}")
    bounds = [round(i * rows / accumulation) for i in range(accumulation + 1)]
    return [(loops.map_inputs(lambda t, a=a, b=b: t[a:b], batch[0]), batch[1][a:b])
            for a, b in itertools.pairwise(bounds)]


def train_step(model: nn.Module, chunks: list[tuple[Any, torch.Tensor]], loss_fn: LossFn,
               optimizer: torch.optim.Optimizer, device: torch.device, autocast_dtype: torch.dtype | None,
               set_to_none: bool, between: Callable[[], None] | None = None) -> None:
    """One optimizer step over ``chunks`` (micro-batches), each phase marked for the profiler; ``between`` is
    called after each micro-batch's backward but the last."""
    for index, (inputs, targets) in enumerate(chunks):
        with record_function("optlab.forward"), torch.autocast(device.type, dtype=autocast_dtype,
                                                               enabled=autocast_dtype is not None):
            loss = loss_fn(loops.call_model(model, inputs), targets) / len(chunks)
        with record_function("optlab.backward"):
            loss.backward()
        del loss
        if between is not None and index < len(chunks) - 1:
            between()
    with record_function("optlab.optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)


def expected_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Any, torch.Tensor],
                   device: torch.device) -> dict[str, int]:
    """The arithmetic, as ``device`` holds it: parameters (elements x bytes each), their gradients (the trainable
    ones), the optimizer's state where its kind is known (``optimizer_state_bytes``) and the batch's inputs and
    targets; on a GPU each tensor is rounded up to the allocator's ``CUDA_BLOCK``."""
    parameters = {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values()
    trainable = [p for p in parameters if p.requires_grad]
    expected = {"parameter": sum(held_bytes(p.numel() * p.element_size(), device) for p in parameters),
                "gradient": sum(held_bytes(p.numel() * p.element_size(), device) for p in trainable),
                "input": sum(held_bytes(t.numel() * t.element_size(), device)
                             for t in (*loops.input_tensors(batch[0]), batch[1]))}
    state = optimizer_state_bytes(optimizer, trainable, device)
    return expected | ({"optimizer_state": state} if state is not None else {})


def held_bytes(nbytes: int, device: torch.device) -> int:
    """The bytes ``device`` holds for a tensor of ``nbytes``: the CUDA allocator's block (a multiple of
    ``CUDA_BLOCK``), or the bytes themselves elsewhere."""
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK if torch.device(device).type == "cuda" else nbytes


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, trainable: list[torch.Tensor],
                          device: torch.device) -> int | None:
    """The state an optimizer keeps on ``device`` for the ``trainable`` parameters; None for an optimizer whose
    state is not counted here. Adam and AdamW keep two moments per parameter (three with amsgrad) and a one-element
    float32 step count, which the for-loop and foreach implementations keep on the CPU and the fused or capturable
    ones beside the parameter; SGD keeps one tensor per parameter with momentum, none without."""
    defaults, device = optimizer.defaults, torch.device(device)
    sizes = [held_bytes(p.numel() * p.element_size(), device) for p in trainable]
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        moments = 3 if defaults.get("amsgrad") else 2
        step_device = device if defaults.get("fused") or defaults.get("capturable") else torch.device("cpu")
        steps = held_bytes(4, device) * len(sizes) if step_device.type == device.type else 0
        return moments * sum(sizes) + steps
    if type(optimizer) is torch.optim.SGD:
        return sum(sizes) if defaults.get("momentum") else 0
    return None


def saved_activation_bytes(model: nn.Module, batch: tuple[Any, torch.Tensor], loss_fn: LossFn,
                           autocast_dtype: torch.dtype | None) -> int:
    """The bytes autograd saves for the backward in one forward of ``batch``: the sum of ``saved_activations``."""
    return int(saved_activations(model, batch, loss_fn, autocast_dtype)["bytes"].sum())


def saved_activations(model: nn.Module, batch: tuple[Any, torch.Tensor], loss_fn: LossFn,
                      autocast_dtype: torch.dtype | None) -> pd.DataFrame:
    """What autograd saves for the backward in one forward of ``batch``, layer by layer: one row per module (its
    name in the model; ``(loss)`` for the loss, outside it) with the bytes of the tensors saved while it was the
    innermost module running (the model's own name for what its forward does outside its layers),
    counted by the storage behind each (a view, such as attention's q, k and v of one projection, keeps its
    whole storage: each storage once, for the first module that saved it). The
    parameters and the batch are left out (they are counted as such). The forward runs once, outside any profile;
    its graph is dropped without a backward."""
    device = batch[1].device
    known = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *loops.input_tensors(batch[0]), batch[1])}
    saved: dict[int, tuple[str, int]] = {}
    running = ["(loss)"]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in known and tensor.device == device:
            owner = saved.get(pointer, (running[-1], 0))[0]
            saved[pointer] = owner, tensor.untyped_storage().nbytes()  # a view keeps its whole storage
        return tensor

    def enter(name: str) -> Callable[..., None]:
        return lambda *_: running.append(name)

    def leave(*_: Any) -> None:
        running.pop()

    handles = [hook for name, module in model.named_modules() for hook in (
        module.register_forward_pre_hook(enter(name or type(model).__name__)), module.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), quiet_hooks(), \
                torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            output = loops.call_model(model, batch[0])
            running[:] = ["(loss)"]  # a module's forward that raised left its name
            loss = loss_fn(output, batch[1])
        del output, loss
    finally:
        for handle in handles:
            handle.remove()
    rows = collections.defaultdict(int)
    for owner, size in saved.values():
        rows[owner] += size
    return pd.DataFrame({"module": list(rows), "bytes": list(rows.values())}, columns=["module", "bytes"])


SAC_HOOKS_WARNING = "A saved_tensors_hooks context"  # torch's FutureWarning: such hooks around selective checkpointing


@contextlib.contextmanager
def quiet_hooks() -> Iterator[None]:
    """Drop torch's FutureWarning about saved-tensor hooks around a selective checkpoint (the tensors selective
    checkpointing saves bypass the hooks, so a count of saved tensors leaves them out): it speaks of a future default,
    not of the measurement, and a reader would see it under every cell."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SAC_HOOKS_WARNING, category=FutureWarning)
        yield


def cpu_increase(prof: profile) -> int:
    """The largest increase of CPU memory during the profile: its allocation records' running sum at its highest."""
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == DeviceType.CPU), key=lambda e: e.start_ns())
    return max(itertools.accumulate((e.nbytes() for e in events), initial=0))


def phase_marks(prof: profile) -> list[tuple[int, str]]:
    """Each phase's start (ns, on the profiler's clock) and name, in order."""
    return sorted((e.start_ns(), MARKS[e.name()]) for e in prof.profiler.kineto_results.events()
                  if e.name() in MARKS)


def phase_at(marks: list[tuple[int, str]], time_ns: int) -> str:
    """The phase running at ``time_ns``: the last one that started by then (the first, before any)."""
    index = bisect.bisect_right(marks, (time_ns, "~")) - 1
    return marks[max(index, 0)][1]


PROFILER_CATEGORIES = {"PARAMETER": "parameter", "GRADIENT": "gradient", "OPTIMIZER_STATE": "optimizer_state",
                       "ACTIVATION": "activation", "TEMPORARY": "temporary", "INPUT": "input",
                       "AUTOGRAD_DETAIL": "autograd_detail"}


def category_timeline(prof: profile, device: torch.device, marks: list[tuple[int, str]]) -> pd.DataFrame:
    """Bytes of every category on ``device`` after each moment that changed them: time (ns), phase, then one
    column per category. Built from torch's memory profile (the data of ``export_memory_timeline``), with what the
    optimizer step creates, other than its state, counted as temporary."""
    memory_profile = prof._memory_profile()  # torch's MemoryProfile: its timeline and categories
    categories = memory_profile._categories
    in_step: set[int] = set()  # tensors the optimizer step created
    loose: dict[int, list[str]] = collections.defaultdict(list)  # untied allocations' categories, by size
    live = dict.fromkeys(CATEGORIES, 0)
    rows: list[dict[str, Any]] = []
    for time_ns, events in itertools.groupby(
            (event for event in memory_profile.timeline if event[2][0].device == device), key=lambda e: e[0]):
        for _, action, (key, version), size in events:
            phase = phase_at(marks, time_ns)
            if isinstance(key, TensorKey):
                if action == Action.CREATE and phase == "optimizer":
                    in_step.add(key.id)
                name = _category(categories.get(key, version), key.id in in_step)
                if action in (Action.PREEXISTING, Action.CREATE):
                    live[name] += size
                else:  # a new version may change the category; a destroyed tensor leaves its last one
                    live[name] -= size
                    if action == Action.INCREMENT_VERSION:
                        live[_category(categories.get(key, version + 1), key.id in in_step)] += size
            elif action == Action.DESTROY:
                live[loose[size].pop() if loose[size] else "other"] -= size
            elif action != Action.INCREMENT_VERSION:  # an untied block allocated again where it was: no change
                name = "temporary" if phase == "optimizer" and action == Action.CREATE else "other"
                loose[size].append(name)
                live[name] += size
        rows.append({"time_ns": time_ns, "phase": phase_at(marks, time_ns), **live})
    return pd.DataFrame(rows, columns=["time_ns", "phase", *CATEGORIES])


def _category(category: Any, created_in_step: bool) -> str:
    name = PROFILER_CATEGORIES.get(getattr(category, "name", None), "other")
    return "temporary" if created_in_step and name != "optimizer_state" else name


def _summarize(wide: pd.DataFrame, peak_bytes: int, expected: dict[str, int], device: torch.device,
               allocator: dict[str, int], snapshot: dict | None) -> Breakdown:
    """The breakdown at the timeline's peak, with the timeline in long form (seconds from the first step)."""
    if wide.empty:
        raise OptlabError(f"the profiler recorded no memory on {device}: is the model on {device}?")
    start = wide["time_ns"][wide["time_ns"] > 0].min()
    wide = wide.assign(time=(wide["time_ns"].clip(lower=start) - start) / 1e9).drop(columns="time_ns")
    peak = wide[list(CATEGORIES)].sum(axis=1).idxmax()
    timeline = wide.melt(id_vars=["time", "phase"], value_vars=list(CATEGORIES), var_name="category",
                         value_name="bytes")
    return Breakdown(categories={name: int(wide.at[peak, name]) for name in CATEGORIES}, peak_bytes=int(peak_bytes),
                     peak_time=float(wide.at[peak, "time"]), peak_phase=str(wide.at[peak, "phase"]),
                     timeline=timeline, expected=expected, device=device, allocator=allocator, snapshot=snapshot)


def record_history(enabled: bool) -> None:
    """Start (or stop) the CUDA allocator's record of every allocation, with its Python stack, for the snapshot
    (Python frames only: symbolising the C++ ones can take minutes a snapshot)."""
    from torch.cuda.memory import _record_memory_history

    if enabled:  # an earlier breakdown's history is dropped: the snapshot shows these steps only
        _record_memory_history("all", stacks="python", max_entries=SNAPSHOT_ENTRIES, clear_history=True)
    else:
        _record_memory_history(None)


def _cuda_snapshot() -> dict:
    from torch.cuda.memory import _snapshot

    return _snapshot()


def _allocator(device: torch.device) -> dict[str, int]:
    """The caching allocator's peaks since they were reset: allocated and reserved bytes."""
    stats = torch.cuda.memory_stats(device)
    return {"peak allocated": int(stats["allocated_bytes.all.peak"]),
            "peak reserved": int(stats["reserved_bytes.all.peak"])}
