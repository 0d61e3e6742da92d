"""The chapters' kernels forked from a warm parent (tests/warm_kernels.py) are kernels as Jupyter starts them: a
process leading a process group of its own that sees what a fresh kernel sees, reached by an interrupt, gone with
its children when Jupyter kills it or when the parent dies; a launch the parent cannot serve gets a fresh kernel."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

import warm_kernels

pytestmark = pytest.mark.slow  # a parent importing torch, and kernels: the full tier's

PROBE = """
import json, os, signal, sys
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "cwd": os.getcwd(),
                  "path": sys.path, "argv0": os.path.basename(sys.argv[0]), "main": sys.modules["__main__"].__name__,
                  "warm": "torch" in sys.modules,
                  "env": {k: v for k, v in os.environ.items() if not k.startswith(("JPY_", "PYTEST_"))},
                  "sigint": str(signal.getsignal(signal.SIGINT)), "sigterm": str(signal.getsignal(signal.SIGTERM))}))
"""
DRAW = "import json, numpy, torch; print(json.dumps([float(numpy.random.rand()), float(torch.rand(1))]))"


# A process that adopts its orphaned descendants (PR_SET_CHILD_SUBREAPER, as a service manager does) and runs the
# command it is given, then waits to be killed: a kernel whose parent died is then not orphaned to init, so ipykernel's
# own watch (its parent became pid 1) would not end it.
ADOPTER = ("import ctypes, subprocess, sys, time; ctypes.CDLL(None).prctl(36, 1); subprocess.call(sys.argv[1:]); "
           "time.sleep(600)")


class Parent:
    """A warm parent listening at a name of its own (under an adopting process if ``adopted``), its log, and a
    kernelspec folder that launches through it."""

    def __init__(self, folder: Path, adopted: bool = False) -> None:
        self.name = warm_kernels.socket_name(uuid.uuid4().hex)
        self.log = folder / "parent.log"
        command = [sys.executable, warm_kernels.__file__, "serve", self.name.lstrip("\0"), str(os.getpid())]
        with self.log.open("w") as log:
            self.process = subprocess.Popen([sys.executable, "-c", ADOPTER, *command] if adopted else command,
                                            env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.specs = warm_kernels.kernelspec(folder / "jupyter", self.name) / "kernels"
        deadline = time.monotonic() + 120
        while "forking" not in self.log.read_text():
            assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)
        self.pid = int(self.log.read_text().split()[2].rstrip(":"))  # "warm parent PID: ..."

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL if self.pid != self.process.pid else signal.SIGTERM)
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    started = Parent(tmp_path_factory.mktemp("warm"))
    yield started
    started.stop()


class Kernel:
    """A kernel started as nbval starts it, from the warm kernelspec in ``specs`` or ipykernel's own (None), and a
    client of it."""

    def __init__(self, specs: Path | None, cwd: Path, env: dict[str, str] | None = None) -> None:
        if specs is None:
            self.manager = KernelManager(kernel_name="python3")
        else:
            self.manager = KernelManager(kernel_name=warm_kernels.KERNEL_NAME,
                                         kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(specs)]))
        self.manager.start_kernel(cwd=str(cwd), env=env or dict(os.environ))
        self.launcher = self.manager.provisioner.process.pid  # the process Jupyter started and watches
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def run(self, code: str) -> str:
        """What ``code`` printed; an error it raised fails the test."""
        printed = []
        reply = self.client.execute_interactive(code, timeout=60, output_hook=lambda message: (
            printed.append(message["content"].get("text", "")) if message["msg_type"] == "stream" else None))
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(printed)

    def probe(self) -> dict:
        return json.loads(self.run(PROBE))

    def kill(self) -> None:
        """As nbval ends a notebook's run: SIGKILL to the launcher's process group."""
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def gone(pid: int, within_s: float = 15) -> bool:
    """True once ``pid`` has ended (a zombie counts: it runs nothing) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_warm_kernel_is_a_process_leading_a_group_of_its_own_that_sees_what_a_fresh_kernel_sees(parent, tmp_path):
    kernels = [Kernel(parent.specs, tmp_path), Kernel(None, tmp_path), Kernel(parent.specs, tmp_path)]
    try:
        warm, fresh, other = kernels
        seen, seen_fresh = warm.probe(), fresh.probe()
        draws = [json.loads(kernel.run(DRAW)) for kernel in (warm, other)]
    finally:
        for kernel in kernels:
            kernel.kill()
    assert seen["warm"] and not seen_fresh["warm"], parent.log.read_text()
    assert seen["pid"] != warm.launcher and seen["ppid"] == parent.pid and seen["sid"] == seen["pid"]
    assert seen_fresh["sid"] == seen_fresh["pid"] == fresh.launcher
    for key in ("cwd", "path", "argv0", "main", "env", "sigint", "sigterm"):
        assert seen[key] == seen_fresh[key], key
    assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1], "each kernel seeds its generators afresh"


def test_an_interrupt_reaches_the_cell_and_a_kill_takes_the_kernel_and_its_children(parent, tmp_path):
    kernel = Kernel(parent.specs, tmp_path)
    pids = []
    try:
        message = kernel.client.execute(  # a child of the kernel that outlives an interrupt, as a worker may: it
            # says so once it ignores SIGINT, and only then is the interrupt sent
            "import os, subprocess, time\nchild = subprocess.Popen(['sh', '-c', \"trap '' INT; echo ignoring; exec sleep "
            "600\"], stdout=subprocess.PIPE, text=True)\nassert child.stdout.readline() == 'ignoring\\n'\n"
            "print(os.getpid(), child.pid, flush=True)\ntime.sleep(600)")
        while not pids:
            output = kernel.client.get_iopub_msg(timeout=60)
            if output["parent_header"].get("msg_id") == message and output["msg_type"] == "stream":
                pids = [int(word) for word in output["content"]["text"].split()]
        kernel.manager.interrupt_kernel()
        reply = kernel.client.get_shell_msg(timeout=30)
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert not gone(pids[0], within_s=0.5) and not gone(pids[1], within_s=0.5)
    finally:
        kernel.kill()
    assert pids[0] != kernel.launcher and gone(pids[0]) and gone(pids[1])


def test_a_launch_whose_environment_differs_gets_a_fresh_kernel_and_so_does_one_without_a_parent(parent, tmp_path):
    alone = warm_kernels.kernelspec(tmp_path / "alone", warm_kernels.socket_name("none")) / "kernels"
    kernels = [Kernel(parent.specs, tmp_path, {**os.environ, "OPTLAB_PROFILE": "quick"}), Kernel(alone, tmp_path)]
    try:
        seen = [kernel.probe() for kernel in kernels]
    finally:
        for kernel in kernels:
            kernel.kill()
    for kernel, view in zip(kernels, seen):
        assert not view["warm"] and view["pid"] == kernel.launcher
    assert seen[0]["env"]["OPTLAB_PROFILE"] == "quick"
    assert "refused a launch: its environment differs in OPTLAB_PROFILE" in parent.log.read_text()


def test_a_kernel_dies_with_its_parent_even_where_its_orphans_are_adopted(tmp_path):
    doomed = Parent(tmp_path, adopted=True)
    kernel = Kernel(doomed.specs, tmp_path)
    try:
        seen = kernel.probe()
        assert seen["warm"] and seen["ppid"] == doomed.pid
        os.kill(doomed.pid, signal.SIGKILL)
        assert gone(seen["pid"])
    finally:
        kernel.kill()
        doomed.stop()
