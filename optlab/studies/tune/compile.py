"""``optlab tune --compile``: whether ``torch.compile`` pays on the reader's own model, and what stops it.

Four answers, each from a run, not a rule:

1. **Graph breaks** (``first_step.breaks.find_breaks``): every line of the model's forward that Dynamo cannot put in
   a graph, with its reason and ``file:line``. A model Dynamo cannot trace at all is one error line.
2. **Recompiles** over the shapes the reader's data has (a list of shapes, or their DataLoader's batches): the guard
   that failed at each new shape (``first_step.recompiles.watch``); past the recompile limit the model would run in
   eager, which is one error line with what to do.
3. **Compile seconds, the model's own, cold and warm**: first the machine's setup, which a process's first compile
   pays whatever the model (Inductor's probe of the CPU's vector instructions, ``first_step.fresh.probe_machine``,
   and a first tiny compile, ``first_step.starts.build_headers``: imports, the compiler's checks, the precompiled
   headers), timed and reported beside; then the model's first step with every compile cache in a fresh, empty
   folder (``first_step.fresh.redirected``: Inductor's, Triton's and the temporary folder; its cache counters show
   only misses), then again with that folder's caches on disk (hits). Both are the first step minus the compiled
   model's median step, as in chapter 10.
4. **The steady state**: eager and compiled steps in paired, mirrored rounds, the speed-up with the book's interval
   and verdict, and the break-even: the model's own cold compile seconds over the time a step saves, with the
   interval's range. The lines to add follow the verdict: ``torch.compile`` only where the compiled step is faster.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch  # not torch._dynamo: torch imports it on first use (torch._dynamo.reset()), not at every process start
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ...core.errors import OptlabError
from ...core.knobs.limits import MAX_STEPS, check_count
from ...core.knobs.profiles import Profile, get_profile
from ...core.machine.compiler import require_compiler
from ...core.knobs.config import RunConfig
from ...core.machine.device import DeviceInfo, resolve_device
from ...core.measuring import loops
from ...core.measuring.timing import FASTER, SLOWER, UNCLEAR, SpeedUp, interval_text
from ..first_step import dynamo_log, fresh, starts
from ..first_step.breaks import Breaks, Timings, find_breaks, time_variants
from ..first_step.recompiles import Recompiles, first_guard, watch
from ..kernels.compile_cost import inductor_counters
from .examples import describe_inputs, examples_from
from .inputs import (
    Batch, Batches, LossFn, ModelFn, batch_limit, build_model, check_batch, cross_entropy, dataset_batches,
    describe_error, first_inputs, loader_batches, model_name, probe, synthetic_batches,
)

ROUNDS = 8  # paired rounds of eager and compiled steps
MAX_SHAPES = 64  # shapes (or distinct DataLoader batches) watched for recompiles
MAX_LOADER_BATCHES = 1_000  # DataLoader batches read to find the shapes it gives
NOT_COMPILE = ("techniques", "loss_tolerance", "out", "output_fn", "max_batch", "amp_dtype", "sweep_compile",
               "request_seconds", "request_batches", "optimizer")


@dataclass(frozen=True)
class FirstStep:
    """One compile: the first step's seconds, the compile seconds (first step minus the steady median), and what
    Inductor's on-disk caches did meanwhile."""

    first_step_s: float
    compile_s: float
    cache_hits: int
    cache_misses: int

    @property
    def caches(self) -> str:
        return f"{self.cache_misses} cache misses, {self.cache_hits} hits"


@dataclass(frozen=True)
class MachineSetup:
    """What a process's first compile pays whatever the model, measured before the model's cold compile so that it
    stays out of the model's cost: Inductor's probe of the CPU's vector instructions (not run for a GPU), then a first
    tiny compile (Inductor's imports, its compilers' checks, its precompiled headers). Either is near 0 where this
    process paid it already."""

    probe_s: float
    first_compile_s: float

    @property
    def seconds(self) -> float:
        return self.probe_s + self.first_compile_s

    def describe(self) -> str:
        probe = f"Inductor's probe of the CPU's vector instructions {self.probe_s:.1f} s, " if self.probe_s else ""
        return (f"{self.seconds:.1f} s ({probe}a first tiny compile {self.first_compile_s:.1f} s: imports, the "
                "compiler's checks, precompiled headers), paid by a process's first compile whatever the model")


