"""Graph breaks: where Dynamo stops tracing, found, located and timed.

A graph break is a place in ``forward`` that Dynamo cannot put in a graph: it compiles the code before it, runs the
break in plain Python, and starts a new graph after it. Each break costs a return to Python, a guard check and a
graph launch per call, and cuts the fusion that Inductor could do across it. :func:`find_breaks` compiles one call
with Dynamo alone and gives one row per break, from Dynamo's own graph-break messages (``TORCH_LOGS=graph_breaks``):
its reason and the file and line of the user's code;
:class:`TokenModel` is a small token model whose ``forward`` holds the five common breaks, each one switchable, so
that the same arithmetic can be compiled with and without them; :func:`time_variants` times them against eager.
"""
from __future__ import annotations

import io
import linecache
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch  # not torch._dynamo: torch imports it on first use (torch._dynamo.reset()), not at every process start
from torch import nn

from ...core.errors import OptlabError
from ...core.knobs.limits import check_count
from ...core.measuring.loops import call_model
from ...core.measuring.timing import INTERVAL, SpeedUp, speed_up
from ...core.stats.sequential import visit_order
from . import dynamo_log

BREAKS = ("item", "branch", "print", "numpy", "builtin")
BREAK_CAUSES = {  # what each break is, in the words a reader would search for
    "item": "`.item()` turns a tensor into a Python number",
    "branch": "an `if` on a tensor's value: the next line depends on data",
    "print": "`print` inside forward",
    "numpy": "a NumPy call on a tensor's values",
    "builtin": "a C builtin Dynamo cannot trace (`time.perf_counter`)",
}
MAX_ROUNDS, MAX_CALLS = 200, 10_000
BREAK_COLUMNS = ["break", "reason", "where", "line"]
LOG = io.StringIO()  # where the model's print writes: the break is the call, not what it prints


class Block(nn.Module):
    """A pre-norm residual MLP block, as in a transformer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TokenModel(nn.Module):
    """Token ids ``[batch, length]`` to next-token logits, through ``depth`` blocks; between the first block and the
    rest, the breaks named in ``breaks`` (any of ``BREAKS``). With none the arithmetic is the same, written the
    way Dynamo can trace it."""

    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 2, breaks: tuple[str, ...] = BREAKS) -> None:
        super().__init__()
        unknown = sorted(set(breaks) - set(BREAKS))
        if unknown:
            raise OptlabError(f"unknown breaks {unknown}: the breaks are {', '.join(BREAKS)}")
        self.breaks = frozenset(breaks)
        self.embed, self.norm, self.head = nn.Embedding(vocab, width), nn.LayerNorm(width), nn.Linear(width, vocab)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.embed(tokens))
        if "print" in self.breaks:
            print("first block done", file=LOG)
        if "item" in self.breaks:
            x = x / (1.0 + x.abs().mean().item())
        else:
            x = x / (1.0 + x.abs().mean())
        if "branch" in self.breaks:
            if x.mean() > 0:
                x = x - x.mean()
        else:
            x = torch.where(x.mean() > 0, x - x.mean(), x)
        if "numpy" in self.breaks:
            x = x * float(np.tanh(np.asarray(x.detach().cpu()).std()))  # NumPy reads host memory only
        else:
            x = x * torch.tanh(x.detach().std(correction=0))
        if "builtin" in self.breaks:
            self.seconds = time.perf_counter()
        for block in self.blocks[1:]:
            x = block(x)
        return self.head(self.norm(x))


@dataclass
class Breaks:
    """What one traced call showed: graphs, breaks (one row each: reason, file:line, source), and the operations
    Dynamo put in graphs."""

    graphs: int
    table: pd.DataFrame
    ops: int
    skipped: str = ""  # where no graph was made: why Dynamo stopped

    @property
    def count(self) -> int:
        return len(self.table)

    def describe(self) -> str:
        """One line: how many graphs and breaks, or that nothing could be traced."""
        if self.graphs == 0:
            return "no graph: Dynamo could not trace any of forward, and a compiled model would run it all in eager"
        return (f"{self.graphs} graph{'s' * (self.graphs != 1)}, {self.count} graph break{'s' * (self.count != 1)}, "
                f"{self.ops} operations traced")


def reason_line(reason: str) -> str:
    """A break's reason, in its first line (Dynamo's reasons go on with explanations and links)."""
    return reason.strip().splitlines()[0] if reason.strip() else "(no reason given)"


def break_kind(reason: str, line: str) -> str:
    """Which of ``BREAKS`` a break is, judged from Dynamo's reason and the source line ('other' if none)."""
    text = f"{reason} {line}"
    for kind, marks in (("item", (".item()",)), ("print", ("print",)), ("numpy", ("np.", "numpy")),
                        ("builtin", ("marked as skipped", "perf_counter", "time.")),
                        ("branch", ("generic_jump", "data-dependent", "if "))):
        if any(mark in text for mark in marks):
            return kind
    return "other"


