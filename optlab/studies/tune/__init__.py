"""``optlab tune`` on the reader's own model: the book's stack, one step at a time, for training (:mod:`.training`)
and for serving (:mod:`.inference`); what both are given (:mod:`.inputs`: the model, its batches) and the model's
inputs of any kind (:mod:`.examples`), the inference outputs' check (:mod:`.output_check`), throughput and request
latency (:mod:`.batch_sweep`), and the recommendation both return (:mod:`.recommendation`).

The modules' earlier paths (``optlab.studies.tune_inference``, ``tune_inputs``, ``output_check``, ``batch_sweep``)
still import, as names of the same modules.
"""
import sys

from . import batch_sweep, inference, inputs, output_check
from .inference import InferenceResult
from .recommendation import NothingRecommended
from .training import TuneResult, stack_steps, tune

for _old, _module in {"tune_inference": inference, "tune_inputs": inputs, "output_check": output_check,
                      "batch_sweep": batch_sweep}.items():
    sys.modules[f"{__name__.rsplit('.', 1)[0]}.{_old}"] = _module

__all__ = ["InferenceResult", "NothingRecommended", "TuneResult", "stack_steps", "tune"]
