"""Results on disk: one record per run (``store``), archives of a results folder and their checks (``archive``, ``checks``), the seed article's tables (``seed``) and others' published figures (``published``).

Imports ``optlab.core.errors`` only.
"""
