"""A process that imports optlab pays for torchvision and torch._dynamo only when it uses them: each costs a second or
more to import on a small CPU, and the command line, every parallel rank and every chapter's kernel start by
importing optlab."""
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
DEFERRED = ("torchvision", "torch._dynamo")

CHILD = WITHOUT_INSTALLED_OPTLAB + """
import importlib, json, sys
deferred = sys.argv[1].split(",")
loaded = {}
for name in sys.argv[2:]:
    importlib.import_module(name)
    loaded[name] = [module for module in deferred if module in sys.modules]
from optlab.core.cifar import data, models
models.build_model("resnet18"), data.StandInCIFAR10, data.test_transform()
loaded["after building a CNN and its data"] = [module for module in deferred if module in sys.modules]
print(json.dumps(loaded))
"""


def test_starting_optlab_imports_neither_torchvision_nor_dynamo_until_a_cnn_is_built():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, ",".join(DEFERRED), *STARTS], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert {start: loaded[start] for start in STARTS} == {start: [] for start in STARTS}, (
        f"imported at a process's start (move the import to where it is first used): {loaded}")
    # the names checked are the modules a CNN's model and data import, so the check above can see them
    assert loaded["after building a CNN and its data"] == list(DEFERRED)


# The parallel studies' package (FSDP2, DTensor) and the FLOP counter (triton) wait for their first use too; a
# parallel rank imports the first itself, so its commands are not among these starts.
MOST_STARTS = tuple(start for start in STARTS if start != "optlab.studies.parallel.commands")
DEFERRED_TOO = ("torch.distributed.fsdp", "torch.utils.flop_counter")
FIRST_USE = WITHOUT_INSTALLED_OPTLAB + """
import importlib, json, sys
deferred = sys.argv[1].split(",")
loaded = {}
for name in sys.argv[2:]:
    importlib.import_module(name)
    loaded[name] = [module for module in deferred if module in sys.modules]
import optlab
from optlab.core.knobs.config import RunConfig
from optlab.core.measuring import flops
optlab.parallel_plan, flops.config_step_flops(RunConfig(model="resnet18", batch_size=2), train=False)
loaded["after a parallel plan and a FLOP count"] = [module for module in deferred if module in sys.modules]
print(json.dumps(loaded))
"""


def test_starting_optlab_imports_neither_fsdp_nor_the_flop_counter_until_they_are_used():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", FIRST_USE, ",".join(DEFERRED_TOO), *MOST_STARTS], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert {start: loaded[start] for start in MOST_STARTS} == {start: [] for start in MOST_STARTS}, (
        f"imported at a process's start (move the import to where it is first used): {loaded}")
    assert loaded["after a parallel plan and a FLOP count"] == list(DEFERRED_TOO)