def find_breaks(model: Callable, inputs: Any) -> Breaks:
    """Every graph break Dynamo meets in one call of ``model`` on ``inputs`` (a tensor, a tuple of positional ones or
    a dict of keyword ones), in order: which of
    ``BREAKS`` it is, its reason, where it is in the user's code (``file:line``) and that line; with the graphs
    and operations traced. The call is compiled with the ``eager`` backend (Dynamo alone: the breaks are Dynamo's, and
    no kernel is built), after a reset, so that it is traced afresh."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before, stopped = dict(counters["stats"]), dict(counters["unimplemented"])
    with dynamo_log.caught() as log, torch.no_grad():
        call_model(torch.compile(model, backend="eager"), inputs)
    rows = [{"break": break_kind(found.reason, source_line(found.file, found.line)), "reason": found.reason,
             "where": f"{os.path.relpath(found.file)}:{found.line}", "line": source_line(found.file, found.line)}
            for found in log.breaks]
    torch._dynamo.reset()
    skipped = [reason_line(reason) for reason, count in counters["unimplemented"].items()
               if count > stopped.get(reason, 0)]
    return Breaks(counters["stats"]["unique_graphs"] - before.get("unique_graphs", 0),
                  pd.DataFrame(rows, columns=BREAK_COLUMNS),
                  counters["stats"]["calls_captured"] - before.get("calls_captured", 0), "; ".join(skipped))


def source_line(path: str, lineno: int) -> str:
    """Line ``lineno`` of the file at ``path``, stripped ('' where it cannot be read)."""
    return linecache.getline(path, lineno).strip()


def counted_breaks() -> dict[str, int]:
    """Dynamo's own tally, in this process, of what it could not trace, by the first line of each reason:
    ``torch._dynamo.utils.counters["graph_break"]`` (calls it could not trace) and ``["unimplemented"]`` (where it
    stopped otherwise: a branch on a tensor's value counts there); the recompile limit is left out."""
    from torch._dynamo.utils import counters

    tally: dict[str, int] = {}
    for kind in ("graph_break", "unimplemented"):
        for reason, count in counters[kind].items():
            if "recompile limit" not in reason.lower():
                tally[reason_line(reason)] = tally.get(reason_line(reason), 0) + count
    return tally


@dataclass
class Timings:
    """Each variant's mean call time per round, and how many slots after the first variant it ran in each round."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    shifts: dict[str, list[int]] = field(default_factory=dict)
    first_call_s: dict[str, float] = field(default_factory=dict)

    def speed_up(self, baseline: str, label: str) -> SpeedUp:
        """``label``'s speed-up over ``baseline``, paired by round (the book's interval and verdict)."""
        shifts = [a - b for a, b in zip(self.shifts[label], self.shifts[baseline])]
        return speed_up(self.seconds[baseline], self.seconds[label], shifts)

    def table(self, baseline: str) -> pd.DataFrame:
        """One row per variant: median and spread (IQR) of its call, its first call (where it compiled), and its
        speed-up over ``baseline`` with the interval's ends and the verdict."""
        rows = []
        for label, seconds in self.seconds.items():
            q1, median, q3 = np.percentile(seconds, [25, 50, 75])
            row = {"variant": label, "ms per call": 1e3 * median, "spread ms (IQR)": 1e3 * (q3 - q1),
                   "first call s": self.first_call_s[label], "rounds": len(seconds)}
            if label == baseline:
                rows.append(row | {"speed-up": 1.0, "low": np.nan, "high": np.nan, "verdict": "reference"})
                continue
            gain = self.speed_up(baseline, label)
            rows.append(row | {"speed-up": gain.ratio, "low": gain.low, "high": gain.high, "verdict": gain.verdict})
        return pd.DataFrame(rows).set_index("variant").round(4)

    def speedups(self, baseline: str, model: str) -> pd.DataFrame:
        """The speed-ups over ``baseline`` as tidy rows, in the columns ``optlab.book.report`` plots."""
        table = self.table(baseline).drop(index=baseline)
        return pd.DataFrame({"model": model, "phase": f"forward ({INTERVAL})", "variant": table.index,
                             "source": "live", "speedup": table["speed-up"], "ci_low": table["low"],
                             "ci_high": table["high"], "verdict": table["verdict"], "role": None,
                             "versus": baseline}).reset_index(drop=True)


def time_variants(variants: dict[str, Callable[[], Any]], rounds: int = 10, calls: int = 20,
                  device: torch.device | str = "cpu", grad: bool = False) -> Timings:
    """Each variant (a function of no arguments: one forward, or with ``grad`` one that runs its own backward) called
    once, timed apart (its first call is where it compiles), then ``calls`` calls per visit, the variants visited in
    mirrored rounds; on a GPU the clock is read after a synchronize."""
    check_count("rounds", rounds, 2, MAX_ROUNDS, "an interval needs two rounds; more only narrow it")
    check_count("calls", calls, 1, MAX_CALLS, "calls timed per visit")
    timings, labels = Timings(), list(variants)
    with dynamo_log.quiet(), torch.set_grad_enabled(grad):
        for label, call in variants.items():
            start = time.perf_counter()
            call()
            synchronize(device)
            timings.first_call_s[label] = time.perf_counter() - start
        for round_index in range(rounds):
            order = visit_order(labels, round_index)
            for slot, label in enumerate(order):
                start = time.perf_counter()
                for _ in range(calls):
                    variants[label]()
                synchronize(device)
                timings.seconds.setdefault(label, []).append((time.perf_counter() - start) / calls)
                timings.shifts.setdefault(label, []).append(slot)
    return timings


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class ChapterPlan:
    """The chapter's sizes: the token model, the batch, and the timing's rounds and calls."""

    vocab: int
    width: int
    depth: int
    batch: int
    length: int
    rounds: int
    calls: int

    def describe(self) -> str:
        return (f"token model: vocabulary {self.vocab}, width {self.width}, {self.depth} blocks; batches of "
                f"{self.batch} x {self.length} tokens; {self.rounds} rounds of {self.calls} calls")


def chapter_plan(cuda: bool) -> ChapterPlan:
    """GPT-2 small's width on a GPU; on a CPU a model small enough that Inductor compiles it within the page's time."""
    if cuda:
        return ChapterPlan(vocab=50_304, width=768, depth=4, batch=16, length=256, rounds=12, calls=20)
    return ChapterPlan(vocab=256, width=64, depth=2, batch=8, length=32, rounds=10, calls=20)
