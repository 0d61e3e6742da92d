"""Greedy speculative decoding: a cheap drafter guesses the next ``k`` tokens, the target checks them all in one call.

A decode step of a small model at batch 1 costs about the same for one token as for a few: the weights are read (on a
GPU) or the layers' ops launched (on a CPU) once either way. So the target verifies ``k`` drafted tokens in one
``generation.forward_cached`` call over ``[last token, d1 .. dk]``: its greedy choice at
each position says whether the draft there was right. The longest agreeing prefix is kept, plus the target's own next
token after it (so every round gains at least one token), and both caches roll back (``truncate``) past what was
rejected. Every kept token is one the target chose itself, so the output equals the target's greedy decoding token for
token; only the speed depends on how often the drafter guesses right (the acceptance rate).

Two drafters: a small GPT trained on the same text (``ModelDrafter``, with its own static cache), and prompt
lookup (``PromptLookupDrafter``: the tokens that followed the latest earlier occurrence of the text's last few
tokens, at no model cost). ``decode_comparison`` times each drafter and draft length against plain greedy decoding
with the static cache, in paired rounds, and checks every run's tokens against the greedy reference.

Compiled, every part runs compiled when the baseline does (as gpt-fast does): the baseline's and the draft's one-token
steps, and the target's verification of ``k + 1`` tokens, compiled once per ``k`` on the static cache
(:func:`compiled_verify`; CUDA graphs on a GPU). Only the prefill stays eager, in both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd
import torch

from ...core.errors import OptlabError
from ...core.knobs.limits import check_count
from ...core.process.quiet import fix_threads
from ...core.stats.sequential import visit_order
from ...core.measuring.timing import StepTimer, speed_up
from ...core.gpt.transformer import GPT
from . import generation, trained
from .agreement import TokenAgreement, combined, token_agreement

DRAFTERS = ("draft model", "prompt lookup")
DRAFT_LENGTHS = (1, 2, 4, 8)
MAX_DRAFT = 32  # a longer draft is almost never accepted whole, and each token of it costs a draft step
MAX_NGRAM = 8
MAX_ROUNDS = 200
BASELINE = "greedy, static cache"


@dataclass(frozen=True)
class ChapterPlan:
    """What the chapter runs on a device: the target's and the draft's sizes (``trained.SERVING_SIZES``) and training
    steps, the prompt and the new tokens, the paired rounds, the dtype the models serve in, and whether the decode
    steps are compiled (CUDA graphs)."""

    target: str
    draft: str
    target_steps: int
    draft_steps: int
    prompt_len: int
    new_tokens: int
    rounds: int
    dtype: torch.dtype
    compiled: bool


def chapter_plan(cuda: bool) -> ChapterPlan:
    """On a GPU, GPT-2 small in bf16 with a one-block draft of its width, the one-token decode steps (the baseline's
    and the draft's) and the target's verification over ``k + 1`` tokens under CUDA graphs; on a CPU, a six-block
    GPT with a one-block draft (both 64 wide: at batch 1 a CPU's decode step costs about its ops, so the target
    costs several drafts), trained for seconds, all eager."""
    if cuda:
        return ChapterPlan("gpt2_small", "gpt2_draft", 300, 200, 256, 128, 10, torch.bfloat16, True)
    return ChapterPlan("gpt_deep", "gpt_draft", 150, 300, 48, 48, 8, torch.float32, False)


def prompt_tokens(length: int, index: int = 3) -> torch.Tensor:
    """A prompt ``[1, length]``: window ``index`` of 8 spread evenly over the corpus's validation text."""
    index = check_count("index", index, 0, 7, "one of 8 windows")
    windows, _ = trained.validation_windows(length, None, 8)
    return windows[index:index + 1]


def prompt_lookup(sequence: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``sequence``'s last ``n`` tokens, for the
    longest ``n`` from ``max_ngram`` down to 1 that occurs earlier; empty when even the last token never did."""
    for n in range(min(max_ngram, len(sequence) - 1), 0, -1):
        tail = sequence[-n:]
        for start in range(len(sequence) - n - 1, -1, -1):
            if sequence[start:start + n] == tail:
                return sequence[start + n:start + n + k]
    return []


class PromptLookupDrafter:
    """Drafts by ``prompt_lookup`` in the prompt and the text generated so far. A lookup that finds fewer than
    ``k`` tokens is padded by repeating its last guess, so that every verification has the same shape (what CUDA
    graphs need); a padded guess is checked like any other."""

    name = "prompt lookup"

    def __init__(self, k: int, max_ngram: int = 3) -> None:
        self.k = check_count("k", k, 1, MAX_DRAFT, "tokens drafted per round")
        self.max_ngram = check_count("max_ngram", max_ngram, 1, MAX_NGRAM, "tokens matched in the text")
        self.nbytes = 0

    def prefill(self, prompt: torch.Tensor) -> None:
        """Nothing to precompute: the lookup reads the tokens themselves."""

    def propose(self, sequence: list[int]) -> list[int]:
        guess = prompt_lookup(sequence, self.k, self.max_ngram) or [sequence[-1]]
        return guess + [guess[-1]] * (self.k - len(guess))

    def commit(self, sequence: list[int]) -> None:
        """Nothing to roll back."""

    def cache_length(self) -> int | None:
        return None


class ModelDrafter:
    """Drafts ``k`` tokens by greedy decoding with a small GPT and its own static cache (on the device of the model).
    Before each draft its cache is rolled back to the longest prefix it shares with the text (``truncate``) and fed
    the tokens it lacks, so that it always holds every token but the last."""

    name = "draft model"

    def __init__(self, model: GPT, k: int, max_len: int, compiled: bool = False) -> None:
        self.k = check_count("k", k, 1, MAX_DRAFT, "tokens drafted per round")
        self.model, self.compiled = model, compiled
        self.cache = generation.StaticKVCache(model, 1, max_len)
        self.fed: list[int] = []  # the tokens whose keys the cache holds, in order
        self.device = model.token_embedding.weight.device
        self.nbytes = self.cache.nbytes + sum(p.numel() * p.element_size() for p in
                                              {id(p): p for p in model.parameters()}.values())

    def prefill(self, prompt: torch.Tensor) -> None:
        self.cache.reset_rows(0)
        generation.forward_cached(self.model, prompt, self.cache)
        self.fed = prompt[0].tolist()

    def _step(self, token: torch.Tensor) -> torch.Tensor:
        """The logits ``[1, V]`` after one token ``[1, 1]``, appended to the cache."""
        if not self.compiled:
            return generation.forward_cached(self.model, token, self.cache)[:, -1]
        torch.compiler.cudagraph_mark_step_begin()
        logits = generation.compiled_decode(self.device)(self.model, token, self.cache)
        self.cache.longest += 1
        return logits

    def commit(self, sequence: list[int]) -> None:
        """Keep the cached prefix the text agrees with, then feed the text's tokens up to its last one."""
        kept = 0
        for mine, theirs in zip(self.fed, sequence[:-1]):
            if mine != theirs:
                break
            kept += 1
        self.cache.truncate(kept)
        self.fed = self.fed[:kept]
        for token in sequence[kept:-1]:
            self._step(torch.tensor([[token]], device=self.device))
            self.fed.append(token)

    def propose(self, sequence: list[int]) -> list[int]:
        token = torch.tensor([[sequence[-1]]], device=self.device)
        drafted = []
        for _ in range(self.k):
            token = self._step(token).argmax(dim=-1, keepdim=True)
            drafted.append(token)
        guesses = torch.cat(drafted, dim=1)[0].tolist()
        self.fed += [sequence[-1], *guesses[:-1]]
        return guesses

    def cache_length(self) -> int | None:
        return int(self.cache.lengths[0])


@dataclass(frozen=True)
class Round:
    """One verification: where its tokens start in the text, the drafted tokens, and how many the target kept."""

    start: int
    drafted: tuple[int, ...]
    accepted: int


@dataclass
class Speculation:
    """The tokens (prompt then ``new_tokens``), the prefill's seconds (target and drafter), the decode's seconds
    (every token after the first), each round, the whole text (with what the last round produced past
    ``new_tokens``) and the caches' lengths at the end (each should hold every token of the text but the last)."""

    tokens: torch.Tensor
    prompt_len: int
    prefill_s: float
    decode_s: float
    rounds: list[Round] = field(default_factory=list)
    text: list[int] = field(default_factory=list)  # prompt and every token produced, the last round's overshoot too
    target_cache_length: int = 0
    draft_cache_length: int | None = None

    @property
    def drafted(self) -> int:
        return sum(len(r.drafted) for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens the target kept, over the tokens drafted."""
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_round(self) -> float:
        """Tokens gained per target call in the decode: the accepted drafts plus the target's own one."""
        return (self.accepted + len(self.rounds)) / len(self.rounds) if self.rounds else math.nan


def accepted_prefix(drafted: list[int], predicted: list[int]) -> int:
    """How many drafted tokens, from the first, equal the target's greedy choices at their positions."""
    for index, (guess, choice) in enumerate(zip(drafted, predicted)):
        if guess != choice:
            return index
    return len(drafted)


def _verify_logits(model: GPT, tokens: torch.Tensor, cache: generation.StaticKVCache) -> torch.Tensor:
    """The target's logits ``[1, k + 1, V]`` at ``tokens`` ``[1, k + 1]``, their keys appended: tensor work only,
    so that it compiles into one graph."""
    return generation.forward_tokens(model, tokens, cache)


_VERIFIERS: dict[tuple[str, int], Callable] = {}


def compiled_verify(device: torch.device, k: int) -> Callable:
    """The verification of ``k`` drafted tokens ``(target, tokens [1, k + 1], static cache) -> logits`` under
    ``torch.compile`` with fixed shapes, one per ``k``: ``mode="reduce-overhead"`` (CUDA graphs) on a GPU, the
    default mode elsewhere, as ``generation.compiled_decode`` compiles the one-token step."""
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    if (mode, k) not in _VERIFIERS:
        _VERIFIERS[mode, k] = torch.compile(_verify_logits, mode=mode, fullgraph=True, dynamic=False)
    return _VERIFIERS[mode, k]


def target_cache_len(prompt_len: int, new_tokens: int, k: int) -> int:
    """Positions the target's cache needs: the prompt, the new tokens and the last round's ``k`` drafted ones."""
    return prompt_len + new_tokens + k


def _check_prompt(target: GPT, prompt: torch.Tensor, new_tokens: int, k: int) -> None:
    if prompt.dim() != 2 or prompt.size(0) != 1 or prompt.size(1) < 1 or prompt.dtype != torch.long:
        raise OptlabError(f"speculative decoding takes one prompt, a LongTensor [1, tokens] with at least one token; "
                          f"got {prompt.dtype} of shape {tuple(prompt.shape)}")
    room = target.config.block_size - prompt.size(1) - k
    check_count("new_tokens", new_tokens, 1, max(room, 1), f"a {prompt.size(1)}-token prompt, {k} drafted tokens "
                f"of the last round and the new ones fit the GPT's block of {target.config.block_size}")


@torch.no_grad()
def speculative_generate(target: GPT, prompt: torch.Tensor, new_tokens: int,
                         drafter: "ModelDrafter | PromptLookupDrafter", compiled: bool = False,
                         reuse: "generation.StaticKVCache | None" = None) -> Speculation:
    """``new_tokens`` tokens after ``prompt`` ``[1, T0]`` by greedy speculative decoding with ``drafter``: the target
    prefills (its first token), then each round verifies ``drafter.k`` drafted tokens in one call (``compiled``:
    :func:`compiled_verify`), keeps the longest agreeing prefix and its own next token, and rolls its cache back to
    the kept text. Timed with the book's timer. ``reuse``: the target's static cache of an earlier run (one row, room
    for ``target_cache_len``), emptied and filled again: its storage stays put, so CUDA graphs recorded on it
    replay instead of recording again."""
    _check_prompt(target, prompt, new_tokens, drafter.k)
    device = target.token_embedding.weight.device
    prompt = prompt.to(device)
    total = prompt.size(1) + new_tokens
    room = target_cache_len(prompt.size(1), new_tokens, drafter.k)
    if reuse is not None and (reuse.batch != 1 or reuse.max_len < room):
        raise OptlabError(f"reuse needs a StaticKVCache of one row holding at least {room} positions, got "
                          f"{reuse.batch} rows of {reuse.max_len}")
    cache = reuse if reuse is not None else generation.StaticKVCache(target, 1, room)
    cache.reset_rows(0)
    verify = compiled_verify(device, drafter.k) if compiled else None
    timer = StepTimer(device)
    timer.start()
    sequence = prompt[0].tolist() + [int(generation.forward_cached(target, prompt, cache)[0, -1].argmax())]
    drafter.prefill(prompt)
    timer.mark()
    rounds = []
    while len(sequence) < total:
        drafted = drafter.propose(sequence)
        checked = torch.tensor([[sequence[-1], *drafted]], device=device)
        if verify is None:
            logits = generation.forward_cached(target, checked, cache)
        else:
            torch.compiler.cudagraph_mark_step_begin()
            logits = verify(target, checked, cache)
            cache.longest += checked.size(1)
        predicted = logits[0].argmax(dim=-1).tolist()
        accepted = accepted_prefix(drafted, predicted)
        rounds.append(Round(len(sequence), tuple(drafted), accepted))
        sequence += drafted[:accepted] + [predicted[accepted]]
        cache.truncate(len(sequence) - 1)
        drafter.commit(sequence)
    timer.mark()
    seconds, _ = timer.finish()
    return Speculation(torch.tensor([sequence[:total]], device=device), prompt.size(1), seconds[0], seconds[1], rounds,
                       sequence, int(cache.lengths[0]), drafter.cache_length())


def counted_acceptance(run: Speculation) -> float:
    """The acceptance rate counted from the text itself: for each round, the drafted tokens, from the first, that
    equal the tokens the text holds at their positions, over all the tokens drafted."""
    kept = sum(accepted_prefix(list(r.drafted), run.text[r.start:r.start + len(r.drafted)]) for r in run.rounds)
    return kept / run.drafted if run.drafted else math.nan


def _decode_s(generated: generation.Generation) -> float:
    return float(sum(generated.decode_s))


@dataclass
class DecodeComparison:
    """Paired rounds of plain greedy decoding with the static cache and each speculative setting: decode seconds per
    round (every token after the first), each setting's slot after the baseline in each round, its rounds' acceptance,
    and how every run's tokens stand against the greedy reference (``agreement.token_agreement``, all runs combined)."""

    new_tokens: int
    times_s: dict[str, list[float]]
    slot_shifts: dict[str, list[int]]
    settings: dict[str, dict]  # label -> drafter, k, extra bytes
    runs: dict[str, Speculation]  # the last run of each setting
    agreements: dict[str, TokenAgreement]
    compiled: bool = False  # the one-token decode steps (the baseline's, the draft's) ran compiled
    verification_compiled: bool = False  # the target's verification of k + 1 tokens ran compiled

    def compiled_steps(self, label: str) -> str:
        """What ran compiled in the setting: the one-token steps, and the target's verification if it was."""
        if label == BASELINE:
            return "every decode step" if self.compiled else "none"
        parts = ["the draft's steps"] if self.compiled and self.settings[label]["drafter"] == "draft model" else []
        parts += ["verification"] if self.verification_compiled else []
        eager = "; verification eager" if self.compiled and not self.verification_compiled else ""
        return " and ".join(parts or ["none"]) + eager

    def caveat(self) -> str | None:
        """Where the comparison leans: with compiled steps and eager verification, the baseline decodes entirely
        through CUDA graphs while the target verifies the drafts eagerly, so launch-bound verification pulls the
        speed-ups down. None where both are compiled or neither is."""
        if not self.compiled or self.verification_compiled:
            return None
        return ("Compiled against eager: greedy decoding runs every step compiled (CUDA graphs on a GPU), while "
                "speculative decoding verifies each draft eagerly (one eager call of k + 1 tokens a round), so where a "
                "step is bound by launching kernels the speed-ups here are lower than compiled verification gives.")

    def table(self) -> pd.DataFrame:
        """One row per setting: drafter, k, acceptance rate, tokens per target call, decode tokens/s (median round),
        the speed-up over greedy decoding with its interval and verdict, whether its tokens are greedy decoding's up to
        near-ties and how many ties it took, the drafter's memory
        (its weights and cache) and what ran compiled (``compiled_steps``)."""
        baseline = self.times_s[BASELINE]
        rows = []
        for label, times in self.times_s.items():
            setting, run = self.settings[label], self.runs.get(label)
            row = {"variant": label, "drafter": setting["drafter"], "k": setting["k"],
                   "acceptance rate": run.acceptance_rate if run else math.nan,
                   "tokens per target call": run.tokens_per_round if run else 1.0,
                   "decode tokens/s": (self.new_tokens - 1) / float(np.median(times)),
                   "same as greedy": self.agreements[label].agrees, "near-ties": self.agreements[label].ties,
                   "drafter MiB": setting["bytes"] / 2**20,
                   "compiled": self.compiled_steps(label), "rounds": len(times)}
            if label == BASELINE:
                rows.append(row | {"speedup": 1.0, "ci_low": 1.0, "ci_high": 1.0, "verdict": "baseline"})
                continue
            result = speed_up(baseline, times, self.slot_shifts[label])
            rows.append(row | {"speedup": result.ratio, "ci_low": result.low, "ci_high": result.high,
                               "verdict": result.verdict})
        return pd.DataFrame(rows)

    def speedups(self, model: str) -> pd.DataFrame:
        """The settings' speed-ups over greedy decoding as tidy rows, in the columns ``optlab.book.report`` plots."""
        table = self.table().query("variant != @BASELINE")
        return pd.DataFrame({"model": model, "phase": "decode", "variant": table["variant"], "source": "live",
                             "speedup": table["speedup"], "ci_low": table["ci_low"], "ci_high": table["ci_high"],
                             "verdict": table["verdict"], "role": None, "versus": BASELINE}).reset_index(drop=True)


def make_drafter(kind: str, k: int, draft: "GPT | None", max_len: int,
                 compiled: bool = False) -> "ModelDrafter | PromptLookupDrafter":
    """A drafter of ``kind`` (one of ``DRAFTERS``) drafting ``k`` tokens a round."""
    if kind == "prompt lookup":
        return PromptLookupDrafter(k)
    if kind != "draft model":
        raise OptlabError(f"unknown drafter {kind!r}; choose one of: {', '.join(DRAFTERS)}")
    if draft is None:
        raise OptlabError("the draft-model drafter needs a draft GPT (draft=...)")
    return ModelDrafter(draft, k, max_len, compiled)


@torch.no_grad()
def decode_comparison(target: GPT, draft: "GPT | None", prompt: torch.Tensor, new_tokens: int,
                      ks: "tuple[int, ...]" = DRAFT_LENGTHS, drafters: "tuple[str, ...]" = DRAFTERS,
                      rounds: int = 8, compiled: bool = False,
                      compile_verification: "bool | None" = None) -> DecodeComparison:
    """Plain greedy decoding with the static cache against speculative decoding with each drafter and each draft
    length ``k``, ``rounds`` paired rounds after one untimed warm-up round, in mirrored orders
    (``sequential.visit_order``), on the book's timing threads (``quiet.fix_threads``); every run's tokens are compared
    with the no-cache greedy reference, a differing token accepted only at a near-tie (``agreement``). ``compiled``
    compiles the one-token steps and, unless ``compile_verification`` is False, the verification. Each setting fills
    one target cache of its own, emptied before every run, so that on a GPU its graphs are recorded in the warm-up
    round and replayed in the timed ones."""
    verify = compiled if compile_verification is None else compile_verification
    rounds = check_count("rounds", rounds, 2, MAX_ROUNDS, "paired rounds of whole generations")
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT for k in ks):
        raise OptlabError(f"ks must be draft lengths from 1 to {MAX_DRAFT}, got {ks!r}")
    fix_threads(target.token_embedding.weight.device.type == "cuda")
    reference = generation.greedy_reference(target, prompt, new_tokens)[0].tolist()
    prompt_len = prompt.size(1)
    max_len = prompt.size(1) + new_tokens + max(ks)
    setups = {BASELINE: None} | {f"{kind}, k={k}": make_drafter(kind, k, draft, max_len, compiled)
                                 for kind in drafters for k in ks}
    settings = {label: {"drafter": "none" if d is None else d.name, "k": 0 if d is None else d.k,
                        "bytes": 0 if d is None else d.nbytes} for label, d in setups.items()}
    times: dict[str, list[float]] = {label: [] for label in setups}
    shifts: dict[str, list[int]] = {label: [] for label in setups}
    checks: dict[str, list[TokenAgreement]] = {label: [] for label in setups}
    runs: dict[str, Speculation] = {}
    caches = {label: generation.StaticKVCache(target, 1, target_cache_len(prompt.size(1), new_tokens, d.k)
                                              if d else prompt.size(1) + new_tokens - 1)
              for label, d in setups.items()}  # one each, emptied before every run: graphs replay on it
    labels = list(setups)
    for index in range(-1, rounds):  # round -1 warms up (and is not kept)
        order = visit_order(labels, max(index, 0))
        for label in order:
            drafter = setups[label]
            if drafter is None:
                out = generation.generate(target, prompt, new_tokens, cache="static", compiled=compiled,
                                          reuse=caches[label])
                tokens, seconds = out.tokens[0].tolist(), _decode_s(out)
            else:
                run = runs[label] = speculative_generate(target, prompt, new_tokens, drafter, verify, caches[label])
                tokens, seconds = run.tokens[0].tolist(), run.decode_s
            checks[label].append(token_agreement(target, tokens, reference, prompt_len))
            if index >= 0:
                times[label].append(seconds)
                shifts[label].append(order.index(label) - order.index(BASELINE))
    agreements = {label: combined(found) for label, found in checks.items()}
    return DecodeComparison(new_tokens, times, shifts, settings, runs, agreements, compiled, verify)
