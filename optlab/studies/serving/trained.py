"""Briefly trained GPTs for the serving chapters, cached on disk: generation only means something from weights that
have learned a little of the text (an untrained model's greedy output is one character repeated).

``trained_gpt`` trains the book's GPT (``optlab.core.gpt.transformer``) of a named size (``SERVING_SIZES``) on
the book's corpus (``optlab.core.gpt.text_data``: tiny Shakespeare when present, the stand-in otherwise), on windows of
the size's whole block (every position the serving chapters use is trained), and keeps the weights in a file keyed by
the size, the steps, the seed, the corpus and the torch version; a second call with the same key loads them.
``validation_loss`` reads a model's loss on windows spread over the corpus's validation text.
"""
from __future__ import annotations

import hashlib
import io
import math
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from ...core.results import store
from ...core.gpt import text_data
from ...core.errors import OptlabError, choice_error
from ...core.knobs.limits import check_count
from ...core.process.quiet import fix_threads
from ...core.gpt.transformer import GPT, GPT_SIZES, GPTConfig

# The CPU sizes are the book's tiny GPT (2 blocks, 64 wide) with a block of 512 tokens (a long prompt and its
# continuation), and a one-block and a six-block GPT of the same width with a block of 128 (short windows learn
# faster per second: each step sees more of them); on a GPU, GPT-2 small and a one-block draft of its width and
# vocabulary.
SERVING_SIZES: dict[str, GPTConfig] = {
    "gpt_draft": GPTConfig(vocab_size=65, block_size=128, n_layer=1, n_head=2, n_embd=64),
    "gpt_tiny": GPTConfig(vocab_size=65, block_size=512, n_layer=2, n_head=2, n_embd=64),
    "gpt_deep": GPTConfig(vocab_size=65, block_size=128, n_layer=6, n_head=2, n_embd=64),
    "gpt2_draft": GPTConfig(vocab_size=50304, block_size=1024, n_layer=1, n_head=12, n_embd=768),
    "gpt2_small": GPT_SIZES["gpt2_small"],
}
TOKENS_PER_STEP = 512  # training tokens per step on a CPU: whole-block windows, as many as make about this many
GPU_TOKENS_PER_STEP = 8192
LEARNING_RATE = 3e-3  # AdamW; a short warm-up, then constant: a few hundred steps, not a schedule's worth
GPU_LEARNING_RATE = 1e-3  # GPT-2 small's width: a third of the tiny GPTs' rate (GPT-2 itself used 6e-4)
WARMUP_STEPS = 10
CLIP_NORM = 1.0  # gradient norm clipping, as nanoGPT does
MAX_STEPS = 100_000  # a brief training: more is a typo
MAX_EVAL_BATCHES = 1_000
CACHE_FOLDER = "trained"  # under the live results folder (git ignores it)


def serving_config(size: str) -> GPTConfig:
    """The sizes of ``size``, a name of ``SERVING_SIZES``."""
    if size not in SERVING_SIZES:
        raise choice_error("serving GPT size", size, tuple(SERVING_SIZES))
    return SERVING_SIZES[size]


def cache_path(size: str, steps: int, seed: int, corpus_kind: str, cache_dir: "str | Path | None" = None) -> Path:
    """The file that holds ``size``'s weights after ``steps`` steps from ``seed`` on the corpus ``corpus_kind``: its
    name carries those, the torch version and a digest of the sizes and the training recipe."""
    recipe = {**asdict(serving_config(size)), "lr": (LEARNING_RATE, GPU_LEARNING_RATE), "warmup": WARMUP_STEPS,
              "clip": CLIP_NORM, "tokens": (TOKENS_PER_STEP, GPU_TOKENS_PER_STEP)}
    digest = hashlib.sha256(repr(sorted(recipe.items())).encode()).hexdigest()[:10]
    torch_version = torch.__version__.replace("+", "-")
    folder = Path(cache_dir) if cache_dir is not None else store.LIVE_DIR / CACHE_FOLDER
    return folder / f"{size}-{steps}steps-seed{seed}-{corpus_kind}-torch{torch_version}-{digest}.pt"


