"""One start of a training run, inside its own process: build the model, compile it one way, time the first step
(the compile happens there) and then the steady steps, and read what Dynamo and Inductor counted.

The ways (``HOWS``): ``eager``; ``whole`` (``model.compile()``, the whole model one graph); ``regional`` (each
repeated block compiled on its own: Dynamo traces one block and every other block of the same shapes reuses its
code, as PyTorch's regional-compilation recipe does); ``portable`` (``whole`` after
``torch.compiler.load_cache_artifacts`` has loaded the bytes another process saved with
``save_cache_artifacts``). A ``whole`` start in a folder that an earlier start filled is the warm-cache start.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...core.errors import choice_error
from ...core.gpt.transformer import GPT, GPTConfig
from ...core.machine import compiler
from ...core.machine.device import resolve_device
from ...core.measuring.timing import StepTimer

HOWS = ("eager", "whole", "regional", "portable")
MODELS = ("gpt", "resnet18")
PHASES = ("train", "forward")
SIZES = ("tiny", "small", "real")  # the chapter's on a CPU, the chapter's on a GPU, the GPU reference run's
WARMUP_STEPS = 2  # after the first step, before the timed ones: the allocator and the caches settle


def build(model: str, size: str) -> tuple[nn.Module, list[nn.Module], torch.Tensor, torch.Tensor]:
    """The model, its repeated blocks (what regional compilation compiles), an input batch and its targets.

    ``size`` (:data:`SIZES`) "tiny" is the chapter's on a CPU (a 2-block GPT 16 wide over 16 tokens: the fewest
    blocks that still repeat, for regional compilation), "small" the chapter's on a GPU (the same GPT with 4 blocks),
    both with ResNet18 on 2 images of 32 x 32; "real" the GPU reference run's (GPT-2 small's 12 blocks, 768 wide, over
    1024 tokens; ResNet18 on 64 images of 224 x 224)."""
    if size not in SIZES:
        raise choice_error("size", size, SIZES)
    small = size != "real"
    if model == "gpt":
        config = (GPTConfig(vocab_size=65, block_size=16, n_layer=2 if size == "tiny" else 4, n_head=1, n_embd=16)
                  if small else GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768))
        net = GPT(config)
        batch = (2 if small else 8, config.block_size)
        x = torch.randint(0, config.vocab_size, batch)
        return net, list(net.blocks), x, torch.randint(0, config.vocab_size, batch)
    if model == "resnet18":
        import torchvision

        net = torchvision.models.resnet18(num_classes=10)
        blocks = [block for layer in (net.layer1, net.layer2, net.layer3, net.layer4) for block in layer]
        n, side = (2, 32) if small else (64, 224)
        return net, blocks, torch.randn(n, 3, side, side), torch.randint(0, 10, (n,))
    raise choice_error("model", model, MODELS)


def build_headers(device: str = "auto", train: bool = False) -> dict[str, float]:
    """Compile one tiny function from empty caches, so that Inductor's precompiled headers exist before anything is
    timed, and a process's first compile has paid its setup (its imports, the compiler's checks); its seconds (most
    of them the headers, where the machine had none). On a CPU, Inductor's probe of the vector instructions runs first,
    in the cache folder this process was given (the machine's, unless a caller named another), where Inductor keeps
    its answer for every later process, as it keeps the headers. ``train``: its backward is compiled too, as a
    training step's."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.utils import fresh_cache

    on = resolve_device(device).device
    started = time.perf_counter()
    if on.type == "cpu":
        cpu_vec_isa.pick_vec_isa()  # a process that probed already (a fork server's child) has the answer in memory
    with fresh_cache():
        x = torch.ones(3, device=on, requires_grad=train)
        out = torch.compile(lambda x: torch.sin(x) + 1)(x)
        if train:
            out.sum().backward()
    torch._dynamo.reset()
    return {"headers_s": time.perf_counter() - started}


def _loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())


def start(model: str, how: str, size: str = "small", steps: int = 10, artifacts: str | None = None,
          save_to: str | None = None, seed: int = 0, phase: str = "train") -> dict[str, Any]:
    """Build, compile ``how``, and run ``phase`` steps (``train``: forward, backward and SGD; ``forward``: the loss
    without gradients, as a server's first batch): the seconds from the compile call to the end of the first step
    (loading ``artifacts`` included), the steady steps' seconds, the first loss, and Dynamo's and Inductor's counts.
    ``save_to``: where to write this process's portable cache artifacts after its first step."""
    if how not in HOWS:
        raise choice_error("how", how, HOWS)
    if phase not in PHASES:
        raise choice_error("phase", phase, PHASES)
    device = resolve_device().device
    torch.manual_seed(seed)
    net, blocks, x, y = build(model, size)
    net, x, y = net.to(device), x.to(device), y.to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step() -> float:
        if phase == "forward":
            with torch.no_grad():
                return float(_loss(net, x, y))
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(net, x, y)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    timer = StepTimer(device)
    timer.start()
    if how == "portable":
        torch.compiler.load_cache_artifacts(Path(artifacts).read_bytes())
    if how in ("whole", "portable"):
        net.compile()
    elif how == "regional":
        for block in blocks:
            block.compile()
    first_loss = step()
    timer.mark()
    first = timer.finish()[1]
    saved = 0
    if save_to:
        blob = torch.compiler.save_cache_artifacts()
        if blob is not None:
            Path(save_to).write_bytes(blob[0])
            saved = len(blob[0])
    for _ in range(WARMUP_STEPS):
        step()
    timer = StepTimer(device)
    timer.start()
    for _ in range(steps):
        step()
        timer.mark()
    step_times, _ = timer.finish()
    counts = compiler.cache_counts()
    return {"model": model, "how": how, "size": size, "phase": phase, "first_step_s": first, "step_times_s": step_times,
            "first_loss": first_loss, "graphs": compiler.compiled_graphs(), "artifact_bytes": saved,
            "cache_hits": counts["cache hits"], "cache_misses": counts["cache misses"],
            "device": str(device)}
