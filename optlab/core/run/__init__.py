"""Running an experiment: a variant's live objects (``variants``) and the interleaved, repeated measurement of every variant (``experiments``).

Imports every other part of the core.
"""
