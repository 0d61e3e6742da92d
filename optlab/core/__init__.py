"""The measurement core: every measurement goes through these modules.

The knobs (``config``, ``profiles``), the device (``device``, ``environment``, ``compiler``), the workloads
(``workload``: the type and its registry; ``cifar``: CIFAR-10's data in ``data``, ``device_data`` and its CNNs in
``models``), loading (``loader``), FLOPs (``flops``), the measured loops (``loops``, ``memory``, ``timing``), the
registry of techniques (``registry``, filled by ``techniques``), running an experiment (``variants``,
``experiments``, ``samples``), the statistics of a comparison (``summary``, ``timing``), and results on disk
(``store``, ``seed``).

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
from . import techniques  # noqa: E402,F401  (fills the registry)
from . import gpt_techniques  # noqa: E402,F401  (the transformer track's techniques)
