"""What torch.compile needs on this machine: on the CPU, Inductor writes C++ kernels and needs a C++ compiler.

Checked before a run starts, so that a missing compiler is one clear message instead of a failure deep inside the
first training step.
"""
from __future__ import annotations

import shutil
from typing import Iterable

from .config import RunConfig
from .device import DeviceInfo
from .errors import OptlabError


def inductor_cxx_candidates() -> tuple[str, ...]:
    """The compiler names Inductor tries on this platform (``torch._inductor.config.cpp.cxx``; ``$CXX`` sets it)."""
    from torch._inductor import config  # late import: about a second, paid only when a CPU run compiles

    names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    return tuple(name for name in names if name)  # None: "install g++ from conda", which we do not ask for


def find_cxx() -> str | None:
    """The path of the first compiler Inductor would use, or None if none is on ``PATH``."""
    for name in inductor_cxx_candidates():
        path = shutil.which(name)
        if path:
            return path
    return None


def require_compiler(configs: Iterable[RunConfig], info: DeviceInfo) -> None:
    """Raise OptlabError when a config compiles on the CPU and no C++ compiler for Inductor is found."""
    modes = sorted({c.compile_mode for c in configs if c.compile_mode != "none"})
    if info.is_cuda or not modes or find_cxx():
        return
    raise OptlabError(
        f"compile_mode {', '.join(modes)} on the CPU needs a C++ compiler: Inductor turns the captured graph into C++ "
        f"kernels and builds them with one of {', '.join(inductor_cxx_candidates())}, and none is on PATH. Install one "
        "(for example `apt-get install g++`), point $CXX at one, or run with compile_mode 'none'"
    )
