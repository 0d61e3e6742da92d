"""The run's process: signals that end a run cleanly (``shutdown``), DataLoaders that survive them (``loader``) and a fixed thread count for quieter timing (``quiet``).

Imports ``knobs`` and the shared modules below it.
"""