@dataclass
class CompileResult:
    """What ``tune(..., compile=True)`` returns: the breaks, the recompiles over the data's shapes (None where only
    one shape was given), the machine's setup, the model's cold and warm compiles, and the eager and compiled steps'
    timings."""

    model: str
    device: torch.device
    step: str  # "training step" or "forward"
    batch: str
    breaks: Breaks
    recompiles: Recompiles | None
    varying_dims: list[int]
    setup: MachineSetup
    cold: FirstStep
    warm: FirstStep
    timings: Timings
    same_batch: list[str]  # the guards that failed when the compiled model was called again on the same batch

    def speed_up(self) -> SpeedUp:
        return self.timings.speed_up("eager", "compiled")

    def saving_s(self, ratio: float) -> float:
        """Seconds a step saves at a speed-up of ``ratio`` over the median eager step."""
        return float(np.median(self.timings.seconds["eager"])) * (1 - 1 / ratio) if ratio > 0 else -math.inf

    def break_even(self) -> tuple[float, float, float]:
        """Steps after which the model's own cold compile has paid (the machine's setup left out): at the speed-up,
        and at its interval's high and low ends (infinite where that end saves nothing)."""
        gain = self.speed_up()
        return tuple(self.cold.compile_s / saving if saving > 0 else math.inf
                     for saving in (self.saving_s(r) for r in (gain.ratio, gain.high, gain.low)))

    def table(self) -> pd.DataFrame:
        """Eager and compiled after their first steps: the median step, spread, speed-up with interval and
        verdict."""
        table = self.timings.table("eager")
        table["interval"] = [interval_text(low, high) if not math.isnan(low) else ""
                             for low, high in zip(table["low"], table["high"])]
        return table[["ms per call", "spread ms (IQR)", "speed-up", "interval", "verdict", "rounds"]] \
            .rename(columns={"ms per call": "ms per step"})

    def describe(self) -> str:
        """The answers in words, then the lines of code to add."""
        gain = self.speed_up()
        lines = [f"graph breaks: {self.breaks.describe()}"]
        lines += [f"  {row.where}: {row.reason}\n      {row.line}" for row in self.breaks.table.itertuples()]
        if self.recompiles is not None:
            lines.append(f"recompiles over your shapes: {self.recompiles.describe()}")
            lines += [f"  {row.input}: {row._5}" for row in self.recompiles.calls.itertuples() if row.recompiled]
        if self.same_batch:
            lines.append(f"recompiles on the same batch, call after call: {len(self.same_batch)}, such as "
                         f"{first_guard(self.same_batch[-1])}")
        lines.append(f"compile, the model's own: {self.cold.compile_s:.1f} s cold (every compile cache in a fresh, "
                     f"empty folder: {self.cold.caches}), {self.warm.compile_s:.1f} s warm (its caches on disk: "
                     f"{self.warm.caches})")
        lines.append(f"  beside it, the machine's setup, paid before: {self.setup.describe()}")
        lines.append(f"steady state: {gain.ratio:.2f}x ({interval_text(gain.low, gain.high)}), {gain.verdict}")
        lines.append("break-even: " + self.break_even_text())
        return "\n".join([*lines, "the lines to add:", *(f"    {line}" for line in self.code_lines())])

    def break_even_text(self) -> str:
        """The break-even in the verdict's words: steps where the compiled step is faster, "never" where it is
        slower or the same, the verdict itself where it cannot tell yet."""
        gain, (steps, fewest, most) = self.speed_up(), self.break_even()
        if gain.verdict == FASTER:
            return (f"{steps:,.0f} steps of the model's cold compile ({_steps(fewest)} to {_steps(most)} over the "
                    "interval)")
        if gain.verdict == UNCLEAR:
            return f"{UNCLEAR}: the interval holds 1, so whether a step saves anything is not known"
        return f"never: the compiled {self.step} is {'slower' if gain.verdict == SLOWER else 'no faster'} here"

    def code_lines(self) -> list[str]:
        """The lines of code the verdict calls for: where the compiled step is faster, compile the model, fix each
        break, keep shapes from recompiling, and a test that fails on a recompile; else no ``torch.compile`` line,
        and what to do first."""
        gain = self.speed_up()
        fix = [f"# remove the {self.breaks.count} graph break(s) listed above, each at its line"] if self.breaks.count \
            else []
        if gain.verdict == UNCLEAR:
            return [f"# {UNCLEAR} whether torch.compile pays: time more steps (--steps) on a quieter machine", *fix]
        if gain.verdict != FASTER:
            return [f"# keep the model in eager: compiled, its {self.step} ran {gain.ratio:.2f}x of eager's speed here",
                    *fix]
        lines = ["model = torch.compile(model)"]
        if fix:
            lines.append(f"# then {fix[0][2:]}")
        if self.recompiles is not None and self.recompiles.count and self.varying_dims:
            lines += [f"torch._dynamo.mark_dynamic(inputs, {dim})  # before the first call: this dimension varies"
                      for dim in self.varying_dims]
            lines.append("# or pad each batch to one of a few fixed sizes (buckets), and compile with dynamic=False")
        if self.warm.compile_s < self.cold.compile_s / 2:
            lines.append("# keep Inductor's caches between runs: TORCHINDUCTOR_CACHE_DIR=<a folder kept on disk>")
        lines += ["with torch.compiler.set_stance(\"fail_on_recompile\"):  # in a test, after one warm-up call",
                  "    model(inputs)"]
        return lines

    def report(self) -> str:
        """What ``optlab tune --compile`` prints: the steps' table, then ``describe``."""
        with pd.option_context("display.width", 250, "display.max_columns", 20):
            return "\n".join([self.table().to_string(), self.describe()])


