"""``python -m optlab.studies.distributed parity``: the DDP parity check; ``shard-check`` and the other sharding
commands are in :mod:`.shard_commands`."""
import sys

from . import shard_commands
from .parity import main

sys.exit(shard_commands.main() if sys.argv[1:2] and sys.argv[1] in shard_commands.COMMANDS else main())
