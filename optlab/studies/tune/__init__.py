"""``optlab tune`` on the reader's own model: the book's stack, one step at a time, for training (:mod:`.training`)
and for serving (:mod:`.inference`); what both are given (:mod:`.inputs`: the model, its batches) and the model's
inputs of any kind (:mod:`.examples`), the inference outputs' check (:mod:`.output_check`), throughput and request
latency (:mod:`.batch_sweep`), and the recommendation both return (:mod:`.recommendation`).

The modules' earlier paths (``optlab.studies.tune_inference``, ``tune_inputs``, ``output_check``, ``batch_sweep``)
still import, as names of the same modules.
"""
import functools
import inspect
import sys

from ...core.errors import OptlabError
from . import batch_sweep, inference, inputs, output_check, training
from .compile import CompileResult, tune_compile
from .inference import InferenceResult
from .memory import MemoryResult, tune_memory
from .recommendation import NothingRecommended
from .training import TuneResult, stack_steps


@functools.wraps(training.tune)
def tune(model_fn, *, memory=False, compile=False, **options):
    if memory and compile:
        raise OptlabError("give memory=True (--memory) or compile=True (--compile), not both")
    if compile:
        return tune_compile(model_fn, **options)
    return tune_memory(model_fn, **options) if memory else training.tune(model_fn, **options)


tune.__doc__ += ("\n    ``memory=True`` breaks one training step's memory down instead, names its largest category and what "
                 "moves it,\n    measures each fix that applies, and finds the largest batch that fits on a GPU: "
                 "``tune_memory`` returns a\n    ``MemoryResult``; the inputs are given as above.\n"
                 "    ``compile=True`` asks whether torch.compile pays instead: the graph breaks with their lines, the "
                 "recompiles over\n    ``shapes=`` (or a DataLoader's batches), the model's own compile seconds cold and "
                 "warm beside the machine's\n    setup, the speed-up and the break-even: ``tune_compile`` returns a "
                 "``CompileResult``.\n")
tune.__signature__ = inspect.signature(training.tune).replace(parameters=[
    *inspect.signature(training.tune).parameters.values(),
    inspect.Parameter("memory", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool"),
    inspect.Parameter("compile", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool")],
    return_annotation="TuneResult | InferenceResult | MemoryResult | CompileResult")

for _old, _module in {"tune_inference": inference, "tune_inputs": inputs, "output_check": output_check,
                      "batch_sweep": batch_sweep}.items():
    sys.modules[f"{__name__.rsplit('.', 1)[0]}.{_old}"] = _module

__all__ = ["CompileResult", "InferenceResult", "MemoryResult", "NothingRecommended", "TuneResult", "stack_steps", "tune"]