def _steps(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:,.0f}"


def tune_compile(model_fn: ModelFn, *, input_shape: Any = None, num_classes: int | None = None, inputs: Any = None,
                 targets: torch.Tensor | None = None, data: DataLoader | Dataset | None = None,
                 shapes: Sequence[Sequence[int]] | None = None, loss_fn: LossFn | None = None,
                 batch_size: int | None = None, steps: int | None = None, device: str = "auto",
                 profile: str | Profile | None = None, name: str | None = None, seed: int = 0,
                 inference: bool = False, progress: bool = True, **timed_only: Any) -> CompileResult:
    """Whether ``torch.compile`` pays on the model that ``model_fn`` builds: its graph breaks (reason and
    ``file:line``), its recompiles over ``shapes`` (per-sample shapes of its one input) or over the batches of
    ``data`` (a DataLoader), its compile seconds cold and warm, the steady-state speed-up of its training step (its
    forward with ``inference=True``) with the verdict, and the break-even in steps.

    The inputs are given as for ``tune``. A model Dynamo cannot trace at all, and shapes that pass the recompile
    limit, are refused in one line each."""
    given = [key for key in NOT_COMPILE if timed_only.pop(key, None) not in (None, False, "auto", "sgd")]
    if timed_only:
        raise TypeError(f"tune() got unexpected keyword arguments: {', '.join(timed_only)}")
    if given:
        raise OptlabError(f"compile=True (--compile) measures torch.compile alone; {', '.join(given)} "
                          f"{'is' if len(given) == 1 else 'are'} for the stack's tune")
    info = resolve_device(device)
    require_compiler([RunConfig(compile_mode="default")], info)
    prof = get_profile(profile, info.is_cuda)
    calls = check_count("steps", steps, 1, MAX_STEPS, "timed steps per visit") if steps is not None else \
        max(prof.steps or 1, 3)
    loss_fn = loss_fn or cross_entropy
    batches, batch, description = _batch(data, input_shape, inputs, targets, num_classes, batch_size,
                                         prof.batch_size, seed, info, inference)
    name = name or model_name(model_fn)
    if batches is not None:
        probe(model_fn, batches, loss_fn, info.device, seed)
    model = build_model(model_fn, seed).to(info.device).train(not inference)
    _check_forward(model, batch[0], info.device)
    step = "forward" if inference else "training step"
    if progress:
        print(f"optlab tune --compile {name}: the {step}, {description}, on {info.describe()}", flush=True)
    example = loops.inputs_to(batch[0], info.device)
    found = find_breaks(model, example)
    if found.graphs == 0:
        why = f"{found.table['reason'].iloc[0]} at {found.table['where'].iloc[0]}" if found.count else \
            found.skipped or "Dynamo skipped the whole frame"
        raise OptlabError(f"Dynamo could not trace any of {name}'s forward, so torch.compile would run all of it in "
                          f"eager: {why}")
    again = watch(model, [example] * 3)
    if again.count:
        raise OptlabError(f"{name} recompiles at every call on the same batch (seen by Dynamo alone, before any "
                          f"kernel was built), so it would reach the recompile limit ({again.limit}) and run in eager; the guard "
                          f"that fails: {first_guard(again.reasons[-1])}; make that value a tensor or keep it out of "
                          "forward")
    watched, varying = _watch_shapes(model, example, shapes, data, info.device)
    run = _make_step(batch, loss_fn, info.device, inference)
    with dynamo_log.caught() as log:
        setup, cold, warm, timings = _compile_and_time(model_fn, info, seed, inference, run, calls, progress)
    if log.limits:
        limit = torch._dynamo.config.recompile_limit
        raise OptlabError(f"{name} recompiles at every call on the same batch and reached the recompile limit "
                          f"({limit}), so it ran in eager; the guard that fails: {first_guard(log.recompiles[-1])}" if log.recompiles else
                          f"{name} reached the recompile limit: {log.limits[0]}")
    return CompileResult(name, info.device, step, description, found, watched, varying, setup, cold, warm, timings,
                         log.recompiles)


