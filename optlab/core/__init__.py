"""The measurement core: every measurement goes through these modules.

The knobs (``config``, ``profiles``), the device (``device``, ``environment``, ``compiler``), the data (``data``,
``device_data``), the models (``models``, ``flops``), the measured loops (``loops``, ``memory``, ``timing``), the
registry of techniques (``registry``, filled by ``techniques``), running an experiment (``variants``,
``experiments``, ``samples``), the statistics of a comparison (``summary``, ``timing``), and results on disk
(``store``, ``seed``).

Modules here import only each other, torch and the scientific stack: never ``optlab.studies``, ``optlab.book`` or
``optlab.commands``. Importing this package fills the registry.
"""
from . import techniques  # noqa: F401  (fills the registry)
