"""The entry points: ``python -m optlab`` (``cli``) and the GPU reference run (``reference``).

The top layer: it may import every other layer, and nothing inside optlab imports it.
"""
