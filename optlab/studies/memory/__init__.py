"""Where a training step's memory goes: one step's peak broken into parameters, gradients, optimizer state,
activations, temporaries, inputs, autograd's own detail and other allocations, measured by torch.profiler's memory
profile (and on a GPU by the allocator too), beside the arithmetic that predicts each part (``.breakdown``), and
checked against torch's ``MemTracker``, which counts the same step another way (``.tracker``).
``optlab tune --memory`` applies it to the reader's own model (``optlab.studies.tune.memory``).
"""
from .breakdown import CATEGORIES, PHASES, SUM_RTOL, Breakdown, saved_activations, step_breakdown
from .tracker import TRACKER_RTOL, tracked_peak, tracker_table

__all__ = ["CATEGORIES", "PHASES", "SUM_RTOL", "TRACKER_RTOL", "Breakdown", "saved_activations", "step_breakdown",
           "tracked_peak", "tracker_table"]
