"""The arithmetic of tensor, sequence and pipeline parallelism on the book's GPT, one function per fact: what a rank
holds and what it sends. The chapters measure these on CPU processes; the planner applies them to large models.

Sizes: batch ``b`` sequences of ``t`` tokens, width ``c``, ``h`` heads, vocabulary ``v``, ``tp`` tensor-parallel
ranks, ``s`` bytes per activation value (4 in fp32, 2 in bf16).
"""
from __future__ import annotations

from ...core.gpt.transformer import GPTConfig

INDEX_BYTES = 8  # token ids and positions are int64


def block_parameters(config: GPTConfig, tp: int = 1) -> int:
    """Parameters of one block on one of ``tp`` ranks. Split: ``qkv`` and ``fc`` by output (weight and bias), the
    two ``proj`` weights by input, so 12c^2 + 7c divide by tp; the ``proj`` biases (2c) and the two norms (4c) are
    whole on every rank."""
    c = config.n_embd
    return (12 * c * c + 7 * c) // tp + 6 * c


def model_parameters(config: GPTConfig, tp: int = 1, layers: int | None = None, ends: bool = True) -> int:
    """Parameters on one rank: ``layers`` blocks (all by default) split over ``tp``, plus, with ``ends``, the
    embeddings, the tied head and the final norm, whole on every tensor-parallel rank."""
    return stage_parameters(config, tp, layers, first=ends, last=ends)


def stage_parameters(config: GPTConfig, tp: int = 1, layers: int | None = None, first: bool = True,
                     last: bool = True, vocab_parallel: bool = False) -> int:
    """Parameters on one rank of a pipeline stage: ``layers`` blocks split over ``tp``; the ``first`` stage also
    the token and position embeddings, the ``last`` the final norm and the head. The head is tied to the token
    embedding (counted once) when one stage is both; a last stage apart keeps its own copy, as Megatron does. With
    ``vocab_parallel`` the embedding and head are split by vocabulary rows over ``tp`` (Megatron's
    ``VocabParallelEmbedding``); otherwise they are whole on every tensor-parallel rank."""
    c = config.n_embd
    layers = config.n_layer if layers is None else layers
    vocabulary = config.vocab_size * c // (tp if vocab_parallel else 1)
    total = layers * block_parameters(config, tp)
    if first:
        total += vocabulary + config.block_size * c
    if last:
        total += 2 * c + (0 if first else vocabulary)
    return total


