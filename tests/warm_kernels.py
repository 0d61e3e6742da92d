"""Chapter kernels forked from a warm parent: the chapters' nbval runs skip the imports every chapter makes first.

Every chapter's kernel starts by importing torch, optlab, pandas, matplotlib and seaborn: about 3.5 CPU seconds a
kernel on two cores, 37 times in a ``make test``. The builder (tests/chapter_runs.py) starts one parent that makes
those imports once (``serve``), listening on an abstract Unix socket, and the chapters' nbval runs start their
kernel through a kernelspec whose command is this file as a launcher (``kernelspec``). The launcher hands the parent
its command line, folder, environment and standard streams; the parent forks a child that becomes the kernel,
leading a process group of its own (``setsid``, as Jupyter starts a kernel) with the launcher's streams, folder and
environment, and runs ipykernel's own entry point. The launcher stays the process Jupyter watches: it passes the
signals Jupyter sends on to the kernel's process group (an interrupt reaches the running cell), exits with the
kernel's exit status, and when it is killed the parent kills the kernel's group. A child dies with its parent.

Nothing a chapter computes is shared: the parent has imported modules and run nothing else (it checks that it still
has one thread), and each child seeds torch's and numpy's global generators from the OS, as a new process does. A launch
whose environment differs from the parent's in a value an import may have read is refused, and the launcher then
starts a kernel of its own, as ``python -m ipykernel_launcher`` does; so does a launcher that finds no parent.
"""
import json
import os
import selectors
import signal
import socket
import sys
from pathlib import Path

# Values that differ from launch to launch and that no import reads: Jupyter's and pytest's own, the folder where
# nbval writes the notebooks back, and where Jupyter looks for this kernelspec. ipykernel.kernelapp reads JPY_PARENT_PID
# as it is imported, so each kernel imports it itself.
PER_LAUNCH = ("JPY_", "PYTEST_", "OPTLAB_EXECUTED_DIR", "JUPYTER_PATH")
PRELOADED = ("ipykernel.ipkernel", "torch", "numpy", "pandas", "matplotlib.pyplot", "seaborn",
             "optlab", "optlab.book.chapter", "optlab.book.report")
KERNEL_NAME = "optlab-warm"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
STREAMS = (0, 1, 2)


def socket_name(run: str) -> str:
    """The abstract socket of run ``run``'s parent (no file: the name cannot outgrow a path's limit)."""
    return f"\0optlab-warm-kernels-{run}"


def kernelspec(folder: Path, name: str) -> Path:
    """A kernelspec (``folder``/kernels/optlab-warm) that starts its kernel through the parent listening at ``name``;
    nbval uses it with ``--nbval-kernel-name`` and ``JUPYTER_PATH=folder``."""
    spec = folder / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), f"--parent={name.lstrip(chr(0))}", "-f",
            "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "Python 3 (optlab, warm)",
                                                  "language": "python", "metadata": {"debugger": True}}))
    return folder


# The launcher: small, it imports nothing heavy.

