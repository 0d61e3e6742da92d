"""The statistics of a comparison: the summary table with its intervals and verdicts (``summary``), the stopping rule that repeats until the answer is clear (``sequential``) and the median's order-statistic interval (``order``).

Imports ``measuring``, ``process`` and the shared modules.
"""