def block_activation_bytes(config: GPTConfig, b: int, t: int, tp: int = 1, sequence: bool = False,
                           s: int = 4) -> int:
    """Bytes one block saves for the backward on one rank. Per block autograd keeps: the two norms' inputs (2btc)
    and their mean and 1/std (4bt), the two norm outputs the split layers read (2btc), the fused q, k, v (3btc), the
    attention output (btc) and its log-sum-exp (bht), the MLP's hidden layer before and after GELU (8btc). The last
    12btc + bht are split by heads or hidden units over ``tp``; with ``sequence`` the norms' inputs and statistics
    are split along the sequence too (the norm outputs are gathered whole before the split layers, and kept)."""
    c, h = config.n_embd, config.n_head
    split = 12 * b * t * c + b * h * t
    norms = 2 * b * t * c + 4 * b * t
    return s * (split // tp + 2 * b * t * c + (norms // tp if sequence else norms))


def whole_under_tp_values(config: GPTConfig, b: int, t: int, tp: int, sequence: bool = False) -> int:
    """Values one block saves that tensor parallelism leaves whole on every rank (of
    :func:`block_activation_bytes`): the two norm outputs the split layers read (2btc, gathered whole under SP
    too), the norms' inputs and statistics (2btc + 4bt, split along the sequence over ``tp`` with ``sequence``)."""
    c = config.n_embd
    norms = 2 * b * t * c + 4 * b * t
    return 2 * b * t * c + (norms // tp if sequence else norms)


def first_end_activation_bytes(config: GPTConfig, b: int, t: int) -> int:
    """Bytes the first stage saves outside its blocks: the positions the position embedding read."""
    return INDEX_BYTES * t


def last_end_activation_bytes(config: GPTConfig, b: int, t: int, tp: int = 1, sequence: bool = False, s: int = 4,
                              vocab_parallel: bool = False) -> int:
    """Bytes the last stage saves outside its blocks: the final norm's input and statistics (split along the
    sequence with ``sequence``), its output read by the head, the log-softmax over the vocabulary (split by
    vocabulary over ``tp`` with ``vocab_parallel``), the targets and the loss's weight."""
    c = config.n_embd
    norm = b * t * c + 2 * b * t
    vocabulary = config.vocab_size // (tp if vocab_parallel else 1)
    return s * ((norm // tp if sequence else norm) + b * t * c + b * t * vocabulary) + INDEX_BYTES * b * t + s


def ends_activation_bytes(config: GPTConfig, b: int, t: int, tp: int = 1, sequence: bool = False, s: int = 4) -> int:
    """Bytes saved outside the blocks on one rank that holds both ends (:func:`first_end_activation_bytes` and
    :func:`last_end_activation_bytes`)."""
    return first_end_activation_bytes(config, b, t) + last_end_activation_bytes(config, b, t, tp, sequence, s)


def activation_bytes(config: GPTConfig, b: int, t: int, tp: int = 1, sequence: bool = False, s: int = 4,
                     layers: int | None = None, ends: bool = True) -> int:
    """Bytes saved for the backward in one forward on one rank: ``layers`` blocks (all by default) and, with
    ``ends``, what the embeddings, final norm and loss keep."""
    layers = config.n_layer if layers is None else layers
    total = layers * block_activation_bytes(config, b, t, tp, sequence, s)
    return total + (ends_activation_bytes(config, b, t, tp, sequence, s) if ends else 0)


def tensor_parallel_collectives(config: GPTConfig, b: int, t: int, sequence: bool = False, s: int = 4,
                                layers: int | None = None) -> dict[str, dict[str, int]]:
    """The collectives of one training step under tensor parallelism, per (collective, pass): calls and bytes of
    the whole tensor each works on. Without ``sequence``: each block all-reduces its attention's and its MLP's
    output in forward (2 x btc) and the gradients of their inputs in backward (2 x btc). With ``sequence``: each
    block all-gathers the sequence before each split layer and reduce-scatters after it, forward (2 + 2) and
    backward (2 + 2); the head's input is gathered in forward and the first block's input gradient in backward;
    the optimizer step all-reduces the gradients of the norms' weights and biases (2L + 1 norms, 2 tensors of c
    each, fp32), since each rank saw only its slice of the sequence. ``layers``: the blocks counted (all)."""
    layers, c = config.n_layer if layers is None else layers, config.n_embd
    activation = b * t * c * s
    if not sequence:
        return {"all-reduce backward": {"calls": 2 * layers, "bytes": 2 * layers * activation},
                "all-reduce forward": {"calls": 2 * layers, "bytes": 2 * layers * activation}}
    norm_tensors = 2 * (2 * layers + 1)
    return {"all-gather backward": {"calls": 2 * layers + 1, "bytes": (2 * layers + 1) * activation},
            "all-gather forward": {"calls": 2 * layers + 1, "bytes": (2 * layers + 1) * activation},
            "all-reduce optimizer step": {"calls": norm_tensors, "bytes": norm_tensors * c * 4},
            "reduce-scatter backward": {"calls": 2 * layers, "bytes": 2 * layers * activation},
            "reduce-scatter forward": {"calls": 2 * layers, "bytes": 2 * layers * activation}}


def fsdp_collectives(config: GPTConfig, tp: int = 1, reshard_after_forward: bool = True, s: int = 4,
                     layers: int | None = None, micro_batches: int = 1,
                     gradient_s: int | None = None) -> dict[str, dict[str, int]]:
    """FSDP2's collectives in one step over the model sharded as one unit per block plus the root (embeddings, final
    norm, head), each unit's parameters being this tensor-parallel rank's (``tp``): forward all-gathers every unit;
    backward gathers every block again when ``reshard_after_forward`` freed it (the root is kept) and
    reduce-scatters every unit's gradients. With plain gradient accumulation over ``micro_batches`` (FSDP2's
    default: it reshards after each backward and syncs gradients every time) all of it happens once per
    micro-batch. Bytes of the whole (gathered) parameters, ``s`` bytes each (the gradients ``gradient_s``, ``s`` by
    default); ``layers``: the blocks on this rank (all)."""
    layers = config.n_layer if layers is None else layers
    m, gradient_s = micro_batches, s if gradient_s is None else gradient_s
    parameters = model_parameters(config, tp, layers)
    collectives = {"all-gather forward": {"calls": m * (layers + 1), "bytes": m * s * parameters},
                   "reduce-scatter backward": {"calls": m * (layers + 1), "bytes": m * gradient_s * parameters}}
    if reshard_after_forward:
        block = s * block_parameters(config, tp)
        collectives["all-gather backward"] = {"calls": m * layers, "bytes": m * layers * block}
    return collectives


ZERO_STAGES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def zero_state_bytes(stage: str, parameters: int, ranks: int, weight: int = 2, gradient: int = 2,
                     optimizer: int = 12) -> float:
    """Model-state bytes on one of ``ranks`` data-parallel ranks under a ZeRO ``stage`` (Rajbhandari et al.),
    ``parameters`` on the rank before sharding, bytes a parameter ``weight`` + ``gradient`` + ``optimizer``
    (mixed-precision Adam: 2 + 2 + 12 = 16; with fp32 gradients, as Megatron counts: 2 + 4 + 12 = 18). DP keeps all
    of it; ZeRO-1 shards the optimizer state (4Ψ + 12Ψ/N); ZeRO-2 the gradients too (2Ψ + 14Ψ/N); ZeRO-3 the
    weights too (16Ψ/N)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"unknown ZeRO stage {stage!r}; choose one of: {', '.join(ZERO_STAGES)}")
    kept = {"DP": weight + gradient + optimizer, "ZeRO-1": weight + gradient, "ZeRO-2": weight, "ZeRO-3": 0}[stage]
    return parameters * (kept + (weight + gradient + optimizer - kept) / ranks)


def ring_bytes_sent(collective: str, size: int, ranks: int) -> float:
    """Bytes each rank sends for one collective over ``ranks`` on a ring: an all-reduce 2(N-1)/N of the tensor, an
    all-gather or a reduce-scatter (N-1)/N of it."""
    if ranks == 1:
        return 0.0
    share = (ranks - 1) / ranks
    return (2 * share if collective == "all-reduce" else share) * size


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a pipeline step of ``stages`` ranks and ``microbatches`` micro-batches: (p-1)/(m+p-1)
    for GPipe and 1F1B; with ``virtual`` stages per rank (interleaved 1F1B) the warm-up and drain shrink by v:
    ((p-1)/v)/(m+(p-1)/v) = (p-1)/(vm+p-1)."""
    fill = (stages - 1) / virtual
    return fill / (microbatches + fill)


def schedule_problem(stages: int, microbatches: int, virtual: int = 1) -> str | None:
    """Why torch's schedule refuses ``microbatches`` on ``stages`` ranks (``virtual`` stages each), or None.
    ``Schedule1F1B`` and ``ScheduleGPipe`` refuse fewer micro-batches than stages; ``ScheduleInterleaved1F1B``
    takes m micro-batches in max(1, m // p) rounds and refuses an m that the rounds do not divide; below p
    micro-batches its warm-up is not the bubble's, so it is refused here too."""
    if stages > 1 and microbatches < stages:
        return f"{microbatches} micro-batches are fewer than the {stages} stages (torch's schedules refuse it)"
    rounds = max(1, microbatches // stages)
    if virtual > 1 and microbatches % rounds:
        return f"interleaved 1F1B runs {microbatches} micro-batches in {rounds} rounds, which must divide them"
    return None


def in_flight(stages: int, microbatches: int, virtual: int = 1, rank: int = 0) -> int:
    """The most chunks (micro-batches through one of the rank's stages) forwarded and not yet backwarded on
    ``rank``, as torch's schedules run them: 1F1B warms up with p - rank - 1 forwards, then forwards one more
    before its first backward (p - rank, at most m); interleaved 1F1B's warm-up is (v-1) x its micro-batches per
    round + 2(p-1-rank) chunks (at most v x m), plus the steady phase's first forward. One without a pipeline."""
    if virtual == 1:
        return min(stages - rank, microbatches)
    per_round = microbatches // max(1, microbatches // stages)
    warmup = min((virtual - 1) * per_round + 2 * (stages - 1 - rank), virtual * microbatches)
    return warmup + (1 if warmup < virtual * microbatches else 0)
