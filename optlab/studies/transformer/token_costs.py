"""What a token costs on a token model (the GPT): tokens per step, FLOPs per token counted by
``torch.utils.flop_counter`` (attention's share apart), and a run's tokens/s and MFU beside them.

The FLOPs are counted as :func:`optlab.core.measuring.flops.forward_flops_of` counts them: on the meta device, under the
workload's counting knobs (the hand-written attention, whose score and weighted-sum matmuls the counter sees as
``aten.bmm``: the same arithmetic a fused kernel does).
"""
from __future__ import annotations

import pandas as pd

from ...core.knobs.config import RunConfig
from ...core.errors import OptlabError
from ...core.measuring.flops import TRAIN_TO_FORWARD, forward_flop_counts, forward_flops_of
from ...core.workload import get_workload

ATTENTION_OPS = ("aten.bmm",)  # q @ k^T and weights @ v; the linears count as addmm / mm


def tokens_per_step(config: RunConfig) -> int:
    """Items (tokens) one optimizer step of ``config`` trains on: its sequences times their length."""
    return config.samples_per_step * get_workload(config.workload).items_in(config)


def attention_flops_of(config: RunConfig) -> int:
    """FLOPs of the attention matmuls (scores and weighted sum) in one forward pass over one sequence of ``config``,
    counted by FlopCounterMode under the workload's counting knobs (``optlab.core.measuring.flops.forward_flop_counts``)."""
    return sum(count for op, count in forward_flop_counts(config).items() if op in ATTENTION_OPS)


def flops_per_token(config: RunConfig) -> dict[str, float]:
    """Forward FLOPs per token of ``config`` (one sequence's count over its length), attention's part of them, and
    training FLOPs per token (forward + backward, as optlab's MFU counts them)."""
    items = get_workload(config.workload).items_in(config)
    forward = forward_flops_of(config) / items
    return {"forward FLOPs/token": forward, "attention FLOPs/token": attention_flops_of(config) / items,
            "training FLOPs/token": TRAIN_TO_FORWARD * forward}


def _median_rate(samples: pd.DataFrame | None, label: str) -> float:
    if samples is None or "items_per_s" not in samples:
        return float("nan")
    rows = samples[(samples["variant"] == label) & (samples["status"] == "ok") & (samples["phase"] == "train")]
    return float(rows["items_per_s"].median()) if not rows.empty else float("nan")


def shape_table(configs: dict[str, RunConfig], samples: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per variant (label -> config): its vocabulary, sequences x tokens per step, the tokens per step, its
    FLOPs per token (:func:`flops_per_token`) and, with a run's ``samples``, the median tokens/s it trained at."""
    if not configs:
        raise OptlabError("shape_table needs at least one config (label -> RunConfig), got none")
    rows = []
    for label, config in configs.items():
        workload = get_workload(config.workload)
        rows.append({"variant": label, "vocab": config.vocab_size, "sequences": config.samples_per_step,
                     f"{workload.unit} per sequence": workload.items_in(config),
                     f"{workload.unit} per step": tokens_per_step(config), **flops_per_token(config),
                     f"{workload.unit}/s (median)": _median_rate(samples, label)})
    return pd.DataFrame(rows)


def stack_throughput(summary: pd.DataFrame, mfu: pd.DataFrame, labels: "list[str] | tuple[str, ...]",
                     phase: str = "train") -> pd.DataFrame:
    """A stack's steps in order (``labels``), each with its median throughput in the workload's unit, its MFU
    (rows of ``optlab.studies.limits.peaks.mfu_table``), the precision and peak it is measured against (where each peak comes
    from is said once, by ``peak_sources``) and its peak memory."""
    rows = summary[summary["phase"] == phase].drop_duplicates(["model", "variant"]).set_index(["model", "variant"])
    mfu = mfu.set_index(["model", "variant"])
    out = []
    for model in dict.fromkeys(rows.index.get_level_values("model")):
        for label in labels:
            if (model, label) not in rows.index:
                continue
            row = rows.loc[(model, label)]
            unit = row["unit"] if isinstance(row.get("unit"), str) else "items"
            found = (model, label) in mfu.index
            out.append({"model": model, "step": label, f"{unit}/s (median)": row["items_per_s"],
                        "MFU %": mfu.loc[(model, label), "MFU %"] if found else float("nan"),
                        "precision": mfu.loc[(model, label), "precision"] if found else None,
                        "peak TFLOP/s": mfu.loc[(model, label), "peak TFLOP/s"] if found else float("nan"),
                        "peak MiB": row["peak_mem_mb"]})
    return pd.DataFrame(out)


def peak_sources(mfu: pd.DataFrame) -> str:
    """Where the peaks of an MFU table (rows of ``optlab.studies.limits.peaks.mfu_table``) come from, each source once with
    the precisions and peaks it gave: the line a table of many rows states instead of repeating it on each."""
    if mfu.empty:
        raise OptlabError("an empty MFU table has no peaks to name")
    lines = []
    for source, rows in mfu.drop_duplicates("precision").groupby("peak source", sort=False):
        rates = ", ".join(f"{precision} {tflops:.4g} TFLOP/s"
                          for precision, tflops in zip(rows["precision"], rows["peak TFLOP/s"]))
        lines.append(f"{rates}: {source}")
    return "peaks: " + "; ".join(lines)
