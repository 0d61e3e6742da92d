"""What torch.compile needs on this machine, and what it did.

Inductor writes C++ kernels on the CPU (a C++ compiler is needed) and Triton kernels on a GPU (Triton builds a small
C launcher per kernel: a C compiler and ``Python.h`` are needed). Both are checked before a run starts, so that a
missing tool is one clear message instead of a failure minutes into the first training step.

Dynamo's and Inductor's counters say how many graphs a pass compiled and whether Inductor's on-disk caches had them
already: a compile time measured with cache hits is a warm-cache time, far shorter than a cold one.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterable

from ..knobs.config import RunConfig
from .device import DeviceInfo
from ..errors import OptlabError


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


def python_include_dir() -> str:
    """Where Triton looks for ``Python.h`` (its build uses the ``posix_prefix`` scheme where the default is local)."""
    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


@functools.lru_cache(maxsize=1)
def triton_problem() -> str | None:
    """Why Triton could not build a kernel launcher here, or None if it can; compiles one tiny file (well under a
    second). Triton takes ``$CC``, else gcc, else clang, and includes ``Python.h``."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        return "no C compiler found ($CC is unset and neither gcc nor clang is on PATH)"
    include = python_include_dir()
    if not Path(include, "Python.h").is_file():
        return f"Python.h is not in {include} (install the Python development headers, e.g. python3-dev)"
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "check.c")
        source.write_text("#include <Python.h>\nint main(void) { return 0; }\n")
        try:
            done = subprocess.run([compiler, "-fsyntax-only", f"-I{include}", str(source)], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"the C compiler {compiler!r} could not be run ({error})"
    if done.returncode:
        first = (done.stderr.strip().splitlines() or ["no message"])[0]
        return f"{compiler} cannot compile a file that includes Python.h: {first}"
    return None


def require_compiler(configs: Iterable[RunConfig], info: DeviceInfo) -> None:
    """Raise OptlabError when a config compiles and this machine lacks what Inductor needs to build its kernels:
    a C++ compiler on the CPU, a working Triton build (C compiler and ``Python.h``) on CUDA."""
    modes = sorted({c.compile_mode for c in configs if c.compile_mode != "none"})
    if not modes:
        return
    if info.is_cuda:
        problem = triton_problem()
        if problem:
            raise OptlabError(
                f"compile_mode {', '.join(modes)} on CUDA needs Triton to build a small C launcher per kernel, and it "
                f"cannot here: {problem}. Fix that, or run with compile_mode 'none'")
        return
    if find_cxx():
        return
    raise OptlabError(
        f"compile_mode {', '.join(modes)} on the CPU needs a C++ compiler: Inductor turns the captured graph into C++ "
        f"kernels and builds them with one of {', '.join(inductor_cxx_candidates())}, and none is on PATH. Install one "
        "(for example `apt-get install g++`), point $CXX at one, or run with compile_mode 'none'"
    )


GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the compile modes in which Inductor replays CUDA graphs


def uses_cuda_graphs(config: RunConfig) -> bool:
    """Whether ``config``'s compiled model replays CUDA graphs (where Inductor does not skip them)."""
    return config.compile_mode in GRAPH_MODES


def _counters() -> dict | None:
    dynamo_utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was ever compiled
    return dynamo_utils.counters if dynamo_utils is not None else None


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (Dynamo's counter; 0 if Dynamo was never used)."""
    counters = _counters()
    return int(counters["stats"]["unique_graphs"]) if counters is not None else 0


def cache_counts() -> dict[str, int]:
    """This process's Inductor FX-graph and AOTAutograd cache hits and misses, and CUDA-graph skips, so far."""
    counters = _counters()
    if counters is None:
        return {"cache hits": 0, "cache misses": 0, "cudagraph skips": 0}
    return {"cache hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
            "cache misses": (counters["inductor"]["fxgraph_cache_miss"]
                             + counters["aot_autograd"]["autograd_cache_miss"]),
            "cudagraph skips": counters["inductor"]["cudagraph_skips"]}


def cache_state(hits: int, misses: int) -> str:
    """``cold`` (every lookup missed: compiled from scratch), ``warm`` (every lookup hit: code reused from disk),
    ``mixed``, or ``no cache lookups``."""
    if hits and misses:
        return "mixed"
    return "warm" if hits else "cold" if misses else "no cache lookups"
