"""What a fresh process started by ``optlab.studies.first_step.fresh`` sees: where its caches would go."""
from __future__ import annotations

import os
import tempfile

IMPORTED_IN = tempfile.gettempdir()  # read at import, as a library may: a fork server's children must not keep it


def where() -> dict[str, object]:
    """The folders Inductor, Triton and Inductor's precompiled headers would use in this process, and whether it knew
    the CPU's vector instructions before it asked (a fork server's probe, inherited)."""
    from torch._inductor import codecache, cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    probed = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
    return {"inductor": cache_dir(), "triton": os.environ.get("TRITON_CACHE_DIR", ""),
            "headers": codecache._HEADER_DIR, "tmp": tempfile.gettempdir(), "pid": os.getpid(), "probed": probed}


def write_into(path: str) -> dict[str, str]:
    """A start that writes a file where it should not."""
    with open(path, "w") as stray:
        stray.write("written by a start")
    return {"wrote": path}


def fail() -> None:
    """A start that raises."""
    raise ValueError("no such start")
