"""Shapes that change: one stream of batches of varying length and size through each way of running it.

The ways (``STRATEGIES``), forward passes (serving) only, each from empty compile caches (Dynamo reset, and
Inductor's ``fresh_cache``: a new cache folder and its in-memory caches cleared), so that none reuses another's
kernels; Inductor's precompiled C++ headers, which it keeps for the machine on purpose, are built once before the
first (``starts.build_headers``):

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


CPU_STREAM = Stream()
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


def stream_run(model: GPT, strategy: str, setup: Stream, passes: int = 5) -> dict[str, Any]:
    """Run the stream through ``model`` once (where the compiles happen) and then ``passes`` more, timed, from empty
    compile caches; the graphs compiled, the cache hits and misses, the tokens and padded tokens, and the largest
    difference of the real tokens' logits from eager's."""
    if strategy not in STRATEGIES:
        raise choice_error("strategy", strategy, STRATEGIES)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(setup.seed)
    batches = [torch.randint(0, setup.vocab_size, shape, generator=generator).to(device) for shape in setup.shapes()]
    padded = strategy in (BUCKETS, GRAPHS)
    torch._dynamo.reset()
    graphs_before, counts_before = compiler.compiled_graphs(), compiler.cache_counts()
    run = model if strategy == EAGER else torch.compile(
        model, dynamic=False if padded else None, mode="reduce-overhead" if strategy == GRAPHS else None)

    def one_pass() -> list[torch.Tensor]:
        outs = []
        for x in batches:
            n, t = x.shape
            if padded:
                x = torch.nn.functional.pad(x, (0, setup.bucket(t) - t, 0, setup.max_batch - n))
            elif strategy == MARKED:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(x, 1)
            if strategy == GRAPHS:  # a new step: the graph's replay may reuse the memory of its last outputs
                torch.compiler.cudagraph_mark_step_begin()
            outs.append(run(x)[:n, :t].clone())  # kept apart, as a server copies each answer out
        if device.type == "cuda":
            torch.cuda.synchronize()
        return outs

    with torch.no_grad(), fresh_cache():
        started = time.perf_counter()
        outs = one_pass()
        first = time.perf_counter() - started
        graphs = compiler.compiled_graphs() - graphs_before
        times = []
        for _ in range(passes):
            started = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - started)
        difference = max(float((out.float() - model(x).float()).abs().max()) for out, x in zip(outs, batches))
    counts = {name: value - counts_before[name] for name, value in compiler.cache_counts().items()}
    real = sum(n * t for n, t in setup.shapes())
    padded_tokens = sum(setup.max_batch * setup.bucket(t) for _, t in setup.shapes()) if padded else real
    return {"strategy": strategy, "status": "ok", "first_pass_s": first, "pass_times_s": times, "graphs": graphs,
            "graphs_after": compiler.compiled_graphs() - graphs_before, "cache_hits": counts["cache hits"],
            "cache_misses": counts["cache misses"], "tokens": real, "padded_tokens": padded_tokens - real,
            "max_logit_diff": difference}


def run_shapes(stream: Stream, passes: int = 5) -> pd.DataFrame:
    """Every strategy this device can run, in this process, from empty compile caches: one row each (a strategy
    that needs a CUDA GPU, on a CPU, is a row that says "not run")."""
    check_count("passes", passes, 2, MAX_PASSES, "timed passes of the stream per strategy")
    info = resolve_device()
    torch.manual_seed(stream.seed)
    model = GPT(GPTConfig(vocab_size=stream.vocab_size, block_size=stream.buckets[-1], n_layer=stream.n_layer,
                          n_head=stream.n_head, n_embd=stream.n_embd)).to(info.device).eval()
    rows = []
    for strategy in STRATEGIES:
        if strategy in NEEDS_CUDA and not info.is_cuda:
            rows.append({"strategy": strategy, "status": "not run: CUDA graphs need a CUDA GPU"})
        else:
            rows.append(stream_run(model, strategy, stream, passes))
    return pd.DataFrame(rows)


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