def _rows(inputs: Any) -> int:
    return len(loops.input_tensors(inputs)[0])


def _batch(data: Any, input_shape: Any, inputs: Any, targets: Any, num_classes: int | None, batch_size: int | None,
           default_size: int, seed: int, info: DeviceInfo, inference: bool) -> tuple[Batches | None, Batch, str]:
    """The batches a training step's probe reads (None for a forward), one batch ``(inputs, targets)`` on the host
    (targets None for a forward of the reader's data), and a line that says what it is."""
    if data is None:
        made = examples_from(inputs, targets, input_shape, num_classes, seed)
        size = check_batch("batch_size", batch_size, made, info.device) if batch_size is not None else \
            min(default_size, batch_limit(made, info.device)[0])
        if inference:
            return None, made.make(size, 0), f"{made.description}, batches of {size}"
        batches = synthetic_batches(made, size, 1)
        return batches, batches.first, batches.description
    if any(value is not None for value in (input_shape, inputs, targets, num_classes)):
        raise OptlabError("give either data= or the inputs (input_shape, inputs, targets, num_classes), not both")
    if inference:
        first = first_inputs(data, batch_size or default_size)
        return None, (first, None), f"the first batch of your data ({_rows(first)} samples)"
    batches = loader_batches(data, batch_size, 1) if isinstance(data, DataLoader) else \
        dataset_batches(data, batch_size or default_size, 1, seed)
    return batches, batches.first, batches.description


def _check_forward(model: nn.Module, inputs: Any, device: torch.device) -> None:
    """One eager forward on the batch, so that a model that rejects its inputs says so in one line, before any
    compile."""
    try:
        with torch.no_grad():
            loops.call_model(model, loops.inputs_to(inputs, device))
    except Exception as error:  # noqa: BLE001  (the user's model: its error, in one line)
        raise OptlabError(f"the model rejected inputs of shape {describe_inputs(inputs)}: "
                          f"{describe_error(error)}") from None


def _make_step(batch: tuple[Any, Any], loss_fn: LossFn, device: torch.device,
               inference: bool) -> Callable[[nn.Module], Callable[[], Any]]:
    """A function of a model (eager or compiled) that gives its step on the batch: a forward without gradients, or
    forward, loss and backward (the gradients set to None after; the optimizer's step is not part of what
    compiles)."""
    inputs = loops.inputs_to(batch[0], device)
    targets = batch[1].to(device) if batch[1] is not None else None

    def for_model(module: nn.Module) -> Callable[[], Any]:
        if inference:
            def forward() -> Any:
                with torch.no_grad():
                    return loops.call_model(module, inputs)
            return forward

        def train() -> None:
            loss_fn(loops.call_model(module, inputs), targets).backward()
            for parameter in module.parameters():
                parameter.grad = None
        return train
    return for_model


def _compile_and_time(model_fn: ModelFn, info: DeviceInfo, seed: int, inference: bool, make_step: Callable,
                      calls: int, progress: bool) -> tuple[MachineSetup, FirstStep, FirstStep, Timings]:
    """The machine's setup first (so that the model's compile does not pay it), the model's cold compile (every compile
    cache in a fresh, empty folder, the process's own caches cleared), the warm one (the same folder, its caches on
    disk, the process's own caches cleared), then eager against the warm compiled model in paired rounds."""
    if progress:
        print("the machine's setup (paid by a process's first compile, whatever the model) ...", flush=True)
    setup = MachineSetup(fresh.probe_machine() if info.device.type == "cpu" else 0.0,
                         starts.build_headers(str(info.device), train=not inference)["headers_s"])
    eager = build_model(model_fn, seed).to(info.device).train(not inference)
    firsts = []
    with tempfile.TemporaryDirectory(prefix="optlab-tune-cold-") as folder:
        cache = fresh.CacheFolder(Path(folder))
        for which in ("cold", "warm"):
            with fresh.redirected(cache):
                torch._dynamo.reset()
                compiled = torch.compile(build_model(model_fn, seed).to(info.device).train(not inference))
                before = inductor_counters()
                if progress:
                    print(f"compiling ({which} caches) ...", flush=True)
                firsts.append((_first_step(make_step(compiled), info.device), before, inductor_counters()))
        timings = time_variants({"eager": make_step(eager), "compiled": make_step(compiled)}, rounds=ROUNDS,
                                calls=calls, device=info.device, grad=not inference)
        torch._dynamo.reset()
    median = float(np.median(timings.seconds["compiled"]))
    cold, warm = (FirstStep(seconds, seconds - median, _delta(after, before, "hits"), _delta(after, before, "misses"))
                  for seconds, before, after in firsts)
    return setup, cold, warm, timings


