"""Each chapter's own measurement, built on :mod:`optlab.core`: micro-benchmarks, cuDNN autotuning, compilation cost,
CUDA graphs, numerics and TF32, optimizer steps, the data pipeline, profiling, the learning check, FLOP peaks,
the attention kernels' and checkpointing's agreement with their references, the largest batch a GPU fits,
data-parallel training, and ``optlab tune`` on the reader's own model.

A study imports the core and the public names of other studies; never ``optlab.book`` or ``optlab.commands``, and
never another module's underscore names.
"""
