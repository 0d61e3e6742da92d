"""The measurement core: every measurement goes through these sub-packages, each importing only those below it.

From the bottom up: ``errors`` and ``workload`` (the vocabulary every part shares: the error type, what a workload
is, its registry and where data sets live); ``results`` (records on disk, archives, the seed's and others' published
figures); ``knobs`` (a run's configuration, the profiles and the limits a user's sizes are checked against);
``process`` (signals, signal-safe loaders, the thread count); the workloads ``cifar`` and ``gpt`` (their data,
models and extras); ``machine`` (the device, the environment, the GPU's state and the compiler); ``measuring`` (the
timer, the measured loops, memory and FLOPs); ``stats`` (the summary and the stopping rule); ``techniques`` (the
registry of techniques and their variants) and ``run`` (running an experiment).

Modules here import only each other, torch and the scientific stack: never ``optlab.studies``, ``optlab.book`` or
``optlab.commands``. Importing this package fills the registry.
"""
import logging
import os

import torch

# Two messages on stderr that only say "this machine has no GPU", which the book build (it fails on any warning or
# error a page writes) should not pass on: torch.utils.benchmark imports torch.utils.cpp_extension, which warns "No
# CUDA runtime is found, using CUDA_HOME=..." where a CUDA toolkit is installed (optlab builds no C++ extension); and
# torch.profiler's kineto logs "gpuGetDeviceCount failed" at every start when a CUDA build of torch runs on a CPU,
# and, at its top level (USDT, 5), "profiler_start" and "profiler_stop" around every profile: a page that profiles a
# step would show them.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
if not torch.cuda.is_available():
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above every level: kineto logs nothing; read when a profile starts

# The workloads, one line each (a new workload is one module and one line here), then the techniques.
from . import cifar  # noqa: E402,F401  (registers the CIFAR-10 workload)
from . import gpt  # noqa: E402,F401  (registers the GPT workload)
from .techniques import cnn  # noqa: E402,F401  (fills the registry: the CNN techniques)
from .techniques import gpt as gpt_techniques  # noqa: E402,F401  (the transformer track's techniques)