def launch(name: str, kernel_argv: list[str]) -> None:
    """Run the kernel ``kernel_argv`` (ipykernel's arguments) as a child of the parent at ``name`` and exit with its
    status; without a parent, or refused by it, become a kernel of this process's own."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(name)
        request = json.dumps({"argv": kernel_argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(connection, [len(request).to_bytes(8, "big")], list(STREAMS))
        connection.sendall(request)
        answer = connection.makefile("r")
        word, _, value = answer.readline().partition(" ")
    except OSError:
        word = ""
    if word != "pid":
        connection.close()
        os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *kernel_argv])
    kernel = int(value)
    for number in FORWARDED:
        signal.signal(number, lambda received, _: _signal_group(kernel, received))
    word, _, value = answer.readline().partition(" ")
    sys.exit(int(value) if word == "exit" else 1)


def _signal_group(group: int, number: int) -> None:
    try:
        os.killpg(group, number)
    except ProcessLookupError:
        pass


# The parent.

def serve(name: str, watched: int) -> None:
    """Make the kernels' common imports, then fork a kernel for each launcher that connects at ``name``, until the
    process ``watched`` (the builder) ends or this one is stopped; every kernel it started is killed then."""
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # as ``python -m ipykernel_launcher`` does: this folder is not the kernels' to import from
    started_env = dict(os.environ)
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # as ipykernel sets it
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)
    problem = _fork_problem()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(16)
    print(f"warm parent {os.getpid()}: imported {', '.join(PRELOADED)}; {problem or 'forking'}", flush=True)
    kernels: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (its launcher's connection, pid)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "launch")
    try:
        while not stopping and _alive(watched):
            for key, _ in selector.select(timeout=0.5):
                if key.data == "launch":
                    connection, _ = listener.accept()
                    try:
                        _start_kernel(connection, listener, selector, kernels, started_env, problem)
                    except (OSError, ValueError) as error:  # a launcher gone mid-request: the others go on
                        print(f"a launch failed: {error!r}", flush=True)
                        connection.close()
                elif key.data[0] == "launcher":  # the launcher hung up (killed): its kernel goes too
                    selector.unregister(key.fileobj)
                    _signal_group(key.data[1], signal.SIGKILL)
                else:
                    _report_exit(key.fileobj, selector, kernels)
    finally:
        for _, pid in kernels.values():
            _signal_group(pid, signal.SIGKILL)


def _fork_problem() -> str:
    """Why forking kernels from this process would not give each a fresh start, or ``""``."""
    threads = len(os.listdir("/proc/self/task"))
    return f"refusing every launch: {threads} threads after the imports" if threads != 1 else ""


def _start_kernel(connection, listener, selector, kernels, started_env: dict[str, str], problem: str) -> None:
    """Fork a kernel for the launcher at ``connection``, or refuse it (``problem``, or its environment)."""
    connection.settimeout(30)  # a launcher sends its request at once
    size, streams, _, _ = socket.recv_fds(connection, 8, len(STREAMS))
    size += _read_exactly(connection, 8 - len(size))
    request = json.loads(_read_exactly(connection, int.from_bytes(size, "big")))
    connection.settimeout(None)
    differs = problem or _differs(request["env"], started_env)
    if differs:
        print(f"refused a launch: {differs}", flush=True)
        connection.sendall(b"refused\n")
        connection.close()
        for stream in streams:
            os.close(stream)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        selector.close()
        for descriptor in (listener, connection, *kernels, *(launcher for launcher, _ in kernels.values())):
            os.close(descriptor if isinstance(descriptor, int) else descriptor.detach())
        os._exit(_become_kernel(request, streams))
    for stream in streams:
        os.close(stream)
    connection.sendall(f"pid {pid}\n".encode())
    pidfd = os.pidfd_open(pid)
    kernels[pidfd] = (connection, pid)
    selector.register(connection, selectors.EVENT_READ, ("launcher", pid))
    selector.register(pidfd, selectors.EVENT_READ, ("kernel", pid))


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = connection.recv(size)
        if not chunk:
            raise ConnectionError("the launcher hung up before its request ended")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _differs(env: dict[str, str], started_env: dict[str, str]) -> str:
    """The variables, other than a launch's own, in which ``env`` differs from the parent's, or ``""``."""
    names = {name for name in env.keys() | started_env.keys() if env.get(name) != started_env.get(name)}
    names = sorted(name for name in names if not name.startswith(PER_LAUNCH))
    return f"its environment differs in {', '.join(names)}" if names else ""


def _report_exit(pidfd: int, selector, kernels) -> None:
    connection, pid = kernels.pop(pidfd)
    selector.unregister(pidfd)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    try:
        connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass  # its launcher is gone
    if connection.fileno() >= 0:
        try:
            selector.unregister(connection)
        except (KeyError, ValueError):
            pass
        connection.close()


def _become_kernel(request: dict, streams: list[int]) -> int:
    """In the forked child: this kernel's process group, streams, folder and environment, then ipykernel's entry
    point."""
    import atexit
    import ctypes

    try:
        os.setsid()
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
        for number in (signal.SIGTERM, signal.SIGCHLD, *FORWARDED):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, stream in zip(STREAMS, streams):
            os.dup2(stream, target)
            os.close(stream)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import numpy
        import torch

        numpy.random.seed()  # a new process seeds both global generators from the OS
        torch.seed()
        import ipykernel_launcher
        from ipykernel import kernelapp

        sys.argv = [ipykernel_launcher.__file__, *request["argv"]]
        kernelapp.launch_new_instance()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[0].startswith("--parent="):
        launch("\0" + arguments[0].split("=", 1)[1], arguments[1:])
    elif arguments[0] == "serve":
        serve("\0" + arguments[1], int(arguments[2]))