def _delta(after: dict[str, int], before: dict[str, int], kind: str) -> int:
    return sum(after[key] - before[key] for key in after if key.endswith(kind))


def _first_step(step: Callable[[], Any], device: torch.device) -> float:
    import time

    from ..first_step.breaks import synchronize

    start = time.perf_counter()
    with dynamo_log.quiet():
        step()
    synchronize(device)
    return time.perf_counter() - start


def _watch_shapes(model: nn.Module, example: Any, shapes: Sequence[Sequence[int]] | None, data: Any,
                  device: torch.device) -> tuple[Recompiles | None, list[int]]:
    """The recompiles over the given shapes, or over the DataLoader's batches of distinct shapes (None where there is
    only one shape), the dimensions that vary; the recompile limit reached is one error line."""
    batches = _shape_batches(example, shapes, device) if shapes is not None else \
        _loader_shapes(data, device) if isinstance(data, DataLoader) else []
    if len(batches) < 2:
        return None, []
    watched = watch(model, batches)
    sizes = [tuple(loops.input_tensors(batch)[0].shape) for batch in batches]
    varying = [dim for dim in range(len(sizes[0])) if len({size[dim] for size in sizes if len(size) > dim}) > 1]
    if watched.fell_back:
        raise OptlabError(
            f"your {len(batches)} shapes pass the recompile limit (torch._dynamo.config.recompile_limit = "
            f"{watched.limit}): after {watched.count} recompiles the model would run in eager; mark the dimension that "
            f"varies ({', '.join(map(str, varying)) or '?'}) with torch._dynamo.mark_dynamic, or pad to a few sizes")
    return watched, varying


def _shape_batches(example: Any, shapes: Sequence[Sequence[int]], device: torch.device) -> list[Any]:
    """A batch of each per-sample shape, made like the example's one input: random normal floats, or integers below
    the example's largest + 1."""
    check_count("shapes", len(shapes), 1, MAX_SHAPES, "shapes watched for recompiles")
    example, wrap = _one_input(example)
    from .examples import check_shape

    rows, made = len(example), []
    generator = torch.Generator().manual_seed(0)
    for shape in shapes:
        size = (rows, *check_shape(shape))
        if example.is_floating_point():
            made.append(wrap(torch.randn(size, generator=generator, dtype=example.dtype).to(device)))
        else:
            high = int(example.max()) + 1 if example.numel() else 2
            made.append(wrap(torch.randint(0, max(high, 1), size, generator=generator, dtype=example.dtype).to(device)))
    return made


def _one_input(example: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """The example's one input tensor (bare, the only item of a tuple or list, or the only value of a dict of keyword
    inputs) and how to pass another tensor the same way; several inputs are one error line."""
    if isinstance(example, torch.Tensor):
        return example, lambda tensor: tensor
    if isinstance(example, (tuple, list)) and len(example) == 1 and isinstance(example[0], torch.Tensor):
        return example[0], lambda tensor: type(example)([tensor])
    if isinstance(example, dict) and len(example) == 1 and isinstance(next(iter(example.values())), torch.Tensor):
        (name, tensor), = example.items()
        return tensor, lambda other: {name: other}
    count = len(example) if isinstance(example, (tuple, list, dict)) else "not a tensor"
    raise OptlabError(f"shapes= (--shapes) needs a model with one input tensor (given: {count}); for several inputs "
                      "give data= (a DataLoader) instead")


def _loader_shapes(loader: DataLoader, device: torch.device) -> list[Any]:
    """The first batch of each distinct input shape among the DataLoader's first :data:`MAX_LOADER_BATCHES`."""
    seen, batches = set(), []
    for index, batch in enumerate(loader):
        if index >= MAX_LOADER_BATCHES:
            break
        inputs = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
        key = tuple(tuple(tensor.shape) for tensor in loops.input_tensors(inputs))
        if key not in seen:
            seen.add(key)
            batches.append(loops.inputs_to(inputs, device))
        if len(batches) > MAX_SHAPES:
            raise OptlabError(f"the DataLoader gives more than {MAX_SHAPES} input shapes: torch.compile would "
                              "recompile past its limit; pad to a few sizes, or mark the varying dimension dynamic")
    return batches
