"""The planner: memory per GPU (first and last pipeline stage apart) and bytes per step for data parallelism (DDP),
ZeRO-1, ZeRO-2, FSDP (ZeRO-3), HSDP, tensor (and sequence) and pipeline parallelism (1F1B and interleaved 1F1B) and
their compositions, from :mod:`.formulas`, for a GPT on ``gpus`` GPUs.

Assumptions, stated once (each a field of :class:`Assumptions` where it can be chosen):

- Model state: bf16 weights (2 bytes), bf16 or fp32 gradients (2 or 4: 16 or 18 bytes a parameter, the ZeRO
  paper's count or Megatron's, https://docs.nvidia.com/megatron/dist-optimizer.md), fp32 master weights and two
  moments (12). DDP (DP, and ZeRO-1 built on it with ``ZeroRedundancyOptimizer``) adds its gradient buckets, a second
  copy of the gradients: ``gradient_as_bucket_view`` is off by default, and turning it on saves "the total gradients
  size" (``DistributedDataParallel``'s documentation). ZeRO-2 is DeepSpeed's stage 2 (weights whole, gradients reduce-scattered every micro-batch);
  DeepSpeed refuses it with a pipeline, so it has no pipelined rows.
- FSDP (FSDP2's defaults, plain gradient accumulation): one unit per block and the root; every micro-batch gathers
  every unit forward, every block again backward, and reduce-scatters every unit; it holds two blocks gathered (the
  current and the prefetched) and the root (embeddings, final norm, head) from forward to backward. Under a pipeline
  it runs as torchtitan and torch's ``PipelineStage`` run it (no reshard after forward, none after backward and no
  gradient sync until the last micro-batch): the stage's parameters and gradients stay unsharded all step, gathered
  once and reduce-scattered once. HSDP shards within a node (``gpus_per_node / tp`` ranks) and all-reduces the
  gradient shards across nodes every micro-batch.
- Activations in bf16, kept whole unless ``recompute`` (then each block keeps its input and one block at a time is
  recomputed whole). A pipeline holds what torch's schedule keeps in flight (:func:`.formulas.in_flight`): the first
  stage p micro-batches (1F1B), the last one; the loss end (final norm, log-softmax) lives on the last stage only.
- Ranks are laid out as torchtitan's mesh (pipeline, data, tensor: tensor innermost). A group whose ranks fit in
  one node of ``gpus_per_node`` uses the intra-node link, any other the inter-node link; each collective runs on a
  ring at its group's link's speed, one after another (no overlap with compute).
- A layout fits when its fuller stage's bytes are at most ``(1 - margin)`` of the GPU's memory, in GB (1e9 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from ...core.errors import OptlabError, choice_error
from ...core.gpt.transformer import GPT_SIZES, GPTConfig
from ...core.knobs.limits import check_count
from . import formulas

VALUE_BYTES = 2  # bf16 activations, weights and gradients on the wire
STATE_BYTES = {16: 2, 18: 4}  # bytes a parameter -> its gradient's bytes (bf16, or fp32 as Megatron counts)
MAX_GPUS, MAX_MICRO_BATCHES, MAX_BATCH = 4096, 1024, 1024
MAX_GPU_MEMORY_GB = 2048
GB = 1e9  # memory and traffic are in GB as GPU datasheets print them, not GiB

INTERCONNECTS = {  # one direction's bandwidth per GPU, bytes/s (each vendor's figure)
    "nvlink4": 450e9,  # H100/H200 SXM, NVLink 4: 900 GB/s both ways
    "nvlink3": 300e9,  # A100 SXM
    "pcie5": 64e9,  # PCIe 5.0 x16
    "pcie4": 32e9,
    "infiniband-ndr": 50e9,  # 400 Gb/s per GPU between nodes
    "infiniband-hdr": 25e9,  # 200 Gb/s per GPU between nodes
}

MODELS = {  # GPT-2's sizes and a 7B-class model in the book's GPT shape (4x GELU MLP, tied head)
    "gpt2_small": GPT_SIZES["gpt2_small"],
    "gpt2_medium": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2_large": GPTConfig(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2_xl": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "7b": GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096),
}
SHARDINGS = ("DP", "ZeRO-1", "ZeRO-2", "FSDP", "HSDP")


@dataclass(frozen=True)
class Assumptions:
    """What a step is and what a parameter costs: ``micro_batches`` of ``micro_batch`` sequences; bytes of a
    weight, a gradient and the optimizer state per parameter, of an activation value; full activation
    ``recompute``; a ``vocab_parallel`` embedding, head and loss under TP."""

    micro_batch: int = 1
    micro_batches: int = 8
    weight_bytes: int = 2
    gradient_bytes: int = 2
    optimizer_bytes: int = 12
    value_bytes: int = VALUE_BYTES
    recompute: bool = False
    vocab_parallel: bool = False

    @property
    def state_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Layout:
    """How ``data x tp x pp`` GPUs share the work: ``data`` ranks that replicate or shard the state
    (``sharding``: DP, ZeRO-1, ZeRO-2, FSDP or HSDP), ``tp`` ranks per layer (with ``sequence`` parallel norms),
    ``pp`` pipeline ranks of ``virtual`` stages each (1: 1F1B; more: interleaved 1F1B). HSDP shards over groups of
    ``shard`` data ranks and replicates across them."""

    data: int = 1
    tp: int = 1
    pp: int = 1
    sharding: str = "DP"
    sequence: bool = False
    virtual: int = 1
    shard: int = 0

    @property
    def name(self) -> str:
        data = f"HSDP {self.data // self.shard}x{self.shard}" if self.sharding == "HSDP" else \
            f"{self.sharding} {self.data}"
        parts = [data] if self.data > 1 else []
        parts += [f"TP{'+SP' if self.sequence else ''} {self.tp}"] if self.tp > 1 else []
        parts += [f"PP {self.pp}" + (f" (interleaved {self.virtual})" if self.virtual > 1 else "")] \
            if self.pp > 1 else []
        return " x ".join(parts) or "one GPU"

    @property
    def sharded(self) -> bool:
        """Whether the weights are sharded over the data ranks (FSDP, HSDP)."""
        return self.sharding in ("FSDP", "HSDP")

    def problem(self, config: GPTConfig) -> str | None:
        """Why this layout cannot split ``config``, or None."""
        if config.n_head % self.tp:
            return f"{config.n_head} heads do not split over {self.tp}"
        if config.n_layer % (self.pp * self.virtual):
            return f"{config.n_layer} layers do not split into {self.pp * self.virtual} stages"
        return None


@dataclass(frozen=True)
class Cluster:
    """``gpus_per_node`` GPUs a node joined by ``intra_node``, nodes joined by ``inter_node`` (names in
    ``INTERCONNECTS``)."""

    gpus_per_node: int = 8
    intra_node: str = "nvlink4"
    inter_node: str = "infiniband-ndr"

    def link(self, size: int, stride: int) -> str:
        """The link a group of ``size`` ranks ``stride`` apart runs on: intra-node when it fits in one node."""
        return self.intra_node if size * stride <= self.gpus_per_node else self.inter_node

    def groups(self, layout: Layout) -> dict[str, tuple[int, str]]:
        """Each group's size and link: tensor (innermost), data, HSDP's shard and replica groups, pipeline."""
        shard = layout.shard if layout.sharding == "HSDP" else layout.data
        return {"tp": (layout.tp, self.link(layout.tp, 1)), "data": (layout.data, self.link(layout.data, layout.tp)),
                "shard": (shard, self.link(shard, layout.tp)),
                "replica": (layout.data // shard, self.link(layout.data // shard, layout.tp * shard)),
                "pp": (layout.pp, self.link(layout.pp, layout.tp * layout.data))}


def memory_per_gpu(config: GPTConfig, layout: Layout, assumptions: Assumptions = Assumptions(),
                   stage: str = "first") -> dict[str, float]:
    """Bytes on one GPU of the ``first`` or ``last`` pipeline stage (the same GPU without a pipeline): its
    ``parameters`` (count), model ``state`` (sharded as ``layout.sharding`` says), DDP's gradient ``buckets``,
    the weights and gradients FSDP holds ``gathered``, and ``activations`` (see the module's assumptions)."""
    a, first, last = assumptions, stage == "first" or layout.pp == 1, stage == "last" or layout.pp == 1
    layers = config.n_layer // layout.pp
    parameters = formulas.stage_parameters(config, layout.tp, layers, first, last, a.vocab_parallel)
    zero = {"DP": "DP", "ZeRO-1": "ZeRO-1", "ZeRO-2": "ZeRO-2", "FSDP": "ZeRO-3", "HSDP": "ZeRO-3"}[layout.sharding]
    ranks = layout.shard if layout.sharding == "HSDP" else layout.data
    state = formulas.zero_state_bytes(zero, parameters, ranks, a.weight_bytes, a.gradient_bytes, a.optimizer_bytes)
    buckets = a.gradient_bytes * parameters if layout.sharding in ("DP", "ZeRO-1") and layout.data > 1 else 0
    gathered = 0
    if layout.sharded and layout.pp > 1:  # the pipeline stage keeps its weights and gradients unsharded all step
        gathered = (a.weight_bytes + a.gradient_bytes) * parameters
    elif layout.sharded:  # two blocks (current and prefetched) and the root
        ends = parameters - layers * formulas.block_parameters(config, layout.tp)
        gathered = a.weight_bytes * (2 * formulas.block_parameters(config, layout.tp) + ends)
    rank = 0 if stage == "first" else layout.pp - 1
    activations = _activations(config, layout, a, layers, first, last, rank)
    return {"parameters": parameters, "state": state, "buckets": buckets, "gathered": gathered,
            "activations": activations, "total": state + buckets + gathered + activations}


def _activations(config: GPTConfig, layout: Layout, a: Assumptions, layers: int, first: bool, last: bool,
                 rank: int) -> float:
    """Bytes saved for the backward on one rank: its chunks in flight (each ``layers / virtual`` blocks), the
    first end with each micro-batch the first stage holds, the loss end once (the last stage's in flight)."""
    b, t, s, tp = a.micro_batch, config.block_size, a.value_bytes, layout.tp
    chunks = formulas.in_flight(layout.pp, a.micro_batches, layout.virtual, rank) if layout.pp > 1 else 1
    block = formulas.block_activation_bytes(config, b, t, tp, layout.sequence, s)
    blocks = chunks * (layers // layout.virtual)
    if a.recompute:  # each block keeps its input (a sequence shard under SP); one block recomputed at a time
        total = blocks * s * b * t * config.n_embd // (tp if layout.sequence else 1) + block
    else:
        total = blocks * block
    if first:
        total += min(chunks, a.micro_batches) * formulas.first_end_activation_bytes(config, b, t)
    if last:
        total += formulas.last_end_activation_bytes(config, b, t, tp, layout.sequence, s, a.vocab_parallel)
    return total


def traffic(config: GPTConfig, layout: Layout, assumptions: Assumptions = Assumptions(), stage: str = "first",
            cluster: Cluster = Cluster()) -> list[dict]:
    """What one GPU of the ``first`` or ``last`` stage sends in one step: one entry per kind of collective with its
    ``group``, ``link`` and ``bytes`` sent on a ring (see the module's assumptions)."""
    a, first, last = assumptions, stage == "first" or layout.pp == 1, stage == "last" or layout.pp == 1
    m, layers, groups = a.micro_batches, config.n_layer // layout.pp, cluster.groups(layout)
    parameters = formulas.stage_parameters(config, layout.tp, layers, first, last, a.vocab_parallel)
    weights, gradients = a.weight_bytes * parameters, a.gradient_bytes * parameters
    data: list[tuple[str, str, float]] = []  # (group, collective, bytes of the whole tensor)
    if layout.sharding == "DP":
        data = [("data", "all-reduce", gradients)]  # once a step: no_sync over the accumulation
    elif layout.sharding == "ZeRO-1":
        data = [("data", "reduce-scatter", gradients), ("data", "all-gather", weights)]
    elif layout.sharding == "ZeRO-2":
        data = [("data", "reduce-scatter", m * gradients), ("data", "all-gather", weights)]
    else:
        group = "data" if layout.sharding == "FSDP" else "shard"
        if layout.pp > 1:
            data = [(group, "all-gather", weights), (group, "reduce-scatter", gradients)]
            syncs = 1
        else:
            counted = formulas.fsdp_collectives(config, layout.tp, True, a.weight_bytes, layers, m, a.gradient_bytes)
            data = [(group, key.split()[0], value["bytes"]) for key, value in counted.items()]
            syncs = m
        if layout.sharding == "HSDP":
            data.append(("replica", "all-reduce", syncs * gradients / groups["shard"][0]))
    entries = [_entry(group, collective, size, groups) for group, collective, size in data]
    if layout.tp > 1:
        entries += _tensor_entries(config, layout, a, layers, groups)
    if layout.pp > 1:  # a middle rank: one activation forward and one gradient back per micro-batch and chunk
        boundary = a.micro_batch * config.block_size * config.n_embd * a.value_bytes
        boundary //= layout.tp if layout.sequence else 1
        entries.append({"group": "pp", "link": groups["pp"][1], "bytes": 2 * m * layout.virtual * boundary})
    return [entry for entry in entries if entry["bytes"]]


def _entry(group: str, collective: str, size: float, groups: dict[str, tuple[int, str]]) -> dict:
    ranks, link = groups[group]
    return {"group": group, "link": link, "bytes": formulas.ring_bytes_sent(collective, size, ranks)}


def _tensor_entries(config: GPTConfig, layout: Layout, a: Assumptions, layers: int, groups) -> list[dict]:
    """TP's collectives: every micro-batch's (their forward ones again when recomputing), the optimizer step's once,
    and with ``vocab_parallel`` the embedding's output and the head's input gradient summed over the ranks (two
    all-reduces of btc, reduce-scatters under SP) and the loss's three all-reduces of bt fp32 values."""
    b, t, s, m = a.micro_batch, config.block_size, a.value_bytes, a.micro_batches
    entries = []
    for key, value in formulas.tensor_parallel_collectives(config, b, t, layout.sequence, s, layers).items():
        collective, times = key.split()[0], 1 if "optimizer" in key else m
        times += m if a.recompute and key.endswith("forward") else 0
        entries.append(_entry("tp", collective, times * value["bytes"], groups))
    if a.vocab_parallel:
        entries.append(_entry("tp", "reduce-scatter" if layout.sequence else "all-reduce", 2 * m * b * t *
                              config.n_embd * s, groups))
        entries.append(_entry("tp", "all-reduce", 3 * m * b * t * 4, groups))
    return entries


def fits(total_bytes: float, gpu_memory_gb: float, margin: float) -> bool:
    """Whether ``total_bytes`` fit in ``(1 - margin)`` of ``gpu_memory_gb`` GB (1e9 bytes), the limit included."""
    return total_bytes <= gpu_memory_gb * GB - margin * gpu_memory_gb * GB


def layouts(gpus: int, gpus_per_node: int = 8) -> list[Layout]:
    """Every way to write ``gpus`` as data x tp x pp: each sharding of the data ranks (HSDP where they span nodes
    and a node holds several), TP with and without sequence parallelism, pipelines with 1F1B and interleaved 1F1B
    of two stages a rank. ZeRO-2 has no pipelined rows (DeepSpeed refuses it)."""
    found = []
    for tp in [d for d in range(1, gpus + 1) if gpus % d == 0]:
        for pp in [d for d in range(1, gpus // tp + 1) if (gpus // tp) % d == 0]:
            data = gpus // tp // pp
            for sharding in (SHARDINGS if data > 1 else ("DP",)):
                shard = gpus_per_node // tp
                if sharding == "HSDP" and not (1 < shard < data and data % shard == 0):
                    continue
                if sharding == "ZeRO-2" and pp > 1:
                    continue
                for sequence in ([False, True] if tp > 1 else [False]):
                    for virtual in ([1, 2] if pp > 1 else [1]):
                        found.append(Layout(data, tp, pp, sharding, sequence, virtual,
                                            shard if sharding == "HSDP" else 0))
    return found


def resolve_model(config: GPTConfig | str) -> GPTConfig:
    if isinstance(config, GPTConfig):
        return config
    if config not in MODELS:
        raise choice_error("model", config, tuple(MODELS))
    return MODELS[config]


def parallel_plan(config: GPTConfig | str, gpus: int, gpu_memory: float, intra_node: str = "nvlink4",
                  micro_batch: int = 1, micro_batches: int = 8, inter_node: str = "infiniband-ndr",
                  gpus_per_node: int = 8, bytes_per_parameter: int = 16, margin: float = 0.1,
                  recompute: bool = False, vocab_parallel: bool = False) -> pd.DataFrame:
    """Each layout of ``gpus`` GPUs of ``gpu_memory`` GB for ``config`` (a ``GPTConfig`` or a name in
    ``MODELS``) that torch's schedules accept for ``micro_batches``: GB on a GPU of the first and of the last
    pipeline stage, the fuller one's model state and activations, whether it fits (within ``1 - margin`` of the
    memory: the allocator, the CUDA context and temporaries need the rest), GB each GPU sends per step (those
    crossing nodes apart), their seconds at each group's link, and the bubble. ``bytes_per_parameter``: 16 (bf16
    gradients) or 18 (fp32 gradients). Sorted: fitting layouts first, the fewest link seconds first (the bubble is
    not priced in: read it beside). The layouts left out and the limit are in ``attrs``."""
    config = resolve_model(config)
    check_count("gpus", gpus, 1, MAX_GPUS, "GPUs in one plan")
    check_count("gpus_per_node", gpus_per_node, 1, MAX_GPUS, "GPUs in one node")
    check_count("micro_batch", micro_batch, 1, MAX_BATCH, "sequences per micro-batch")
    check_count("micro_batches", micro_batches, 1, MAX_MICRO_BATCHES, "micro-batches per step")
    number = isinstance(gpu_memory, (int, float)) and not isinstance(gpu_memory, bool)
    if not number or not 0 < gpu_memory <= MAX_GPU_MEMORY_GB:
        raise OptlabError(f"gpu_memory must be a number of GB above 0 and at most {MAX_GPU_MEMORY_GB}, "
                          f"got {gpu_memory!r}")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0 <= margin < 1:
        raise OptlabError(f"margin must be a fraction of the memory from 0 to below 1, got {margin!r}")
    for name, link in (("intra_node", intra_node), ("inter_node", inter_node)):
        if link not in INTERCONNECTS:
            raise choice_error(name, link, tuple(INTERCONNECTS))
    if bytes_per_parameter not in STATE_BYTES:
        raise OptlabError(f"bytes_per_parameter must be 16 (bf16 gradients) or 18 (fp32 gradients), "
                          f"got {bytes_per_parameter!r}")
    assumptions = Assumptions(micro_batch, micro_batches, gradient_bytes=STATE_BYTES[bytes_per_parameter],
                              recompute=recompute, vocab_parallel=vocab_parallel)
    cluster = Cluster(gpus_per_node, intra_node, inter_node)
    rows, refused = [], []
    for layout in layouts(gpus, gpus_per_node):
        refusal = formulas.schedule_problem(layout.pp, micro_batches, layout.virtual)
        if refusal:
            refused.append(f"{layout.name}: {refusal}")
            continue
        row = {"layout": layout.name, "sharding": layout.sharding, "data": layout.data, "tp": layout.tp,
               "pp": layout.pp, "virtual": layout.virtual}
        problem = layout.problem(config)
        rows.append(row | ({"fits": False, "note": problem} if problem else
                           _row(config, layout, assumptions, cluster, gpu_memory, margin)))
    table = pd.DataFrame(rows).sort_values(["fits", "link s per step", "sent GB per step"],
                                           ascending=[False, True, True], na_position="last")
    table = table.set_index("layout").round(3)
    table.attrs.update(limit_gb=gpu_memory - margin * gpu_memory, gpu_memory_gb=gpu_memory, margin=margin,
                       refused=refused, assumptions=assumptions, cluster=cluster)
    return table


def _row(config: GPTConfig, layout: Layout, assumptions: Assumptions, cluster: Cluster, gpu_memory: float,
         margin: float) -> dict:
    stages = ("first", "last") if layout.pp > 1 else ("first",)
    memory = {stage: memory_per_gpu(config, layout, assumptions, stage) for stage in stages}
    fuller = max(memory.values(), key=lambda held: held["total"])
    sends = {stage: traffic(config, layout, assumptions, stage, cluster) for stage in stages}
    seconds = {stage: sum(e["bytes"] / INTERCONNECTS[e["link"]] for e in sent) for stage, sent in sends.items()}
    slowest = sends[max(seconds, key=seconds.get)]
    return {"first stage GB": memory["first"]["total"] / GB,
            "last stage GB": memory[stages[-1]]["total"] / GB,
            "parameters per GPU (M)": fuller["parameters"] / 1e6,
            "state GB": (fuller["state"] + fuller["buckets"] + fuller["gathered"]) / GB,
            "activations GB": fuller["activations"] / GB, "total GB": fuller["total"] / GB,
            "fits": fits(fuller["total"], gpu_memory, margin),
            "sent GB per step": sum(e["bytes"] for e in slowest) / GB,
            "inter-node GB": sum(e["bytes"] for e in slowest if e["link"] == cluster.inter_node
                                 and cluster.inter_node != cluster.intra_node) / GB,
            "link s per step": max(seconds.values()),
            "bubble": formulas.bubble_fraction(layout.pp, assumptions.micro_batches, layout.virtual), "note": ""}


def fit_table(models: list[str], gpus: int, gpu_memory: float, chosen: tuple[str, ...] = (),
              **options: Any) -> pd.DataFrame:
    """GB per GPU (the fuller stage) of each model (rows) under each layout (columns, all by default, else
    ``chosen``), NaN where the layout cannot split the model; ``options`` go to :func:`parallel_plan`."""
    columns = {}
    for model in models:
        plan = parallel_plan(model, gpus, gpu_memory, **options)
        columns[model] = plan["total GB"]
    table = pd.DataFrame(columns).T
    return table[list(chosen)] if chosen else table


def bytes_per_step(config: GPTConfig, layout: Layout, assumptions: Assumptions = Assumptions(),
                   stage: str = "first", cluster: Cluster = Cluster()) -> float:
    """Bytes one GPU of the ``first`` or ``last`` stage sends in one step, on every link (:func:`traffic`)."""
    return sum(entry["bytes"] for entry in traffic(config, layout, assumptions, stage, cluster))


def plan_header(plan: pd.DataFrame) -> str:
    """The lines a printed plan starts with: its limit, its assumptions, the layouts torch's schedules refuse."""
    a, cluster, refused = plan.attrs["assumptions"], plan.attrs["cluster"], plan.attrs["refused"]
    lines = [f"fits: at most {plan.attrs['limit_gb']:.4g} GB a GPU ({1 - plan.attrs['margin']:.0%} of "
             f"{plan.attrs['gpu_memory_gb']:.4g} GB, GB = 1e9 bytes); model state "
             f"{a.state_bytes} bytes a parameter ({a.gradient_bytes}-byte gradients), DDP buckets counted; "
             f"{a.micro_batches} micro-batches of {a.micro_batch}; activations "
             f"{'recomputed' if a.recompute else 'kept'}; {cluster.gpus_per_node} GPUs a node on "
             f"{cluster.intra_node}, nodes on {cluster.inter_node}"]
    if refused:
        lines.append(f"left out, {len(refused)} layouts torch's schedules refuse, e.g. {refused[0]}")
    return "\n".join(lines)
