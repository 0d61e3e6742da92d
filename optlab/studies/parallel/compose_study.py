"""FSDP2 over tensor parallelism on a 2 x 2 mesh of 4 CPU ranks (torchtitan's "2D"): parity with one process, what
each rank holds, and the collectives of a step, each beside its formula.

The mesh's rows are data-parallel (``dp``: each row trains on its own batch, FSDP2 shards over it), its columns
tensor-parallel (``tp``: the two ranks of a row split every block, chapter 19). Rank 0 writes the findings.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ...core.gpt.transformer import GPT
from ...core.knobs.limits import check_count
from ..distributed import state_bytes
from . import formulas, planner
from .ranks import joined, run_ranks, write_findings
from .tensor import full_state, tensor_parallel
from .tensor_study import BATCH, CONFIG, logged_step, loss_of, token_batch

MESH = (2, 2)  # (dp, tp)
MAX_STEPS = 100
SETUPS = {"FSDP2 x TP": True, "FSDP2 x TP, no reshard after forward": False}  # reshard_after_forward
MICRO_BATCHES = 4  # the accumulated step: plain gradient accumulation over this many micro-batches


def two_d(model: GPT, mesh, reshard_after_forward: bool = True) -> GPT:
    """``model`` split over ``mesh["tp"]`` (:func:`.tensor.tensor_parallel`), then sharded by FSDP2 over
    ``mesh["dp"]``, one unit per block and the root."""
    model = tensor_parallel(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _global_batch(step: int) -> torch.Tensor:
    return torch.cat([token_batch(step * MESH[0] + row) for row in range(MESH[0])])


def accumulated_collectives(model: GPT, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]) -> dict:
    """The collectives of one step of plain gradient accumulation over ``batches`` (forward and backward of each,
    then one optimizer step), per (collective, pass)."""
    from .collectives import CollectiveLog  # late import: it imports torch._dynamo, a second at every process start

    log = CollectiveLog()
    with log:
        for batch in batches:
            log.phase = "forward"
            loss = loss_of(model, batch) / len(batches)
            log.phase = "backward"
            loss.backward()
        log.phase = "optimizer step"
        optimizer.step()
    return log.summary()


def compose_rank(out: Path, steps: int) -> None:
    """One rank of the study (run under torchrun); rank 0 writes the findings."""
    from .collectives import CollectiveLog  # late import: see accumulated_collectives

    with joined() as (rank, world):
        mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
        row = mesh["dp"].get_local_rank()
        torch.manual_seed(0)
        initial = GPT(CONFIG)
        reference = copy.deepcopy(initial)
        reference_optimizer = _optimizer(reference)
        reference_gradients = None
        for step in range(steps):
            reference_optimizer.zero_grad()
            loss_of(reference, _global_batch(step)).backward()
            if step == 0:
                reference_gradients = {n: p.grad.clone() for n, p in reference.named_parameters()}
            reference_optimizer.step()
        findings = {"mesh": list(MESH), "steps": steps, "setups": {}}
        for setup, reshard in SETUPS.items():
            model = two_d(copy.deepcopy(initial), mesh, reshard)
            optimizer, log = _optimizer(model), CollectiveLog()
            gradient = 0.0
            for step in range(steps):
                optimizer.zero_grad()
                batch = token_batch(step * MESH[0] + row)
                logged_step(model, optimizer, batch, log if step == 0 else None)
                if step == 0:
                    gradients = full_state(model, MESH[1], gradients=True)
                    gradient = max(float((gradients[n] - reference_gradients[n]).abs().max()) for n in gradients)
            parameters = full_state(model, MESH[1])
            held = state_bytes(model, optimizer)
            findings["setups"][setup] = {
                "collectives": log.summary(), "gradient": gradient, "held": held,
                "parameter": max(float((parameters[n] - p).abs().max()) for n, p in reference.named_parameters()),
                "moved by training": max(float((p - q).abs().max()) for p, q in
                                         zip(reference.parameters(), initial.parameters()))}
        model = two_d(copy.deepcopy(initial), mesh)
        batches = [token_batch(100 + MICRO_BATCHES * row + i) for i in range(MICRO_BATCHES)]
        findings["accumulated"] = {"micro_batches": MICRO_BATCHES,
                                   "collectives": accumulated_collectives(model, _optimizer(model), batches)}
        if rank == 0:
            write_findings(out, findings)


@dataclass(frozen=True)
class ComposeStudy:
    """What rank 0 measured on the 2 x 2 mesh."""

    mesh: list[int]
    steps: int
    setups: dict[str, dict]
    accumulated: dict  # one step of plain accumulation over ``micro_batches``: its collectives

    def parity_table(self) -> pd.DataFrame:
        return pd.DataFrame({setup: {key: found[key] for key in ("gradient", "parameter", "moved by training")}
                             for setup, found in self.setups.items()}).T

    def memory_table(self) -> pd.DataFrame:
        """Bytes one rank holds after a step of SGD with momentum, beside the formula: a quarter of the model's
        split parts (halved by TP, then by FSDP2), half of the parts TP keeps whole."""
        expected = 4 * formulas.model_parameters(CONFIG, self.mesh[1]) // self.mesh[0]
        rows = {setup: {**found["held"], "formula, each": expected} for setup, found in self.setups.items()}
        one = 4 * formulas.model_parameters(CONFIG)
        rows["one process"] = {"parameters": one, "gradients": one, "optimizer state": one, "formula, each": one}
        return pd.DataFrame(rows).T

    def planner_table(self) -> pd.DataFrame:
        """FSDP2 x TP (resharding after forward, as the planner assumes): the model state one rank holds and the
        bytes it sends on rings in one step (TP's all-reduces within a row, FSDP2's gathers and reduce-scatters
        within a column), measured and as :mod:`.planner` predicts them for this GPT (fp32 weights, gradients and
        momentum: 12 bytes a parameter)."""
        layout = planner.Layout(data=self.mesh[0], tp=self.mesh[1], sharding="FSDP")
        assumptions = planner.Assumptions(micro_batch=BATCH, micro_batches=1, weight_bytes=4, gradient_bytes=4,
                                          optimizer_bytes=4, value_bytes=4)
        rows = []
        for setup, found in self.setups.items():
            if not SETUPS[setup]:
                continue
            ranks = {"all-reduce": self.mesh[1], "all-gather": self.mesh[0], "reduce-scatter": self.mesh[0]}
            sent = sum(formulas.ring_bytes_sent(key.split()[0], value["bytes"], ranks[key.split()[0]])
                       for key, value in found["collectives"].items())
            rows.append({"setup": setup, "state bytes": sum(found["held"][part] for part in
                                                            ("parameters", "gradients", "optimizer state")),
                         "state, planner": planner.memory_per_gpu(CONFIG, layout, assumptions)["state"],
                         "sent per rank": sent,
                         "sent, planner": planner.bytes_per_step(CONFIG, layout, assumptions)})
        return pd.DataFrame(rows).set_index("setup")

    def accumulation_table(self) -> pd.DataFrame:
        """One step of plain gradient accumulation (FSDP2's defaults, resharding after forward): per collective,
        the calls and bytes counted and the formulas' (FSDP2 gathers and reduce-scatters every micro-batch; TP's
        collectives run every micro-batch, the optimizer step's once)."""
        m, counted = self.accumulated["micro_batches"], self.accumulated["collectives"]
        expected = {key: {"calls": value["calls"] * (1 if "optimizer" in key else m),
                          "bytes": value["bytes"] * (1 if "optimizer" in key else m)}
                    for key, value in formulas.tensor_parallel_collectives(CONFIG, BATCH, CONFIG.block_size).items()}
        for key, value in formulas.fsdp_collectives(CONFIG, self.mesh[1], True, micro_batches=m).items():
            both = expected.get(key, {"calls": 0, "bytes": 0})
            expected[key] = {"calls": both["calls"] + value["calls"], "bytes": both["bytes"] + value["bytes"]}
        rows = []
        for key in sorted(set(counted) | set(expected)):
            got, want = counted.get(key, {"calls": 0, "bytes": 0}), expected.get(key, {"calls": 0, "bytes": 0})
            rows.append({"collective": key, "calls": got["calls"], "formula calls": want["calls"],
                         "bytes": got["bytes"], "formula bytes": want["bytes"]})
        return pd.DataFrame(rows).set_index("collective")

    def accumulation_sent(self) -> dict[str, float]:
        """Bytes one rank sent on rings in the accumulated step, counted and as :mod:`.planner` predicts them."""
        m, ranks = self.accumulated["micro_batches"], {"all-reduce": self.mesh[1]}
        sent = sum(formulas.ring_bytes_sent(key.split()[0], value["bytes"], ranks.get(key.split()[0], self.mesh[0]))
                   for key, value in self.accumulated["collectives"].items())
        layout = planner.Layout(data=self.mesh[0], tp=self.mesh[1], sharding="FSDP")
        assumptions = planner.Assumptions(micro_batch=BATCH, micro_batches=m, weight_bytes=4, gradient_bytes=4,
                                          optimizer_bytes=4, value_bytes=4)
        return {"sent per rank": sent, "sent, planner": planner.bytes_per_step(CONFIG, layout, assumptions)}

    def collectives_table(self) -> pd.DataFrame:
        """Per setup and collective: calls and bytes counted, and the formulas' (TP's within each row, FSDP2's
        across the rows)."""
        b = BATCH
        rows = []
        for setup, found in self.setups.items():
            expected = dict(formulas.tensor_parallel_collectives(CONFIG, b, CONFIG.block_size))
            for key, value in formulas.fsdp_collectives(CONFIG, self.mesh[1], SETUPS[setup]).items():
                both = expected.get(key, {"calls": 0, "bytes": 0})
                expected[key] = {"calls": both["calls"] + value["calls"], "bytes": both["bytes"] + value["bytes"]}
            counted = found["collectives"]
            for key in sorted(set(counted) | set(expected)):
                got, want = counted.get(key, {"calls": 0, "bytes": 0}), expected.get(key, {"calls": 0, "bytes": 0})
                rows.append({"setup": setup, "collective": key, "calls": got["calls"], "formula calls": want["calls"],
                             "bytes": got["bytes"], "formula bytes": want["bytes"]})
        return pd.DataFrame(rows).set_index(["setup", "collective"])


def compose_study(steps: int = 2, timeout: float = 300.0) -> ComposeStudy:
    """Launch the study on 4 CPU processes and return what rank 0 measured."""
    check_count("steps", steps, 1, MAX_STEPS, "parity steps")
    return ComposeStudy(**run_ranks("compose-rank", MESH[0] * MESH[1], ["--steps", str(steps)], timeout))
