"""The run's process: signals that end a run cleanly (``shutdown``), DataLoaders that survive them (``loader``) a fixed thread count for quieter timing (``quiet``) and the environment of a child Python that imports this optlab (``children``).

Imports ``knobs`` and the shared modules below it.
"""
