"""What Dynamo says while it compiles, caught instead of printed: the graph breaks with their file and line, the
guards that failed before each recompile, and the recompile limit reached.

These are the messages ``TORCH_LOGS="graph_breaks,recompiles"`` prints (``torch._logging``'s artifact loggers). Here
they are turned on for one block of code and kept as records, so that a study can count them and a page can show
them; outside the block the loggers are as they were.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Iterator

BREAKS_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
LIMIT_LOGGER = "torch._dynamo.convert_frame"
ARTIFACTS = ("graph_breaks", "recompiles")
LIMIT_MARK = "hit config.recompile_limit"
WHERE = re.compile(r"Graph break in user code at (?P<file>.+):(?P<line>\d+)")
ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)*[\w.+-]+")
PREAMBLE = ("Graph Break Reason:", "Encountered graph break when attempting to trace")


@dataclass(frozen=True)
class GraphBreak:
    """One graph break as Dynamo logged it: the user's file and line, and the reason's first line."""

    file: str
    line: int
    reason: str


@dataclass
class DynamoLog:
    """The records caught: graph breaks, recompiles (each the guard failures that caused it) and limit warnings."""

    breaks: list[GraphBreak] = field(default_factory=list)
    recompiles: list[str] = field(default_factory=list)
    limits: list[str] = field(default_factory=list)


def relative_paths(message: str) -> str:
    """``message`` with each absolute path of a file that exists written relative to the working folder, as a page
    shows it (no build machine's folders)."""
    return ABSOLUTE_PATH.sub(lambda path: os.path.relpath(path[0]) if os.path.exists(path[0]) else path[0], message)


def break_reason(message: str) -> str:
    """The reason in a graph-break message: its first line that is not the location or Dynamo's preamble."""
    for raw in message.splitlines()[1:]:
        line = raw.strip()
        for prefix in PREAMBLE:
            if line.startswith(prefix):
                line = line[len(prefix):].strip() if prefix == PREAMBLE[0] else ""
        if line and not line.startswith(PREAMBLE[1]):
            return line
    return "(no reason given)"


def parse_break(message: str) -> GraphBreak | None:
    """A graph-break record's location and reason; None for a message of another kind."""
    found = WHERE.search(message)
    if not found:
        return None
    return GraphBreak(found["file"], int(found["line"]), break_reason(message[found.start():]))


def guard_failures(message: str) -> str:
    """A recompile message's failed guards, one per line after "triggered by the following guard failure(s):"."""
    lines = [line.strip() for line in message.splitlines()]
    failed = [line.removeprefix("- ") for line in lines if line.startswith("- ")]
    return "; ".join(failed) or (lines[-1] if lines else "")


class _Catch(logging.Handler):
    def __init__(self, caught: DynamoLog) -> None:
        super().__init__(logging.DEBUG)
        self.caught = caught

    def emit(self, record: logging.LogRecord) -> None:
        message = relative_paths(record.getMessage())
        if record.name == BREAKS_LOGGER:
            found = parse_break(message)
            if found:
                self.caught.breaks.append(found)
        elif record.name == RECOMPILES_LOGGER and "Recompiling" in message:
            self.caught.recompiles.append(guard_failures(message))
        elif record.name == LIMIT_LOGGER and LIMIT_MARK in message:
            self.caught.limits.append(message.splitlines()[0] + " " + " ".join(
                line.strip() for line in message.splitlines()[1:3]))


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Dynamo's own warnings about what it meets (a break's advice, a skipped builtin) kept off the page inside the
    block: a study shows them as rows instead."""
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def caught() -> Iterator[DynamoLog]:
    """Inside the block, Dynamo's graph-break, recompile and recompile-limit messages are kept in the
    ``DynamoLog`` it yields and not printed; each logger's level, handlers and propagation are put back after."""
    from torch._logging._internal import log_state  # the switch that TORCH_LOGS="recompiles" sets

    log = DynamoLog()
    handler = _Catch(log)
    added = {name for name in ARTIFACTS if not log_state.is_artifact_enabled(name)}
    for name in added:
        log_state.enable_artifact(name)
    saved = []
    for name in (BREAKS_LOGGER, RECOMPILES_LOGGER, LIMIT_LOGGER):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        logger.addHandler(handler)
    try:
        with quiet():
            yield log
    finally:
        for logger, level, propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        log_state.artifact_names.difference_update(added)
