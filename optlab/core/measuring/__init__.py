"""Measuring one variant: the device-aware timer (``timing``), the measured training and evaluation loops (``loops``), peak memory (``memory``), FLOPs (``flops``) and the tidy rows a run records (``samples``).

Imports ``machine``, the workloads, ``process``, ``knobs`` and the shared modules.
"""
