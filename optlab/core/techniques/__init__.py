"""The techniques the book measures: the registry of experiments and their variants (``registry``), the CNN techniques (``cnn``), the transformer track's (``gpt``) and the comparisons that cannot differ on a device (``no_effect``).

Imports the workloads, ``knobs`` and the shared modules.
"""
