"""What a fresh process started by ``optlab.studies.first_step.fresh`` sees: where its caches would go."""
from __future__ import annotations

import os
import tempfile

IMPORTED_IN = tempfile.gettempdir()  # read at import, as a library may: a fork server's children must not keep it


def where() -> dict[str, object]:
    """The folders Inductor, Triton and Inductor's precompiled headers would use in this process."""
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return {"inductor": cache_dir(), "triton": os.environ.get("TRITON_CACHE_DIR", ""),
            "headers": codecache._HEADER_DIR, "tmp": tempfile.gettempdir(), "pid": os.getpid()}


def fail() -> None:
    """A start that raises."""
    raise ValueError("no such start")
