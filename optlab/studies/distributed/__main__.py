"""``python -m optlab.studies.distributed parity``: the DDP parity check."""
import sys

from .parity import main

sys.exit(main())
