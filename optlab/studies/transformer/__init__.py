"""The transformer track's own checks and tables: every attention kernel against the hand-written one
(``attention_check``), checkpointing that trains the same model (``checkpointing_check``), FP8's numerics
(``fp8_training``), what a token costs (``token_costs``) and the largest batch each checkpointing setting fits
(``largest_batch``).

Imports ``optlab.core`` and other studies' public names.
"""
