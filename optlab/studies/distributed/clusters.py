"""The launch lines for many GPUs: several on one machine (torchrun, standalone) and several nodes (torchrun with a
c10d rendezvous, by hand or under SLURM's ``srun``). The training script does not change; the launch does."""
from __future__ import annotations

import shlex

from ...core.errors import OptlabError
from ...core.knobs.limits import check_count

MAX_NODES, MAX_GPUS_PER_NODE = 4096, 64
SCRIPT = "-m optlab.studies.distributed shard-rank --out results/shard"  # every rank runs this; rank 0 writes the study


def cluster_commands(nnodes: int = 2, gpus_per_node: int = 8, endpoint: str = "node0:29500",
                     job_id: str = "optlab-shard") -> dict[str, str]:
    """The shell lines that run the sharding study on one machine's GPUs, on ``nnodes`` nodes by hand, and under
    SLURM. Every process finds its rank in RANK, LOCAL_RANK and WORLD_SIZE, takes ``cuda:LOCAL_RANK``, and joins NCCL."""
    check_count("nnodes", nnodes, 2, MAX_NODES, "nodes in one job")
    check_count("gpus_per_node", gpus_per_node, 1, MAX_GPUS_PER_NODE, "GPUs one node holds")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise OptlabError(f"endpoint must be HOST:PORT with a port from 1 to 65535, got {endpoint!r}")
    rendezvous = (f"--rdzv-backend c10d --rdzv-endpoint {shlex.quote(endpoint)} --rdzv-id {shlex.quote(job_id)}")
    slurm_torchrun = (f"torchrun --nnodes $SLURM_NNODES --nproc-per-node {gpus_per_node} --rdzv-backend c10d "
                      f"--rdzv-endpoint $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1):{port} "
                      f"--rdzv-id $SLURM_JOB_ID {SCRIPT}")
    return {
        "one machine": f"torchrun --standalone --nproc-per-node {gpus_per_node} {SCRIPT}",
        "each node": f"torchrun --nnodes {nnodes} --nproc-per-node {gpus_per_node} {rendezvous} {SCRIPT}",
        "SLURM": (f"srun --nodes {nnodes} --ntasks-per-node 1 --gpus-per-node {gpus_per_node} "
                  f"bash -c {shlex.quote(slurm_torchrun)}"),
    }


ENVIRONMENT = {
    "RANK, WORLD_SIZE": "this process's place in the whole job, and the job's size: set by torchrun",
    "LOCAL_RANK": "which GPU of its node the process takes (cuda:LOCAL_RANK)",
    "MASTER_ADDR, MASTER_PORT": "where the default process group meets: set by torchrun from the rendezvous",
    "NCCL_SOCKET_IFNAME": "the network interface NCCL uses between nodes (e.g. eth0, ib0)",
    "NCCL_DEBUG=INFO": "prints the transport NCCL chose (NVLink, InfiniBand, sockets)",
}
