"""A process that imports optlab pays for torchvision, torch._dynamo, the parallel studies' package (FSDP2, DTensor),
the FLOP counter (triton) and torch's benchmark timer (setuptools) only when it uses them: each costs a fraction of a
second to a second or more to import on a small CPU, and the command line, every parallel rank and every chapter's
kernel start by importing optlab."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.children import WITHOUT_INSTALLED_OPTLAB

ROOT = Path(__file__).resolve().parent.parent
# What a process imports before its work: the package, the command line (``python -m optlab``), a parallel rank's
# commands (``python -m optlab.studies.parallel``) and what a chapter imports.
STARTS = ("optlab", "optlab.commands.cli", "optlab.studies.parallel.commands", "optlab.book.chapter",
          "optlab.book.report")
FIRST_USE = "after their first use"


def loaded_at_each_start(starts: tuple[str, ...], deferred: tuple[str, ...], use: str) -> dict[str, list[str]]:
    """Which of ``deferred`` a child process has imported after each of ``starts`` in turn, and after ``use`` (code
    that uses them): the names checked must be the modules that code imports, so that the check can see them."""
    child = WITHOUT_INSTALLED_OPTLAB + f"""
import importlib, json, sys
deferred = sys.argv[1].split(",")
loaded = {{}}
for name in sys.argv[2:]:
    importlib.import_module(name)
    loaded[name] = [module for module in deferred if module in sys.modules]
{use}
loaded[{FIRST_USE!r}] = [module for module in deferred if module in sys.modules]
print(json.dumps(loaded))
"""
    done = subprocess.run([sys.executable, "-c", child, ",".join(deferred), *starts], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert {start: loaded[start] for start in starts} == {start: [] for start in starts}, (
        f"imported at a process's start (move the import to where it is first used): {loaded}")
    return loaded


def test_starting_optlab_imports_neither_torchvision_nor_dynamo_until_a_cnn_is_built():
    deferred = ("torchvision", "torch._dynamo")
    loaded = loaded_at_each_start(STARTS, deferred, """
from optlab.core.cifar import data, models
models.build_model("resnet18"), data.StandInCIFAR10, data.test_transform()""")
    assert loaded[FIRST_USE] == list(deferred)


def test_starting_optlab_imports_neither_fsdp_nor_the_flop_counter_until_they_are_used():
    """A parallel rank imports the parallel package itself, so its commands are not among these starts."""
    deferred = ("torch.distributed.fsdp", "torch.utils.flop_counter")
    starts = tuple(start for start in STARTS if start != "optlab.studies.parallel.commands")
    loaded = loaded_at_each_start(starts, deferred, """
import optlab
from optlab.core.knobs.config import RunConfig
from optlab.core.measuring import flops
optlab.parallel_plan, flops.config_step_flops(RunConfig(model="resnet18", batch_size=2), train=False)""")
    assert loaded[FIRST_USE] == list(deferred)


def test_starting_optlab_imports_torch_s_benchmark_timer_only_when_it_times():
    """``torch.utils.benchmark`` imports ``torch.utils.cpp_extension`` and with it setuptools: a sixth of a second of
    every start that never times with it."""
    deferred = ("torch.utils.benchmark", "setuptools")
    loaded = loaded_at_each_start(STARTS, deferred, """
import torch
from optlab.studies.serving import bandwidth
bandwidth.measured_copy_bandwidth(torch.device("cpu"), mib=1)""")
    assert loaded[FIRST_USE] == list(deferred)
