"""torch.compile on one part of the GPT, forward and backward: a check small enough for a CPU.

Compiling the whole GPT's training step costs tens of seconds of Inductor's C++ compilation on a CPU. One block (the
unit the GPT repeats: LayerNorm, causal self-attention, LayerNorm, MLP, two residual adds), or only its MLP (a matmul,
GELU, a matmul), compiles the same kinds of kernels in a fraction of that. Eager and compiled copies of the part, from
the same weights, each take a first step (where the compiled one compiles) and then alternate timed steps on the same
input; the loss is a stand-in, the mean square of the part's output. The result is a run record in the shape
:mod:`optlab.studies.kernels.compile_cost` reads, so the compile time, the saving per step and the break-even step count come
from the same code as a full run's.
"""
from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from ...core.machine import compiler
from ...core.machine.device import resolve_device
from ...core.errors import choice_error
from ...core.gpt import build_gpt
from ...core.knobs.limits import check_count
from ...core.process.quiet import fix_threads
from ...core.workload import get_workload

MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
PARTS = ("block", "mlp")
MAX_STEPS = 1000  # timed steps per variant: a block's step takes milliseconds
MAX_BATCH = 256
EAGER, COMPILED = "eager", "compile {mode}"


def _step(module: nn.Module, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """One forward and backward of ``module`` on ``x``: its seconds (device work included) and its loss."""
    module.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = module(x).float().square().mean()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, float(loss.detach())


def block_compile_record(model: str = "gpt_tiny", part: str = "block", batch_size: int = 8, steps: int = 10,
                         mode: str = "default", device: str = "auto", seed: int = 0,
                         backend: str = "inductor") -> dict[str, Any]:
    """Eager against ``torch.compile(mode=mode, backend=backend)`` on ``part`` ("block", or its "mlp") of the first
    block of ``model``: a first step each (the compiled one compiles there), then ``steps`` timed steps each,
    alternating; returned as a run record (baseline eager). ``backend`` other than Inductor is for tests."""
    if mode not in MODES:
        raise choice_error("compile mode", mode, MODES)
    if part not in PARTS:
        raise choice_error("part", part, PARTS)
    steps = check_count("steps", steps, 1, MAX_STEPS, "a block's step takes milliseconds; a few dozen tell")
    batch_size = check_count("batch_size", batch_size, 1, MAX_BATCH, "one block of a small GPT")
    info = resolve_device(device)
    fix_threads(info.is_cuda)
    torch.manual_seed(seed)
    gpt = build_gpt(model).to(info.device)
    x = torch.randn(batch_size, gpt.config.block_size, gpt.config.n_embd, device=info.device)
    part_module = gpt.blocks[0] if part == "block" else gpt.blocks[0].mlp
    compiled = torch.compile(copy.deepcopy(part_module), backend=backend,
                             mode=None if mode == "default" or backend != "inductor" else mode)
    modules = {EAGER: part_module, COMPILED.format(mode=mode): compiled}
    runs = {}
    for label, module in modules.items():
        graphs, cache = compiler.compiled_graphs(), compiler.cache_counts()
        seconds, loss = _step(module, x, info.device)
        after = compiler.cache_counts()
        runs[label] = {"warmup_times_s": [seconds], "warmup_losses": [loss], "step_times_s": [],
                       "graphs_compiled": compiler.compiled_graphs() - graphs,
                       "inductor_cache": compiler.cache_state(after["cache hits"] - cache["cache hits"],
                                                              after["cache misses"] - cache["cache misses"])}
    for _ in range(steps):
        for label, module in modules.items():
            runs[label]["step_times_s"].append(_step(module, x, info.device)[0])
    epoch = get_workload("gpt").train_size  # the corpus's training sequences: the "epochs" of the payoff
    samples = [{"status": "ok", "model": model, "phase": "train", "variant": label, "repeat": 0,
                "first_step_s": run["warmup_times_s"][0], "images_per_step": batch_size, "epoch_images": epoch,
                **run} for label, run in runs.items()]
    return {"technique": f"gpt_compile (one {part})", "profile": {"name": "block", "warmup_repeats": 0},
            "baseline": EAGER, "samples": samples, "summary": [],
            "effective_configs": {model: {label: {"amp_dtype": "none"} for label in modules}},
            "notes": [f"{model}'s first {part}, batch {batch_size}, {steps} alternating timed steps on {info.name}"]}
