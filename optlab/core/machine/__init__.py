"""The machine a run measures on: the device and what it supports (``device``), the environment recorded with every result (``environment``), the GPU's clocks, power and temperature (``gpu_state``, ``gpu_sampler``), the machine's load (``machine_load``) and what torch.compile needs (``compiler``).

Imports ``knobs``, ``process``, the workloads (FP8 support comes from ``gpt.fp8``) and the shared modules.
"""
