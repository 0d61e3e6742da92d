"""Saving and loading a sharded model with ``torch.distributed.checkpoint`` (DCP).

Each rank writes only its own shards, and a metadata file records which slice of which parameter each file holds, so a
job with another number of ranks, or one process, can load the checkpoint: DCP reads the slices each loading rank
needs and reshards on the way in.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from ...core.errors import OptlabError
from .sharding import TRANSFORMER, Workload

PROBE_SEED = 10_000  # the batch on which the saved and the loaded model are compared
ROUND_TRIP_TOLERANCE = 1e-5  # max |logit difference|: the same fp32 weights, summed in another order at most


def save_sharded(model: nn.Module, folder: str | Path) -> None:
    """Every rank writes its shards of ``model`` (sharded or not) under ``folder``; call it on every rank."""
    dcp.save(get_model_state_dict(model), checkpoint_id=str(folder))


def load_checkpoint(folder: str | Path, model: nn.Module) -> nn.Module:
    """Load ``folder`` into ``model``, whatever number of ranks wrote it: call it on every rank of the loading job,
    or in one process without a process group."""
    if not (Path(folder) / ".metadata").is_file():
        raise OptlabError(f"{folder} is not a torch.distributed.checkpoint folder (it has no .metadata file)")
    state = get_model_state_dict(model)
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is what no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state)
    return model


def loaded_outputs(folder: str | Path, batch_size: int, workload: Workload = TRANSFORMER) -> torch.Tensor:
    """The logits on the probe batch of a fresh model, in this one process, after loading ``folder``."""
    torch.manual_seed(1)  # weights other than the saved ones, so a load that does nothing shows
    model = load_checkpoint(folder, workload.build())
    with torch.no_grad():
        return model(workload.batch(batch_size, PROBE_SEED))
