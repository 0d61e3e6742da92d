"""Shapes that change: one stream of batches of varying length and size through each way of running it.

The ways (``STRATEGIES``), forward passes (serving) only, each compiled from empty compile caches (Inductor's
``fresh_cache``: a new cache folder and its in-memory caches cleared; each strategy's graphs on an entry point of its
own), so that none reuses another's kernels, then timed in rounds, each round one pass of every strategy; Inductor's
precompiled C++ headers, which it keeps for the machine on purpose, are built once before the first
(``starts.build_headers``):

- ``eager``;
- ``automatic dynamic``: ``torch.compile`` as it comes; the first shape compiles a static graph, the first change
  recompiles once with the changed sizes symbolic;
- ``mark_dynamic``: sizes marked dynamic on every batch (``torch._dynamo.mark_dynamic``), one symbolic graph from the
  start;
- ``buckets, dynamic=False``: every batch padded up to the next bucket (length) and to the largest batch, one static
  graph per bucket; the padded tokens are wasted work;
- ``CUDA graphs per bucket``: the same with ``mode="reduce-overhead"``, a graph captured per bucket (a CUDA GPU only).

Padding goes on the right: with causal attention no real token attends to a pad, so the real tokens' logits are
eager's (the page checks it).
"""
from __future__ import annotations

import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from torch._inductor.utils import fresh_cache

from ...core.errors import choice_error
from ...core.gpt.transformer import GPT, GPTConfig
from ...core.knobs.limits import check_count
from ...core.results import store
from ...core.machine import compiler
from ...core.machine.device import resolve_device
from ...core.measuring.timing import CONFIDENCE, INTERVAL, interval_text, speed_up
from ...core.stats.sequential import visit_order

EAGER, AUTOMATIC, MARKED, BUCKETS, GRAPHS = ("eager", "automatic dynamic", "mark_dynamic", "buckets, dynamic=False",
                                             "CUDA graphs per bucket")
STRATEGIES = (EAGER, AUTOMATIC, MARKED, BUCKETS, GRAPHS)
NEEDS_CUDA = (GRAPHS,)
MAX_BATCHES, MAX_PASSES = 500, 50


@dataclass(frozen=True)
class Stream:
    """A stream's sizes: ``batches`` batches of 2 to ``max_batch`` sequences of ``min_len`` to the model's block of
    tokens, drawn from ``seed``; ``buckets`` the padded lengths (the last is the block); and the GPT's sizes."""

    batches: int = 24
    max_batch: int = 4
    min_len: int = 5
    buckets: tuple[int, ...] = (16, 32)
    n_layer: int = 2
    n_embd: int = 16
    n_head: int = 1
    vocab_size: int = 65
    seed: int = 0

    def __post_init__(self) -> None:
        check_count("batches", self.batches, 1, MAX_BATCHES, "the stream is run several times in each process")
        if list(self.buckets) != sorted(set(self.buckets)) or self.min_len > self.buckets[-1]:
            raise ValueError(f"buckets must rise and reach min_len {self.min_len}: {self.buckets}")

    def shapes(self) -> list[tuple[int, int]]:
        """Each batch's (sequences, tokens per sequence)."""
        rng = np.random.default_rng(self.seed)
        return [(int(rng.integers(2, self.max_batch + 1)), int(rng.integers(self.min_len, self.buckets[-1] + 1)))
                for _ in range(self.batches)]

    def bucket(self, length: int) -> int:
        """The padded length of a sequence of ``length`` tokens."""
        return next(b for b in self.buckets if b >= length)


CPU_STREAM = Stream(n_layer=1)  # one block: a change of shape recompiles the same at any depth, and a CPU builds the
# five graphs of one block in about two thirds of two blocks' seconds
GPU_STREAM = Stream(batches=64, max_batch=8, min_len=64, buckets=(128, 256, 512, 1024), n_layer=12, n_embd=768,
                    n_head=12, vocab_size=50304)


SMOKE_GPU_STREAM = Stream(batches=24, max_batch=4, min_len=16, buckets=(32, 64, 128), n_layer=2, n_embd=128, n_head=2,
                          vocab_size=512)


