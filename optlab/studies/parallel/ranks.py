"""CPU processes joined by gloo for the parallelism chapters: joining the job on each rank, and launching one from
Python with rank 0's findings read back."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from ...core.errors import OptlabError
from ...core.knobs.limits import check_count
from ...core.results import store
from ..distributed import TORCHRUN_ENV, launch, torchrun_command

MAX_CPU_RANKS = 8  # more gloo processes than this only queue for a laptop's cores; the chapters need 2 or 4
FINDINGS = "findings.json"


@contextlib.contextmanager
def joined() -> Iterator[tuple[int, int]]:
    """This process in the job torchrun started, over gloo, with one thread: ``(rank, world size)``. Inside an
    outer ``joined()`` (several studies in one job) it uses the group already open and leaves it open."""
    if dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size()
        return
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise OptlabError(f"a rank command must be started by torchrun ({', '.join(missing)} not set); launch it as "
                          "torchrun --standalone --nproc-per-node N -m optlab.studies.parallel COMMAND --out DIR")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def write_findings(out: Path, findings: dict[str, Any]) -> None:
    """Rank 0's findings, written atomically to ``out``."""
    store.atomic_write_text(Path(out) / FINDINGS, json.dumps(findings))


def run_ranks(command: str, nproc: int, options: Sequence[str] = (), timeout: float = 300.0) -> dict[str, Any]:
    """Launch ``python -m optlab.studies.parallel COMMAND --out DIR OPTIONS`` on ``nproc`` CPU processes and return
    what rank 0 wrote."""
    check_count("processes", nproc, 2, MAX_CPU_RANKS, "gloo processes on one machine for these studies")
    with tempfile.TemporaryDirectory(prefix="optlab-parallel-") as folder:
        args = ["-m", "optlab.studies.parallel", command, "--out", folder, *options]
        launch(torchrun_command(args, nproc), timeout, threads=1)
        path = Path(folder) / FINDINGS
        if not path.exists():
            raise OptlabError(f"{command} on {nproc} processes ended without writing its findings")
        return json.loads(path.read_text())
