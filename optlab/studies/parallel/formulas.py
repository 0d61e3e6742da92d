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
    c = config.n_embd
    layers = config.n_layer if layers is None else layers
    outside = config.vocab_size * c + config.block_size * c + 2 * c
    return layers * block_parameters(config, tp) + (outside if ends else 0)


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


def ends_activation_bytes(config: GPTConfig, b: int, t: int, tp: int = 1, sequence: bool = False, s: int = 4) -> int:
    """Bytes saved outside the blocks on one rank: the positions, the final norm's input and statistics (split
    along the sequence with ``sequence``), its output read by the head, the log-softmax over the vocabulary, the
    targets and the loss's weight."""
    c = config.n_embd
    norm = b * t * c + 2 * b * t
    return (INDEX_BYTES * t + s * ((norm // tp if sequence else norm) + b * t * c + b * t * config.vocab_size)
            + INDEX_BYTES * b * t + s)


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
                     layers: int | None = None) -> dict[str, dict[str, int]]:
    """FSDP2's collectives in one step over the model sharded as one unit per block plus the root (embeddings, final
    norm, head), each unit's parameters being this tensor-parallel rank's (``tp``): forward all-gathers every unit;
    backward gathers every block again when ``reshard_after_forward`` freed it (the root is kept) and
    reduce-scatters every unit's gradients. Bytes of the whole (gathered) parameters, ``s`` bytes each; ``layers``:
    the blocks on this rank (all)."""
    layers = config.n_layer if layers is None else layers
    whole, block = s * model_parameters(config, tp, layers), s * block_parameters(config, tp)
    collectives = {"all-gather forward": {"calls": layers + 1, "bytes": whole},
                   "reduce-scatter backward": {"calls": layers + 1, "bytes": whole}}
    if reshard_after_forward:
        collectives["all-gather backward"] = {"calls": layers, "bytes": layers * block}
    return collectives


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
    ((p-1)/v)/(m+(p-1)/v)."""
    fill = (stages - 1) / virtual
    return fill / (microbatches + fill)
