"""``python -m optlab.studies.parallel COMMAND --out DIR``: one rank of a parallelism study, started by torchrun."""
import sys

from .commands import main

sys.exit(main())
