"""Collectives counted with their bytes: ``CommDebugMode`` (which counts the collectives DTensor issues) extended to
note each one's size, and whether forward or backward issued it."""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor.debug import CommDebugMode

NAMES = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
         "all_to_all_single": "all-to-all", "broadcast": "broadcast",  # DTensor's functional collectives
         "allreduce_": "all-reduce", "_allgather_base_": "all-gather", "_reduce_scatter_base_": "reduce-scatter",
         "allgather_": "all-gather", "reduce_scatter_": "reduce-scatter"}  # c10d's, which FSDP2 calls


def _bytes(*values: Any) -> int:
    """The largest tensor among ``values`` (tensors, or lists and tuples of them)."""
    tensors = [t for value in values for t in (value if isinstance(value, (list, tuple)) else [value])]
    return max((t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)), default=0)


class CollectiveLog(CommDebugMode):
    """``CommDebugMode`` that also keeps one record per collective (DTensor's and the c10d ones FSDP2 issues): its
    name, ``forward`` or ``backward`` (or the caller's ``phase``), and the bytes of the whole tensor it works on (the
    output of an all-gather, the input of a reduce-scatter or all-reduce), the size the formulas speak of."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []
        self.phase: str | None = None  # set by the caller ("forward", "optimizer step", ...); else forward/backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and self.get_total_counts() > before:
            name = func._overloadpacket.__name__
            self.records.append({"collective": NAMES.get(name, name),
                                 "pass": self.phase or ("backward" if self.advanced_module_tracker.is_bw
                                                        else "forward"),
                                 "bytes": _bytes(*args, out)})
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        """Per (collective, pass): calls and bytes, e.g. ``{"all-reduce forward": {"calls": 4, "bytes": 98304}}``."""
        calls, sizes = Counter(), Counter()
        for record in self.records:
            key = f"{record['collective']} {record['pass']}"
            calls[key] += 1
            sizes[key] += record["bytes"]
        return {key: {"calls": calls[key], "bytes": sizes[key]} for key in sorted(calls)}