def _device(device: "str | torch.device") -> torch.device:
    return torch.device(device)


def train_gpt(config: GPTConfig, steps: int, device: torch.device, seed: int = 0) -> tuple[GPT, list[float]]:
    """A fresh GPT of ``config`` from ``seed``, trained ``steps`` AdamW steps (gradients clipped) on random whole-block
    windows of the corpus's training text (bf16 autocast on a GPU); the model and its training losses."""
    train, _, _ = text_data.text_datasets(block_size=config.block_size, vocab_size=config.vocab_size)
    torch.manual_seed(seed)
    model = GPT(config).to(device)
    cuda = device.type == "cuda"
    rate = GPU_LEARNING_RATE if cuda else LEARNING_RATE
    optimizer = torch.optim.AdamW(model.parameters(), lr=rate, betas=(0.9, 0.99), weight_decay=0.0)
    tokens = GPU_TOKENS_PER_STEP if cuda else TOKENS_PER_STEP
    batch = max(1, tokens // config.block_size)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = rate * min(1.0, (step + 1) / WARMUP_STEPS)
        x, y = (part.to(device) for part in text_data.random_batch(train, batch, generator))
        with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
        losses.append(float(loss.detach()))
    return model.eval(), losses


def trained_gpt(size: str, steps: int, device: "str | torch.device", seed: int = 0,
                cache_dir: "str | Path | None" = None) -> GPT:
    """The GPT of ``size`` (``SERVING_SIZES``) after ``steps`` training steps from ``seed`` on the book's corpus,
    in fp32 on ``device``, in eval mode: loaded from the cache when this key was trained before (``cache_dir``, else
    ``trained/`` under the live results folder), else trained now and saved there."""
    config = serving_config(size)
    steps = check_count("steps", steps, 1, MAX_STEPS, "the serving chapters train briefly")
    seed = check_count("seed", seed, 0, 2**31 - 1, "torch's seeds")
    device = _device(device)
    corpus = text_data.load_corpus()
    path = cache_path(size, steps, seed, corpus.kind, cache_dir)
    if path.is_file():
        model = GPT(config).to(device)
        model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
        return model.eval()
    fix_threads(device.type == "cuda")
    model, losses = train_gpt(config, steps, device, seed)
    if not math.isfinite(losses[-1]):
        raise OptlabError(f"training {size} for {steps} steps ended on a loss of {losses[-1]}; nothing was cached")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    store.atomic_write_bytes(path, buffer.getvalue())
    return model


def validation_windows(block_size: int, vocab_size: "int | None", count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows of ``block_size`` tokens spread evenly over the corpus's validation text: (x, y) stacked."""
    _, validation, _ = text_data.text_datasets(block_size=block_size, vocab_size=vocab_size)
    starts = torch.linspace(0, len(validation) - 1, count).long().tolist()
    xs, ys = zip(*(validation[i] for i in starts))
    return torch.stack(xs), torch.stack(ys)


@torch.no_grad()
def validation_loss(model: GPT, device: "str | torch.device", batches: int = 4, batch_size: int = 4) -> float:
    """``model``'s mean next-token loss (nats) on ``batches`` x ``batch_size`` whole-block windows spread over the
    corpus's validation text, computed in the model's own dtype (the loss itself in fp32)."""
    batches = check_count("batches", batches, 1, MAX_EVAL_BATCHES, "windows spread over the validation text")
    batch_size = check_count("batch_size", batch_size, 1, 64, "a few windows a batch")
    device = _device(device)
    config = model.config
    x, y = validation_windows(config.block_size, config.vocab_size, batches * batch_size)
    total = 0.0
    for at in range(0, len(x), batch_size):
        logits = model(x[at:at + batch_size].to(device))
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), y[at:at + batch_size].to(device).flatten(),
                                       reduction="sum"))
    return total / y.numel()
