"""Data-parallel training under ``torchrun``: DistributedDataParallel, a DistributedSampler, timings gathered to rank 0.

Launch one process per device (``torchrun --nproc-per-node N -m optlab run TECHNIQUE --distributed``); NCCL joins
GPUs, gloo joins CPU processes. Every rank trains a replica on its own shard of the data; DDP averages the gradients
in buckets while backward runs. The package holds one job per module: ``group`` (joining the job, timeouts,
gathering), ``training`` (the timed run on every rank), ``launch`` (torchrun from Python), ``scaling`` (efficiency
and stored runs) and ``parity`` (``python -m optlab.studies.distributed parity``).

Sharded training (FSDP2) has its own modules: ``sharding`` (``fully_shard`` over a model's blocks, the GPT it trains,
the bytes a rank holds), ``shard_study`` (DDP against FSDP2 on every rank), ``shard_scaling`` (larger worlds under a
fake group), ``shard_checkpoint`` (``torch.distributed.checkpoint``), ``clusters`` (launch lines for GPUs and nodes)
and ``shard_commands`` (``python -m optlab.studies.distributed shard-check``).
"""
from .group import TIMEOUT_ENV, TORCHRUN_ENV, Group, gather, process_group, timeout_s
from .launch import job_of_one, launch, torchrun_command
from .parity import PARITY_TOLERANCE, Parity, check_for_run, main, parity
from .scaling import STORED_DIR, ring_allreduce_s, scaling, stored_samples
from .clusters import ENVIRONMENT, cluster_commands
from .shard_checkpoint import ROUND_TRIP_TOLERANCE, load_checkpoint, loaded_outputs, save_sharded
from .shard_study import SHARD_TOLERANCE, ShardStudy, shard_study
from .sharding import TRANSFORMER, Workload, build_transformer, shard, state_bytes
from .training import (
    SYNC_SUFFIX, ddp_step, ddp_variants, distributed_loader, merge_ranks, run_distributed, sync_context,
    wrap,
)

__all__ = [
    "Group", "PARITY_TOLERANCE", "Parity", "STORED_DIR", "SYNC_SUFFIX", "TIMEOUT_ENV", "TORCHRUN_ENV", "check_for_run",
    "ddp_step", "ddp_variants", "distributed_loader", "gather", "job_of_one", "launch", "main", "merge_ranks", "parity",
    "process_group",
    "ring_allreduce_s", "run_distributed", "scaling", "stored_samples", "sync_context", "timeout_s",
    "torchrun_command", "wrap",
    # sharded training (FSDP2)
    "ENVIRONMENT", "ROUND_TRIP_TOLERANCE", "SHARD_TOLERANCE", "ShardStudy", "TRANSFORMER", "Workload",
    "build_transformer", "cluster_commands", "load_checkpoint", "loaded_outputs", "save_sharded", "shard",
    "shard_study", "state_bytes",
]
