"""The statistics of a comparison: the summary table with its intervals and verdicts (``summary``) and the stopping rule that repeats until the answer is clear (``sequential``).

Imports ``measuring``, ``process`` and the shared modules.
"""
