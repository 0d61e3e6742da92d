"""What a run is: its configuration (``config``), the named profiles of sizes (``profiles``) and the limits every size a user types is checked against (``limits``).

Imports ``optlab.core.errors`` and ``optlab.core.workload`` only.
"""
