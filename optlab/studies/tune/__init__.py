"""``optlab tune`` on the reader's own model: the book's stack, one step at a time, for training (:mod:`.training`)
and for serving (:mod:`.inference`), with what both are given (:mod:`.inputs`), the inference outputs' check
(:mod:`.output_check`) and the batch-size sweep (:mod:`.batch_sweep`).

The modules' earlier paths (``optlab.studies.tune_inference``, ``tune_inputs``, ``output_check``, ``batch_sweep``)
still import, as names of the same modules.
"""
import sys

from . import batch_sweep, inference, inputs, output_check
from .inference import InferenceResult
from .training import TuneResult, stack_steps, tune

for _old, _module in {"tune_inference": inference, "tune_inputs": inputs, "output_check": output_check,
                      "batch_sweep": batch_sweep}.items():
    sys.modules[f"{__name__.rsplit('.', 1)[0]}.{_old}"] = _module

__all__ = ["InferenceResult", "TuneResult", "stack_steps", "tune"]
