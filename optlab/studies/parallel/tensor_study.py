"""Tensor and sequence parallelism on 2 CPU ranks against one process: parity, the collectives of a step with their
bytes, what each rank holds, and the step time, each beside its formula (:mod:`.formulas`).

Every rank runs the same batches (tensor parallelism splits the model, not the data), and every rank also trains
the one-process reference, so the check needs no second job. Rank 0 writes the findings; :func:`tensor_study`
launches the job and reads them back.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from ...core.errors import OptlabError
from ...core.gpt.transformer import GPT, GPTConfig
from ...core.knobs.limits import check_count
from . import formulas, planner
from .held import parameter_bytes, saved_activation_bytes
from .ranks import joined, run_ranks, write_findings
from .tensor import full_state, tensor_parallel

if TYPE_CHECKING:
    from .collectives import CollectiveLog

# A GPT whose sizes all differ (b x t = 48 != c = 40 would hide a transposed count; 3 x 16 x 48 does not).
CONFIG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=48)
BATCH = 3
PARITY_TOLERANCE = 1e-5  # max |difference| of a loss, a gradient or a parameter from one process's, fp32
SETUPS = {"TP": False, "TP + SP": True}  # the setup's name: sequence parallel or not
MAX_STEPS, MAX_ROUNDS = 100, 200


def token_batch(seed: int, b: int = BATCH, t: int = CONFIG.block_size) -> torch.Tensor:
    """``b`` random sequences of ``t + 1`` tokens (inputs and next-token targets), the same for the same seed."""
    return torch.randint(0, CONFIG.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(seed))


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def logged_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
                log: CollectiveLog | None = None) -> float:
    """One training step, with its collectives noted in ``log`` by phase when one is given; the loss."""
    def phase(name: str) -> None:
        if log is not None:
            log.phase = name

    with log if log is not None else contextlib.nullcontext():
        phase("forward")
        loss = loss_of(model, batch)
        phase("backward")
        loss.backward()
        phase("optimizer step")
        optimizer.step()
    return float(loss.detach())


def _run(model: torch.nn.Module, tp: int, steps: int) -> dict:
    """``steps`` SGD steps with momentum on the shared batches: the losses, the first step's collectives and
    gradients (in full), and the final parameters (in full)."""
    from .collectives import CollectiveLog  # late import: it imports torch._dynamo, a second at every process start

    optimizer, log = _optimizer(model), CollectiveLog()
    losses = [logged_step(model, optimizer, token_batch(0), log)]
    gradients = full_state(model, tp, gradients=True)
    for step in range(1, steps):
        optimizer.zero_grad()
        loss = loss_of(model, token_batch(step))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "collectives": log.summary(), "gradients": gradients,
            "parameters": full_state(model, tp)}


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in b)


def _step_ms(model: torch.nn.Module, rounds: int, together: bool = True) -> float:
    """Median milliseconds of a training step over ``rounds`` steps after one warm-up; ``together``: every rank
    steps, and a step lasts until its slowest rank ends."""
    optimizer, times = _optimizer(model), []
    for index in range(rounds + 1):
        if together:
            dist.barrier()
        start = time.perf_counter()
        loss_of(model, token_batch(1000 + index)).backward()
        optimizer.step()
        optimizer.zero_grad()
        elapsed = torch.tensor(time.perf_counter() - start)
        if together:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if index:
            times.append(1e3 * float(elapsed))
    return statistics.median(times)


def tensor_rank(out: Path, steps: int, rounds: int) -> None:
    """One rank of the study (run under torchrun); rank 0 writes the findings."""
    with joined() as (rank, world):
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        initial = GPT(CONFIG)
        reference = _run(copy.deepcopy(initial), 1, steps)
        moved = _largest_difference(reference["parameters"], dict(initial.named_parameters()))
        rows = [{"setup": "one process", "ranks": 1, "parameter bytes": parameter_bytes(initial),
                 "activation bytes": _activations(initial),
                 "step ms": _step_ms(copy.deepcopy(initial), rounds, together=False) if rank == 0 else 0.0}]
        collectives, parity = {}, []
        for setup, sequence in SETUPS.items():
            model = tensor_parallel(copy.deepcopy(initial), mesh, sequence)
            rows.append({"setup": setup, "ranks": world, "parameter bytes": parameter_bytes(model),
                         "activation bytes": _activations(model)})
            run = _run(model, world, steps)
            collectives[setup] = run["collectives"]
            parity.append({"setup": setup, "steps": steps, "loss": max(
                abs(a - b) for a, b in zip(run["losses"], reference["losses"])),
                "gradient": _largest_difference(run["gradients"], reference["gradients"]),
                "parameter": _largest_difference(run["parameters"], reference["parameters"]),
                "moved by training": moved})
            rows[-1]["step ms"] = _step_ms(tensor_parallel(copy.deepcopy(initial), mesh, sequence), rounds)
        if rank == 0:
            write_findings(out, {"world_size": world, "steps": steps, "rounds": rounds, "held": rows,
                                 "collectives": collectives, "parity": parity})


def _activations(model: torch.nn.Module) -> int:
    batch = token_batch(0)
    return saved_activation_bytes(model, lambda: loss_of(model, batch), (batch,))


@dataclass(frozen=True)
class TensorStudy:
    """What rank 0 measured, with the tables the chapter shows beside the formulas."""

    world_size: int
    steps: int
    rounds: int
    held: list[dict]  # per setup: bytes of parameters and of saved activations on one rank, the step time
    collectives: dict[str, dict[str, dict[str, int]]]  # per setup, per "collective pass": calls and bytes
    parity: list[dict]  # per setup: the largest loss, gradient and parameter differences from one process

    def parity_table(self) -> pd.DataFrame:
        """The largest difference from one process of the losses, the first step's gradients and the final
        parameters, beside how far training moved the parameters."""
        return pd.DataFrame(self.parity).set_index("setup")

    def collectives_table(self) -> pd.DataFrame:
        """One row per setup and collective: calls and bytes counted, the formula's, and the bytes each rank sends
        on a ring."""
        rows = []
        for setup, counted in self.collectives.items():
            expected = formulas.tensor_parallel_collectives(CONFIG, BATCH, CONFIG.block_size, SETUPS[setup])
            for key in sorted(set(counted) | set(expected)):
                got, want = counted.get(key, {"calls": 0, "bytes": 0}), expected.get(key, {"calls": 0, "bytes": 0})
                rows.append({"setup": setup, "collective": key, "calls": got["calls"], "formula calls": want["calls"],
                             "bytes": got["bytes"], "formula bytes": want["bytes"],
                             "sent per rank": formulas.ring_bytes_sent(key.split()[0], got["bytes"], self.world_size)})
        return pd.DataFrame(rows).set_index(["setup", "collective"])

    def memory_table(self) -> pd.DataFrame:
        """Bytes one rank holds of parameters and of saved activations, beside the formulas'."""
        rows = []
        for row in self.held:
            tp, sequence = row["ranks"], SETUPS.get(row["setup"], False)
            rows.append({"setup": row["setup"], "parameter bytes": row["parameter bytes"],
                         "parameters, formula": 4 * formulas.model_parameters(CONFIG, tp),
                         "activation bytes": row["activation bytes"],
                         "activations, formula": formulas.activation_bytes(CONFIG, BATCH, CONFIG.block_size, tp,
                                                                           sequence)})
        return pd.DataFrame(rows).set_index("setup")

    def planner_table(self) -> pd.DataFrame:
        """Per tensor-parallel setup: activations one rank saved and the bytes it sent on a ring in one step, as
        measured and as :mod:`.planner` predicts them for this GPT (fp32, one micro-batch of the run's batch)."""
        rows, assumptions = [], planner.Assumptions(micro_batch=BATCH, micro_batches=1, value_bytes=4)
        for row in self.held[1:]:
            setup, layout = row["setup"], planner.Layout(tp=row["ranks"], sequence=SETUPS[row["setup"]])
            sent = self.collectives_table().loc[setup, "sent per rank"].sum()
            rows.append({"setup": setup, "activation bytes": row["activation bytes"],
                         "activations, planner": planner.memory_per_gpu(CONFIG, layout, assumptions)["activations"],
                         "sent per rank": sent,
                         "sent, planner": planner.bytes_per_step(CONFIG, layout, assumptions)})
        return pd.DataFrame(rows).set_index("setup")

    def whole_values(self) -> dict[str, int]:
        """Values one block keeps whole on every rank (:func:`.formulas.whole_under_tp_values`) for this run's GPT,
        batch and ranks, under TP and under TP + SP."""
        return {setup: formulas.whole_under_tp_values(CONFIG, BATCH, CONFIG.block_size, self.world_size, sequence)
                for setup, sequence in SETUPS.items()}

    def timing_table(self) -> pd.DataFrame:
        """Median step time per setup on this machine's CPU processes (gloo over loopback, not a GPU link)."""
        return pd.DataFrame([{"setup": row["setup"], "ranks": row["ranks"], "step ms (median)": row["step ms"]}
                             for row in self.held]).set_index("setup").round(2)


def tensor_study(nproc: int = 2, steps: int = 3, rounds: int = 10, timeout: float = 300.0) -> TensorStudy:
    """Launch the study on ``nproc`` CPU processes and return what rank 0 measured."""
    try:
        check_count("nproc", nproc, 2, CONFIG.n_head, f"the GPT's {CONFIG.n_head} heads split over at most as many ranks")
        if CONFIG.n_head % nproc:
            raise OptlabError(f"nproc must divide the GPT's {CONFIG.n_head} heads, got {nproc}")
        check_count("steps", steps, 1, MAX_STEPS, "parity steps")
        check_count("rounds", rounds, 1, MAX_ROUNDS, "timed steps per setup")
    except OptlabError as error:
        raise OptlabError(f"tensor parallel study: {error}") from None
    findings = run_ranks("tensor-rank", nproc, ["--steps", str(steps), "--rounds", str(rounds)], timeout)
    return TensorStudy(**findings)
