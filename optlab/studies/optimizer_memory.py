"""What an optimizer keeps, and whether its implementations agree: AdamW's state bytes against the parameters' on the
GPT, and the weights each implementation ends with after the same training steps.

The state is measured as the bytes of the storages its tensors use (each storage counted once), after a step has
created it: the same count on a CPU and a GPU. AdamW keeps two fp32 moments per parameter (``exp_avg``,
``exp_avg_sq``) and one step counter per parameter tensor (a one-element float32 tensor).
"""
from __future__ import annotations

import importlib.util

import pandas as pd
import torch

from ..core.machine.device import effective_config, resolve_device
from ..core.knobs.limits import check_count
from ..core.measuring.loops import train_step
from ..core.knobs.profiles import Profile, get_profile
from ..core.process.quiet import fix_threads
from ..core.techniques.registry import get_experiment
from ..core.run.variants import build_state
from ..core.workload import get_workload

EXPERIMENT = "gpt_optimizers"
MAX_STEPS = 100  # an agreement check, not a training run
WEIGHT_RTOL = 1e-5  # largest weight difference from the for-loop, relative to the largest weight (fp32 rounding)


def storage_bytes(tensors: "list[torch.Tensor]") -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by several views counts once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The optimizer's state in bytes: all of it, and the part held by step counters (``step``)."""
    tensors = {key: [] for key in ("all", "step")}
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors["all"].append(value)
                if key == "step":
                    tensors["step"].append(value)
    return {"state_bytes": storage_bytes(tensors["all"]), "step_bytes": storage_bytes(tensors["step"])}


def implementation_ran(optimizer: torch.optim.Optimizer) -> str:
    """The implementation ``optimizer`` runs, read from its own flags: "fused", "foreach", "for_loop", or "default"
    where it leaves the choice to PyTorch (foreach on CUDA, the for-loop elsewhere)."""
    fused, foreach = optimizer.defaults.get("fused"), optimizer.defaults.get("foreach")
    if fused:
        return "fused"
    if foreach is None and fused is None:
        return "default"
    return "foreach" if foreach else "for_loop"


def low_bit_support() -> str | None:
    """None when torchao's low-bit optimizers (8-bit and 4-bit AdamW state) can be imported, else one line why not."""
    if importlib.util.find_spec("torchao") is None:
        return ("torchao is not installed here, so its 8-bit and 4-bit AdamW (torchao.optim.AdamW8bit, AdamW4bit), "
                "which keep the two moments in 1 or 0.5 bytes per parameter instead of 4, are not measured")
    if importlib.util.find_spec("torchao.optim") is None:
        return "this torchao has no torchao.optim (its low-bit optimizers)"
    return None


def optimizer_memory(model: str = "gpt_tiny", steps: int = 3, profile: "str | Profile | None" = None,
                     device: str = "auto", seed: int = 0) -> pd.DataFrame:
    """Per AdamW implementation of the ``gpt_optimizers`` experiment: ``steps`` training steps from the same weights
    on the same batches, then the implementation asked for (``impl``) and the one the optimizer ran (``ran``, from its
    flags), the parameters' bytes, the state's bytes (all, and its step counters), the state per
    parameter byte without the counters, and the largest weight difference from the for-loop implementation
    (absolute, and relative to the largest weight), beside how far the steps moved the weights (``max_update``)."""
    steps = check_count("steps", steps, 1, MAX_STEPS, "an agreement check needs a few steps")
    info = resolve_device(device)
    fix_threads(info.is_cuda)
    configs = get_experiment(EXPERIMENT).configs(model, get_profile(profile, info.is_cuda))
    workload = get_workload("gpt")
    train_set, test_set = workload.datasets(workload.find_source(False), False)
    rows, weights, start = [], {}, None
    for label, requested in configs.items():
        config, _ = effective_config(requested, info)
        state = build_state(config, info, train_set, test_set, seed)
        params = list(state.model.parameters())
        start = start or [p.detach().clone() for p in params]
        batches = iter(state.loaders["train"])
        state.model.train()
        for _ in range(steps):
            train_step(state.model, next(batches), state.optimizer, state.scaler, config, info.device, 0,
                       loss_fn=workload.loss)
        weights[label] = [p.detach().float().clone() for p in params]
        memory = state_bytes(state.optimizer)
        param_bytes = storage_bytes(params)
        rows.append({"variant": label, "impl": config.optimizer_impl, "ran": implementation_ran(state.optimizer),
                     "param_tensors": len(params),
                     "param_bytes": param_bytes, **memory,
                     "state_per_param_byte": (memory["state_bytes"] - memory["step_bytes"]) / param_bytes})
    reference = next(weights[row["variant"]] for row in rows if row["impl"] == "for_loop")
    scale = max(float(w.abs().max()) for w in reference)
    for row in rows:
        diff = max(float((a - b).abs().max()) for a, b in zip(weights[row["variant"]], reference))
        row.update(steps=steps, max_abs_diff=diff, max_rel_diff=diff / scale, tolerance=WEIGHT_RTOL,
                   max_update=max(float((a - b.float()).abs().max()) for a, b in zip(weights[row["variant"]], start)))
    return pd.DataFrame(rows)
