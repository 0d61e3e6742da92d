"""Recompiles: which guard failed each time a compiled function compiled again, and the limit past which Dynamo
stops compiling and runs the function in eager, with no more than one warning.

Dynamo guards every graph it compiles (a shape, a dtype, a Python value it read); a call whose inputs fail every
cached graph's guards compiles a new one. :func:`watch` calls a compiled function on a list of inputs and returns,
call by call, the graphs compiled and the guard failure that caused each recompile (``TORCH_LOGS=recompiles``'s
messages, caught by :mod:`.dynamo_log`), and whether the recompile limit (``torch._dynamo.config.recompile_limit``)
was reached: from there on the function runs in eager, and the only trace is one warning.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pandas as pd
import torch  # not torch._dynamo: torch imports it on first use (torch._dynamo.reset()), not at every process start

from ...core.errors import OptlabError
from ...core.knobs.limits import check_count
from ...core.measuring.loops import call_model
from . import dynamo_log

MAX_CALLS = 1_000
GUARD_COMMENT = re.compile(r"\s+#\s*(?P<source>.*?)\s+#\s+(?P<where>\S+:\d+) in \S+$")  # "  # if x > 1:  # f.py:9 in fn"
GRAPH_NUMBER = re.compile(r"^\d+/\d+:\s*")  # "0/3: ": the frame's and the graph's numbers
HINT = re.compile(r"\s*\(HINT:.*$", re.DOTALL)  # Dynamo's advice after a guard: the report gives its own
USER_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
REFUSED, EAGER_PAST = "in eager: refused at the limit", "in eager: the limit was reached"
CALL_COLUMNS = ["call", "input", "graphs so far", "recompiled", "guard that failed", "ran"]


@dataclass
class Recompiles:
    """What :func:`watch` saw: one row per call, each recompile's failed guards (a recompile refused at the limit
    included), and the limit warning if any."""

    calls: pd.DataFrame
    reasons: list[str]
    limit_warnings: list[str]
    limit: int

    @property
    def count(self) -> int:
        """Recompiles as Dynamo counts them: the calls that compiled again (a call refused at the limit compiled
        nothing)."""
        return int(self.calls["recompiled"].sum())

    @property
    def fell_back(self) -> bool:
        """Whether the recompile limit was reached: later calls ran in eager."""
        return bool(self.limit_warnings)

    def describe(self) -> str:
        """One line: graphs compiled, recompiles, and the fall-back to eager if it happened."""
        graphs = int(self.calls["graphs so far"].iloc[-1]) if len(self.calls) else 0
        line = (f"{len(self.calls)} calls: {graphs} graph{'s' * (graphs != 1)} compiled, {self.count} "
                f"recompile{'s' * (self.count != 1)}")
        if self.fell_back:
            refused = self.calls.index[self.calls["ran"] == REFUSED]
            which = f"call {self.calls['call'][refused[0]]}" if len(refused) else "a call"
            line += (f"; {which} failed every graph's guards, and at the recompile limit ({self.limit}) Dynamo "
                     "refused to compile it: that call and every later one ran in eager. Dynamo's warning: "
                     + self.limit_warnings[0])
        return line


def describe_input(value: Any) -> str:
    """An input as a reader recognises it: a tensor's shape and dtype, else the value's repr (cut short)."""
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return ", ".join(describe_input(item) for item in value)
    return repr(value)[:40]


def first_guard(failures: str) -> str:
    """The guard that failed against the newest cached graph (the first of a recompile's failures), without Dynamo's
    graph number and advice (its ``HINT``). Where Dynamo comments it with the source line it guards, that line and the
    user's file and line are put after the check: the file from the failure's stack, whole (Dynamo's comment cuts a
    long path to its last characters)."""
    first = HINT.sub("", GRAPH_NUMBER.sub("", failures.split("; ")[0].strip(), count=1))
    comment = GUARD_COMMENT.search(first)
    if comment is None:
        return first
    frame = USER_FRAME.search(failures)
    where = f"{frame['file']}:{frame['line']}" if frame else comment["where"]
    return f"{first[:comment.start()].strip()} (`{comment['source']}` at {where})"


def watch(fn: Callable, inputs: Sequence[Any], **compile_options: Any) -> Recompiles:
    """``torch.compile(fn, **compile_options)`` called on each of ``inputs`` in turn (a tuple is unpacked into
    arguments, a dict into keyword arguments), after a reset of Dynamo's caches: per call, the graphs compiled so far
    and the guard failure that made it compile again. ``backend`` defaults to ``"eager"``: the guards are Dynamo's,
    and no kernel is built."""
    from torch._dynamo.utils import counters

    check_count("calls", len(inputs), 1, MAX_CALLS, "inputs watched in one go")
    torch._dynamo.reset()
    compiled = torch.compile(fn, **({"backend": "eager"} | compile_options))
    start, rows = counters["stats"]["unique_graphs"], []
    with dynamo_log.caught() as log, torch.no_grad():
        for index, value in enumerate(inputs):
            seen, limits = len(log.recompiles), len(log.limits)
            call_model(compiled, value)
            new, refused = log.recompiles[seen:], len(log.limits) > limits  # refused: Dynamo logged why, built none
            rows.append({"call": index, "input": describe_input(value),
                         "graphs so far": counters["stats"]["unique_graphs"] - start,
                         "recompiled": bool(new) and not refused,
                         "guard that failed": first_guard(new[0]) if new else "",
                         "ran": REFUSED if refused else EAGER_PAST if log.limits else "compiled"})
    torch._dynamo.reset()
    return Recompiles(pd.DataFrame(rows, columns=CALL_COLUMNS), log.recompiles, log.limits,
                      torch._dynamo.config.recompile_limit)


def recompile_error(fn: Callable, first: Any, second: Any) -> str:
    """The error that ``torch.compiler.set_stance("fail_on_recompile")`` raises when ``second`` would make the
    compiled ``fn`` compile again after ``first``; '' when it does not. The stance is what a test can hold a model to:
    no recompile after the warm-up."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager")
    with dynamo_log.quiet(), torch.no_grad():
        compiled(first)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                compiled(second)
        except Exception as error:  # noqa: BLE001  (the stance's error is the answer)
            return f"{type(error).__name__}: {dynamo_log.relative_paths(str(error).strip().splitlines()[0])}"
        finally:
            torch._dynamo.reset()
    return ""


def sequence_lengths(lengths: Sequence[int], batch: int = 4, vocab: int = 256) -> list[torch.Tensor]:
    """Token batches of ``batch`` rows, one per length in ``lengths``: the stream of a data set whose sequences
    differ in length."""
    if not lengths:
        raise OptlabError("give at least one sequence length")
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, check_count("length", length, 1, 65_536, "tokens a sequence")),
                          generator=generator) for length in lengths]