def chapter_stream(cuda: bool, profile: str) -> tuple[Stream, int]:
    """Chapter 36's stream and timed passes: GPT-2 small's on a GPU (a small GPT's in the ``smoke`` profile, a check
    of the GPU's code path: CUDA graphs per bucket included), the CPU's small one on a CPU."""
    if cuda:
        return (SMOKE_GPU_STREAM, 5) if profile == "smoke" else (GPU_STREAM, 10)
    return CPU_STREAM, 5


def own_entry(model: GPT, strategy: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that calls ``model``, with a code object of its own for ``strategy``. Dynamo keeps its graphs, their
    guards, the recompile count and what automatic dynamic shapes learned by the code object it compiles, so
    strategies compiled side by side in one process neither find nor check one another's graphs."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    code = forward.__code__.replace(co_name=f"forward_{STRATEGIES.index(strategy)}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)


class StreamRun:
    """One strategy over the stream: :meth:`first_pass` compiles it from empty compile caches (where its graphs are
    built), :meth:`timed_pass` runs the stream once more, timed; :meth:`row` says what happened. The strategies share
    one process, so their passes can be timed in rounds."""

    def __init__(self, model: GPT, strategy: str, setup: Stream) -> None:
        if strategy not in STRATEGIES:
            raise choice_error("strategy", strategy, STRATEGIES)
        self.model, self.strategy, self.setup = model, strategy, setup
        self.device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(setup.seed)
        self.batches = [torch.randint(0, setup.vocab_size, shape, generator=generator).to(self.device)
                        for shape in setup.shapes()]
        self.padded = strategy in (BUCKETS, GRAPHS)
        self.run = model if strategy == EAGER else torch.compile(
            own_entry(model, strategy), dynamic=False if self.padded else None,
            mode="reduce-overhead" if strategy == GRAPHS else None)
        self.times: list[float] = []
        self.late_graphs, self.found = 0, {}

    def one_pass(self) -> list[torch.Tensor]:
        """Every batch of the stream through the strategy, prepared as the strategy says; each answer's real tokens
        kept."""
        outs = []
        for x in self.batches:
            n, t = x.shape
            if self.padded:
                x = torch.nn.functional.pad(x, (0, self.setup.bucket(t) - t, 0, self.setup.max_batch - n))
            elif self.strategy == MARKED:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(x, 1)
            if self.strategy == GRAPHS:  # a new step: the graph's replay may reuse the memory of its last outputs
                torch.compiler.cudagraph_mark_step_begin()
            outs.append(self.run(x)[:n, :t].clone())  # kept apart, as a server copies each answer out
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return outs

    def first_pass(self) -> None:
        """The stream once, from empty compile caches (Inductor's ``fresh_cache``): the compiles happen here; its
        seconds, graphs, cache hits and misses, and the largest difference of the real tokens' logits from eager's."""
        graphs, counts = compiler.compiled_graphs(), compiler.cache_counts()
        with torch.no_grad(), fresh_cache():
            started = time.perf_counter()
            outs = self.one_pass()
            first = time.perf_counter() - started
            difference = max(float((out.float() - self.model(x).float()).abs().max())
                             for out, x in zip(outs, self.batches))
        self.found = {"first_pass_s": first, "graphs": compiler.compiled_graphs() - graphs, "max_logit_diff": difference,
                      **{key.replace(" ", "_"): value - counts[key] for key, value in compiler.cache_counts().items()
                         if key in ("cache hits", "cache misses")}}

    def timed_pass(self) -> None:
        """The stream once more, timed; any graph compiled meanwhile is counted (there should be none)."""
        graphs = compiler.compiled_graphs()
        with torch.no_grad():
            started = time.perf_counter()
            self.one_pass()
            self.times.append(time.perf_counter() - started)
        self.late_graphs += compiler.compiled_graphs() - graphs

    def row(self) -> dict[str, Any]:
        """The graphs compiled (first pass, and after it with the timed passes), the cache hits and misses, the
        tokens and padded tokens, the passes' seconds."""
        real = sum(n * t for n, t in self.setup.shapes())
        padded = sum(self.setup.max_batch * self.setup.bucket(t) for _, t in self.setup.shapes()) if self.padded \
            else real
        return {"strategy": self.strategy, "status": "ok", **self.found, "pass_times_s": self.times,
                "graphs_after": self.found["graphs"] + self.late_graphs, "tokens": real, "padded_tokens": padded - real}


def stream_run(model: GPT, strategy: str, setup: Stream, passes: int = 5) -> dict[str, Any]:
    """One strategy alone: the stream through ``model`` once (where the compiles happen, from empty compile caches)
    and then ``passes`` more, timed (:class:`StreamRun`'s row)."""
    torch._dynamo.reset()
    run = StreamRun(model, strategy, setup)
    run.first_pass()
    for _ in range(passes):
        run.timed_pass()
    return run.row()


def run_shapes(stream: Stream, passes: int = 5) -> pd.DataFrame:
    """Every strategy this device can run, in this process: each compiled from empty compile caches in its first
    pass, then the timed passes in rounds, each round one pass of every strategy (the order turned round by round,
    ``visit_order``), so that a pass is paired with eager's of the same round. One row each (a strategy that needs a
    CUDA GPU, on a CPU, is a row that says "not run"). Each strategy compiles its own entry point (:func:`own_entry`),
    so their graphs stay apart."""
    check_count("passes", passes, 2, MAX_PASSES, "timed passes of the stream per strategy")
    info = resolve_device()
    torch.manual_seed(stream.seed)
    model = GPT(GPTConfig(vocab_size=stream.vocab_size, block_size=stream.buckets[-1], n_layer=stream.n_layer,
                          n_head=stream.n_head, n_embd=stream.n_embd)).to(info.device).eval()
    runs, skipped = {}, []
    torch._dynamo.reset()
    for strategy in STRATEGIES:
        if strategy in NEEDS_CUDA and not info.is_cuda:
            skipped.append({"strategy": strategy, "status": "not run: CUDA graphs need a CUDA GPU"})
            continue
        runs[strategy] = StreamRun(model, strategy, stream)
        runs[strategy].first_pass()
    for round_index in range(passes):
        for strategy in visit_order(list(runs), round_index):
            runs[strategy].timed_pass()
    torch._dynamo.reset()
    return pd.DataFrame([run.row() for run in runs.values()] + skipped)


def shape_table(rows: pd.DataFrame, confidence: float = CONFIDENCE) -> pd.DataFrame:
    """One row per strategy: graphs compiled, compile seconds (the first pass minus a steady pass), padded tokens
    wasted, tokens/s and the speed-up over eager, paired by pass, with its interval and verdict."""
    ok = rows[rows["status"] == "ok"].set_index("strategy")
    eager = np.asarray(ok.loc[EAGER, "pass_times_s"])
    out = []
    for strategy, row in rows.set_index("strategy").iterrows():
        if row["status"] != "ok":
            out.append({"strategy": strategy, "verdict": row["status"]})
            continue
        times = np.asarray(row["pass_times_s"])
        rate = speed_up(eager, times, confidence=confidence)
        out.append({"strategy": strategy, "graphs": int(row["graphs"]),
                    "compile s": row["first_pass_s"] - float(np.median(times)),
                    "padded tokens": int(row["padded_tokens"]),
                    "wasted %": 100 * row["padded_tokens"] / (row["tokens"] + row["padded_tokens"]),
                    "tokens/s": row["tokens"] / float(np.median(times)), "speed-up": rate.ratio,
                    INTERVAL: "" if strategy == EAGER else interval_text(rate.low, rate.high, len(times)),
                    "low": rate.low, "high": rate.high, "verdict": "baseline" if strategy == EAGER else rate.verdict})
    return pd.DataFrame(out).set_index("strategy")


def run_reference(out: "str | Path", device: str = "cuda") -> list[Path]:
    """The chapter's GPU measurement: GPT-2 small's stream through every strategy, CUDA graphs per bucket included,
    saved under ``out`` as ``changing-shapes.csv``."""
    table = shape_table(run_shapes(GPU_STREAM, passes=10))
    path = store.writable_dir(out) / "changing-shapes.csv"
    store.atomic_write_text(path, table.reset_index().to_csv(index=False))
    return [path]
