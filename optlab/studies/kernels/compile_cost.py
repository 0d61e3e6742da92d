"""What torch.compile costs and when it pays for itself, read from a run's samples.

A compiled model builds its graph on the first call that sees a new graph: once per variant and phase, in the first
warm-up step of repeat 0 (``model.eval()`` in the test phase changes the graph, so that phase's repeat 0 compiles
again). Later repeats reuse the compiled code. So, per model, phase and variant:

- compile time: the first warm-up step of repeat 0 minus the variant's median step (for eager, the same difference
  is its own first-step extra: cold caches, allocator growth);
- saving per step: the eager median step minus the compiled median step;
- payoff: compile time / saving, the steps after which compiling has paid for itself; infinite ("never") when the
  compiled step is not faster;
- Inductor's caches: "cold" when every cache lookup of that first pass missed (compiled from scratch), "warm" when
  every one hit (code another run had compiled and saved on disk): a warm compile time is far shorter.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from ...core.results import store
from ...core.errors import OptlabError

COST_COLUMNS = ["model", "phase", "variant", "compile_s", "step_ms", "eager_step_ms", "saving_ms", "payoff_steps",
                "payoff_epochs", "graphs_compiled", "inductor_cache", "verdict"]
LOSS_RTOL = {"none": 1e-3, "fp16": 0.05, "bf16": 0.05}  # first-step loss, compiled against eager, by autocast dtype


def _samples(record: dict[str, Any]) -> pd.DataFrame:
    if record["profile"].get("warmup_repeats", 0):
        raise OptlabError(
            f"this run discarded its first {record['profile']['warmup_repeats']} repeat(s), and compilation happened "
            "there; compile costs need a profile without warm-up repeats (smoke or quick)")
    samples = pd.DataFrame(record["samples"])
    if samples.empty or "status" not in samples:
        raise OptlabError("the record has no samples; run the experiment first")
    samples = samples[samples["status"] == "ok"]
    if samples["first_step_s"].isna().any():
        raise OptlabError("compile costs need at least one warm-up step per repeat (the profile's warmup_steps >= 1)")
    return samples


def compile_costs(record: dict[str, Any]) -> pd.DataFrame:
    """Compile time, step times, saving and payoff per model, phase and variant of a run record (live or stored)."""
    samples, baseline = _samples(record), record["baseline"]
    verdicts = {(s["model"], s["phase"], s["variant"]): s["verdict"] for s in record.get("summary", [])}
    rows = []
    for (model, phase), group in samples.groupby(["model", "phase"], sort=False):
        steps = {variant: float(np.median(np.concatenate(runs["step_times_s"].map(np.asarray).to_list())))
                 for variant, runs in group.groupby("variant", sort=False)}
        if baseline not in steps:
            raise OptlabError(f"{model} {phase}: no samples of the baseline {baseline!r}; variants: {list(steps)}")
        for variant, runs in group.groupby("variant", sort=False):
            first = runs[runs["repeat"] == runs["repeat"].min()].iloc[0]
            compile_s = float(first["first_step_s"]) - steps[variant]
            saving = steps[baseline] - steps[variant]
            payoff = math.nan if variant == baseline else math.inf if saving <= 0 else compile_s / saving
            rows.append({
                "model": model, "phase": phase, "variant": variant, "compile_s": compile_s,
                "step_ms": 1e3 * steps[variant], "eager_step_ms": 1e3 * steps[baseline], "saving_ms": 1e3 * saving,
                "payoff_steps": payoff, "payoff_epochs": payoff * first["images_per_step"] / first["epoch_images"],
                "graphs_compiled": runs["graphs_compiled"].sum() if "graphs_compiled" in runs else math.nan,
                "inductor_cache": first.get("inductor_cache"),
                "verdict": verdicts.get((model, phase, variant), ""),
            })
    return pd.DataFrame(rows, columns=COST_COLUMNS)


def _payoff_text(value: float, digits: int) -> str:
    if math.isnan(value):
        return ""  # the baseline: nothing to pay off
    return "never" if math.isinf(value) else f"{value:,.{digits}f}"


def cost_table(costs: pd.DataFrame) -> pd.DataFrame:
    """The costs as a readable table; a payoff that never comes reads "never"."""
    table = costs.copy()
    table["payoff_steps"] = [_payoff_text(v, 0) for v in table["payoff_steps"]]
    table["payoff_epochs"] = [_payoff_text(v, 2) for v in table["payoff_epochs"]]
    names = {"compile_s": "compile s (first step - median)", "step_ms": "step ms (median)",
             "eager_step_ms": "eager step ms", "saving_ms": "saving ms/step", "payoff_steps": "pays off after steps",
             "payoff_epochs": "... epochs", "graphs_compiled": "graphs compiled",
             "inductor_cache": "Inductor caches"}
    return table.rename(columns=names).round(3)


def reference_costs(technique: str = "compile") -> pd.DataFrame | None:
    """:func:`compile_costs` of every stored reference run of ``technique``, with a ``machine`` column; None if none."""
    paths = [store.REFERENCE_DIR / machine / f"{technique}.json" for machine in store.reference_machines()]
    frames = [compile_costs(store.load_record(path)).assign(machine=path.parent.name)
              for path in paths if path.is_file()]
    return pd.concat(frames, ignore_index=True) if frames else None


def inductor_counters() -> dict[str, int]:
    """This process's compile caches and CUDA-graph skips, from the counters Dynamo and Inductor keep.

    A cache hit reuses code that an earlier run compiled and saved on disk, so a compile time measured with hits is a
    warm-cache time; misses compiled from scratch. A CUDA-graph skip is a graph that a mode with CUDA graphs
    (``reduce-overhead``, ``max-autotune``) ran without them: on a CPU always, on a GPU when capture is impossible.
    """
    from torch._dynamo.utils import counters

    return {"fx graph cache hits": counters["inductor"]["fxgraph_cache_hit"],
            "fx graph cache misses": counters["inductor"]["fxgraph_cache_miss"],
            "autograd cache hits": counters["aot_autograd"]["autograd_cache_hit"],
            "autograd cache misses": counters["aot_autograd"]["autograd_cache_miss"],
            "cudagraph skips": counters["inductor"]["cudagraph_skips"]}


def loss_agreement(record: dict[str, Any]) -> pd.DataFrame:
    """Each variant's first loss (same weights, same batch) against the baseline's, with the tolerance: the first
    training loss, or in a run of the test phase alone the first evaluation loss.

    The first warm-up step of repeat 0 is the only step where every variant starts from identical weights; later
    losses drift apart as rounding differences grow in training from scratch.
    """
    samples, baseline = _samples(record), record["baseline"]
    phase = "train" if (samples["phase"] == "train").any() else "test"
    first_pass = samples[(samples["phase"] == phase) & (samples["repeat"] == samples["repeat"].min())]
    if first_pass.empty or "warmup_losses" not in first_pass or not all(map(len, first_pass["warmup_losses"])):
        raise OptlabError("loss_agreement needs a train or test phase with at least one recorded warm-up loss")
    rows = []
    for model, group in first_pass.groupby("model", sort=False):
        first = {row["variant"]: row["warmup_losses"][0] for _, row in group.iterrows()}
        for variant, loss in first.items():
            amp = record["effective_configs"][model][variant]["amp_dtype"]
            rows.append({"model": model, "variant": variant, "amp_dtype": amp, "first_loss": loss,
                         "baseline_first_loss": first[baseline],
                         "rel_diff": abs(loss - first[baseline]) / abs(first[baseline]), "tolerance": LOSS_RTOL[amp]})
    return pd.DataFrame(rows)


def step_trace(samples: pd.DataFrame) -> pd.DataFrame:
    """Every step of repeat 0 in order, warm-up included, one row each: where the compile shows."""
    first = samples[(samples["status"] == "ok") & (samples["repeat"] == samples["repeat"].min())]
    rows = [{"model": run["model"], "phase": run["phase"], "variant": run["variant"], "step": index, "seconds": seconds,
             "warm_up": index < len(run["warmup_times_s"])}
            for _, run in first.iterrows()
            for index, seconds in enumerate([*run["warmup_times_s"], *run["step_times_s"]])]
    return pd.DataFrame(rows)
