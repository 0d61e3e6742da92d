"""make gpu-check: it selects the tests that need CUDA by their ``cuda`` marker, not by how a skip reason is worded,
lists them with the chapters whose CUDA checks it runs, and says in one line that a CPU has nothing to run."""
import ast
import csv
import importlib.util
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from optlab.commands.reference import check_parts

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_check)

WORDED_ANY_WAY = '''
import pytest

@pytest.mark.cuda
@pytest.mark.skipif(False, reason="no GPU of compute capability 8.9 or newer")
def test_fp8_on_a_gpu():
    pass

@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.cuda)])
def test_on_either(device):
    pass

@pytest.mark.skipif(False, reason="needs a CUDA device")
def test_says_cuda_but_is_not_marked():
    pass
'''


def _gpu_check(*arguments, **env):
    return subprocess.run([sys.executable, "tools/gpu_check.py", *arguments], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=600)


def test_gpu_check_says_in_one_line_that_a_cpu_has_nothing_to_run(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a GPU machine with its GPU hidden
    code, stdout = _main_here(monkeypatch, capsys)
    assert code == 0 and stdout.splitlines() == [
        "gpu-check: no CUDA device here, so nothing to run (the CUDA-only tests and the chapters' CUDA checks need one)"]


def test_a_test_marked_cuda_is_selected_however_its_skip_is_worded(tmp_path):
    (tmp_path / "test_worded.py").write_text(WORDED_ANY_WAY)
    files = gpu_check.test_files(tmp_path)
    assert files == [tmp_path / "test_worded.py"]
    chosen = gpu_check.selected(files, ["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)])
    assert [node.split("::")[1] for node in chosen] == ["test_fp8_on_a_gpu", "test_on_either[gpu]"]


def _skips_on_cuda_itself(call: ast.Call) -> bool:
    return (ast.unparse(call.func).endswith("skipif") and bool(call.args)
            and "not torch.cuda.is_available()" in ast.unparse(call.args[0]))


def test_no_test_writes_its_own_cuda_skip_so_the_marker_is_the_one_condition():
    """A CUDA-only test skips through the ``cuda`` marker (tests/conftest.py), never through a skipif of its own
    that gpu-check could not see."""
    own = [f"{path.name}:{node.lineno}" for path in sorted((ROOT / "tests").glob("test_*.py"))
           for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call) and _skips_on_cuda_itself(node)]
    assert own == []


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
def test_gpu_check_lists_every_cuda_test_and_the_chapters_cuda_checks():
    listed = _gpu_check("--list").stdout.splitlines()
    tests = [line.split(" ", 1)[1] for line in listed if line.startswith("test ")]
    files = {test.split("::")[0] for test in tests}
    assert files == {f"tests/test_{name}.py" for name in (
        "attention_check", "autotune", "cuda_graphs", "cuda_paths", "fp8", "gpu_state", "largest_batch",
        "memory_breakdown", "microbench", "mig_peaks", "numerics", "optimizer_bench", "profiling", "serving_generation",
        "speculative", "tf32", "transformer", "tune_memory")}
    assert "tests/test_cuda_graphs.py::test_graphed_inference_and_training_match_eager" in tests
    assert any(test.startswith("tests/test_fp8.py::") and test.endswith("[cuda]") for test in tests)
    assert any(test.startswith("tests/test_transformer.py::") and test.endswith("-cuda]") for test in tests)
    assert not any("cpu" in test.partition("[")[2] for test in tests)  # a parametrized test's CPU case stays out
    chapters = [line for line in listed if line.startswith("chapter ")]
    assert chapters == [f"chapter notebooks/{name}.ipynb" for name in check_parts.chapters()]  # in the parts' order
    assert sorted(chapters) == [
        f"chapter notebooks/{name}.ipynb" for name in ("11_cuda_graphs", "14_data_pipeline", "15_profiling",
                                                       "22_attention", "23_checkpointing", "24_gpt_precision",
                                                       "29_memory", "30_kv_cache", "31_quantization",
                                                       "32_speculative_decoding", "33_serving", "34_compile_time",
                                                       "35_graph_breaks", "36_changing_shapes", "37_your_model")]


def test_gpu_check_runs_a_chapters_cells_with_its_magics_made_pass():
    """The install cell's ``%pip`` is the only line of its ``except`` block: dropped, the cell would not compile."""
    install = gpu_check.check_cells("22_attention")[0]
    compile(install, "install cell", "exec")
    assert "    pass" in install and "%pip" not in install


def test_a_chapters_cells_get_display_without_importing_it_as_in_jupyter(capsys):
    """Chapters 14, 15 and 29 call ``display`` as a Jupyter kernel's builtin; plain Python has none."""
    exec("display('shown')", gpu_check.chapter_namespace())
    assert "shown" in capsys.readouterr().out


# --- gpu-check in parts -------------------------------------------------------------------------------------------

def test_every_part_fits_one_call_on_an_h200_and_every_chapter_is_in_one_part():
    parts = check_parts.CHECK_PARTS
    assert all(part.h200_s <= check_parts.DEADLINE_S < check_parts.PART_CALL_S for part in parts), parts
    assert len(check_parts.chapters()) == len(set(check_parts.chapters()))
    assert [part.name for part in parts if part.tests] == ["tests"]


def _main_here(monkeypatch, capsys, *arguments) -> tuple[int, str]:
    """``tools/gpu_check.py arguments``'s exit status and output, run in this process (torch is imported already: a
    process of its own spends its seconds on the import); the path it extends is put back after."""
    monkeypatch.setattr(sys, "path", [*sys.path])
    monkeypatch.delenv(gpu_check.REHEARSAL, raising=False)
    code = gpu_check.main(list(arguments))
    return code, capsys.readouterr().out


def test_parts_prints_each_part_with_its_seconds_and_a_deadline_inside_its_command(monkeypatch, capsys):
    code, stdout = _main_here(monkeypatch, capsys, "--parts", "--deadline", "200")
    assert code == 0
    for number, part in enumerate(check_parts.CHECK_PARTS, 1):
        assert (f"{number:<2} {part.name:<14} {part.h200_s:>5.0f} {part.cpu_s:>6.0f} {200:>10}  {part.what}"
                in stdout), stdout
    assert f"timeout -k {check_parts.KILL_AFTER_S} {check_parts.PART_CALL_S} python3 tools/gpu_check.py" in stdout
    assert "not checked on a GPU: chapters 19-21" in stdout and "NCCL cannot run two ranks" in stdout


def test_every_command_of_the_short_plan_is_killed_after_its_limit_and_names_its_archive_after_the_gpu():
    from optlab.commands.reference.short_plan import describe_short_plan

    commands = [line for line in describe_short_plan().splitlines() if line.startswith("timeout")]
    assert commands and all(line.startswith("timeout -k 10 ") for line in commands), commands
    archives = [line.split("--archive ")[1].split()[0] for line in commands]
    assert all(name.startswith("$GPU-") for name in archives), archives
    assert "export GPU=$(python3 -c" in describe_short_plan() and "get_device_name()" in describe_short_plan()
    assert "# not checked on a GPU: chapters 19-21" in describe_short_plan()


PARTS = len(check_parts.CHECK_PARTS)


@pytest.mark.parametrize("arguments, message", [
    (["--part", str(PARTS + 1)], f"gpu-check: error: --part '{PARTS + 1}' is not a part of gpu-check; allowed: 1-{PARTS} "
     "or tests, serving"),
    (["--part", "kv"], f"gpu-check: error: --part 'kv' is not a part of gpu-check; allowed: 1-{PARTS}"),
    (["--deadline", "0"], "gpu-check: error: --deadline must be from 1 to 3600 seconds, got 0"),
    (["--archive", "x.tar.gz"], "gpu-check: error: --archive packs the --out folder: give --out too"),
])
def test_a_bad_part_or_deadline_is_refused_in_one_line(monkeypatch, capsys, arguments, message):
    code, stdout = _main_here(monkeypatch, capsys, *arguments)
    assert code == 2 and stdout.startswith(message), stdout


def test_a_part_is_chosen_by_number_or_name():
    assert check_parts.check_part("5") is check_parts.check_part("memory") is check_parts.CHECK_PARTS[4]


def _notebook(folder: Path, stem: str, *cells: str) -> None:
    import nbformat

    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]),
                   folder / f"{stem}.ipynb")


def test_a_part_stops_at_its_deadline_and_writes_what_finished(tmp_path):
    """The first chapter passes, the second is still running at the deadline, the third never starts: each says so in
    gpu-check.csv, and the archive (packed after each check) holds it."""
    _notebook(tmp_path, "a_quick", "x = 1")
    _notebook(tmp_path, "b_slow", "import time", "time.sleep(30)")
    _notebook(tmp_path, "c_never", "raise SystemExit('must not run')")
    part = check_parts.CheckPart("trial", "three chapters", 1, 1, chapters=("a_quick", "b_slow", "c_never"))
    out = tmp_path / "out"
    report = gpu_check.Report(out, tmp_path / "check.tar.gz", "CPU", "test")
    gpu_check.run_chapter("a_quick", tmp_path)  # a first chapter imports Dynamo and IPython: 4 s on a busy machine
    began = time.monotonic()
    assert not gpu_check.run_part(part, report, [], [], 3.0, probe=False, folder=tmp_path)
    assert time.monotonic() - began < 3.0 + 10
    rows = list(csv.DictReader((out / "gpu-check.csv").open()))
    assert [(row["check"], row["status"]) for row in rows] == [
        ("a_quick", "ok"), ("b_slow", "stopped: the deadline"), ("c_never", "not reached")]
    with tarfile.open(tmp_path / "check.tar.gz") as archive:
        packed = archive.extractfile("out/gpu-check.csv").read().decode()
    assert packed == (out / "gpu-check.csv").read_text()


def test_a_test_file_that_cannot_be_collected_is_a_failure_not_the_deadline(tmp_path):
    """pytest returns INTERRUPTED for a collection error as for our deadline: the broken file is recorded as failed,
    and the part's chapter after it still runs, well before the deadline."""
    broken = tmp_path / "test_broken.py"
    broken.write_text("import pytest\n\n\n@pytest.mark.cuda\ndef test_x():\n    pass\n\n\nraise ImportError('gone')\n")
    _notebook(tmp_path, "a_after", "x = 1")
    part = check_parts.CheckPart("trial", "tests and a chapter", 1, 1, chapters=("a_after",), tests=True)
    report = gpu_check.Report(tmp_path / "out", None, "CPU", "test")
    began = time.monotonic()
    assert not gpu_check.run_part(part, report, [broken], ["-q", "-p", "no:cacheprovider", "--noconftest",
                                                            "--rootdir", str(tmp_path)], 60.0, probe=False,
                                  folder=tmp_path)
    assert time.monotonic() - began < 30
    statuses = [(row["check"], row["status"].split(" (")[0]) for row in report.rows]
    assert statuses == [("CUDA-only tests", "failed: exit status 2"), ("a_after", "ok")], report.rows
    assert "not by the deadline" in report.rows[0]["status"]


SHARED_STEP = '''
import torch

step = torch.compile(lambda x: x * 2, backend="eager", fullgraph=True, dynamic=False)
'''


def test_the_chapter_runner_resets_dynamo_between_chapters(tmp_path, monkeypatch):
    """Two chapters in one process call one compiled function (as the serving chapters call the one compiled
    decode), each at six shapes of its own: twelve versions, past Dynamo's limit of 8 under fullgraph, unless each
    chapter starts with Dynamo's caches empty, as in a kernel of its own."""
    (tmp_path / "shared_step.py").write_text(SHARED_STEP)
    monkeypatch.syspath_prepend(str(tmp_path))
    for stem, sizes in (("first", "1, 7"), ("second", "7, 13")):
        _notebook(tmp_path, stem, "import torch\nfrom shared_step import step",
                  f"for n in range({sizes}):\n    assert step(torch.ones(n)).sum() == 2 * n")
    for stem in ("first", "second"):
        gpu_check.run_chapter(stem, tmp_path)


# --- the rehearsal ------------------------------------------------------------------------------------------------

def test_the_rehearsals_python_finds_the_packages_but_not_an_installed_optlab(tmp_path):
    """An installed optlab (an editable install points at some checkout) would hide a child process that cannot
    import this one: the GPU machine has none."""
    python = gpu_check.clean_python(ROOT / "_build" / "rehearsal-python")
    found = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('torch') is not None, "
                            "u.find_spec('pandas') is not None, u.find_spec('optlab') is None)"],
                           cwd=tmp_path, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=60)
    assert found.stdout.split() == ["True", "True", "True"], found.stderr


REHEARSED = ("tests", "memory")  # what make test rehearses (about 2 min): pytest without Jupyter, the child
# processes; make gpu-rehearsal rehearses every part


@pytest.mark.beside_the_book_build
@pytest.mark.parametrize("part", REHEARSED)
def test_the_rehearsal_runs_a_part_on_the_cpu_as_the_gpu_would(tmp_path, part):
    """``--rehearse --part``: a clean interpreter and environment, the GPU's process, order and working folders, Jupyter
    hidden, the device forced to the CPU; its report lands in the archive. Each of the part's chapters passes."""
    env = {name: os.environ[name] for name in ("PATH", "HOME", "OPTLAB_DATA") if name in os.environ}
    run = subprocess.run([sys.executable, "tools/gpu_check.py", "--rehearse", "--part", part, "--out",
                          str(tmp_path / "cpu"), "--archive", str(tmp_path / "cpu.tar.gz")],
                         cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    rows = list(csv.DictReader((tmp_path / "cpu" / "gpu-check.csv").open()))
    chosen = check_parts.check_part(part)
    checks = (["CUDA-only tests"] if chosen.tests else []) + list(chosen.chapters)
    assert [(row["check"], row["status"], row["mode"]) for row in rows] == [
        (check, "ok", "rehearsal on the CPU") for check in checks], run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0 and run.stdout.splitlines()[-1].startswith("gpu-check: all passed in ")
    with tarfile.open(tmp_path / "cpu.tar.gz") as archive:
        assert "cpu/gpu-check.csv" in archive.getnames()


TINY_DEADLINE_S = 20  # from the process start: its fork server starts at about 4 s on a 2-core machine whose
# other core is busy, its headers build at 14 s (in flight at the deadline), its rounds at 25 s; a machine five times
# slower has started its fork server


@pytest.mark.beside_the_book_build
def test_the_rehearsal_of_a_part_past_a_tiny_deadline_ends_within_10_s_of_it_and_keeps_its_report(tmp_path):
    """Chapter 34's compile starts (fresh processes, a pool of rounds) forced past a tiny deadline in the rehearsal
    (counted from the process start: its imports come first): the command ends within 10 s of it (the fork server's start
    in flight, or the pool's round, used to run on: 47 s past it in one try), its row says it stopped at the deadline,
    and the archive holds the report. The study's folder in the rehearsal's TMPDIR, watched while it runs, shows that
    its fresh processes had started (a deadline that came during the imports would test nothing of theirs), and that
    the study removed it as it stopped."""
    env = {name: os.environ[name] for name in ("PATH", "HOME", "OPTLAB_DATA") if name in os.environ}
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    began = time.monotonic()
    with (tmp_path / "output.txt").open("w") as output:
        run = subprocess.Popen([sys.executable, "tools/gpu_check.py", "--rehearse", "--part", "compile-starts",
                                "--deadline", str(TINY_DEADLINE_S), "--out", str(tmp_path / "cpu"),
                                "--archive", str(tmp_path / "cpu.tar.gz")],
                               cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", "TMPDIR": str(temporary)},
                               stdout=output, stderr=subprocess.STDOUT)
        started = set()  # what the study's folder held at any moment
        while run.poll() is None and time.monotonic() - began < 600:
            started |= {path.name for path in temporary.glob("optlab-first-step-*/*")}
            time.sleep(0.2)
        run.kill()
        run.wait()
    took = time.monotonic() - began
    rows = list(csv.DictReader((tmp_path / "cpu" / "gpu-check.csv").open()))
    assert [(row["check"], row["status"]) for row in rows] == [("34_compile_time", "stopped: the deadline")], \
        (tmp_path / "output.txt").read_text()[-4000:]
    assert float(rows[0]["seconds"]) > 0, rows  # the chapter had started
    assert "machine" in started, started  # the fork server had started: its starts were in flight
    assert not list(temporary.glob("optlab-first-step-*")), "the stopped study left its folder"
    assert run.returncode == 1 and took < TINY_DEADLINE_S + 10 + 5, (took, started)  # 5 s: the rehearsal's interpreter
    with tarfile.open(tmp_path / "cpu.tar.gz") as archive:
        assert "cpu/gpu-check.csv" in archive.getnames()


# --- the plan of a short GPU job ----------------------------------------------------------------------------------

def test_the_gpu_page_and_reference_plan_give_the_same_short_job_plan():
    from optlab.commands.reference.planning import describe_plan
    from optlab.commands.reference.short_plan import describe_short_plan

    page = (ROOT / "book" / "using" / "gpu.md").read_text()
    block = page.split("## A short GPU job")[1].split("```bash\n")[1].split("\n```")[0]
    assert block == describe_short_plan()
    assert describe_short_plan() in describe_plan("seed", device="cpu")


def test_the_short_plan_starts_with_the_seed_set_and_its_first_job_fits():
    from optlab.commands.reference import short_plan
    from optlab.commands.reference.planning import set_names

    plan, fitted = short_plan.PLAN, short_plan.first_job()
    assert plan[0].command.startswith("python3 -m optlab reference --set seed ") and "--budget 230 " in plan[0].command
    assert fitted >= 2 and short_plan.MACHINE_START_S + sum(s.limit_s for s in plan[:fitted]) <= short_plan.JOB_S
    assert short_plan.MACHINE_START_S + sum(s.limit_s for s in plan[:fitted + 1]) > short_plan.JOB_S
    assert all(step.limit_s <= short_plan.COMMAND_S for step in plan)
    budgets = [(s.command.split("--set ")[1].split()[0], int(s.command.split("--budget ")[1].split()[0]), s.limit_s)
               for s in plan if s.check is None]
    assert all(set_names(name) and budget < limit for name, budget, limit in budgets)
    assert short_plan.parts_left_out() == []


def test_a_set_added_to_the_short_plan_is_one_entry(monkeypatch):
    from optlab.commands.reference import short_plan

    added = short_plan.reference_step("beyond", 230, "precision, the data pipeline and the optimizers")
    monkeypatch.setattr(short_plan, "PLAN", (*short_plan.PLAN, added))
    lines = [line for line in short_plan.describe_short_plan().splitlines() if line.startswith("timeout")]
    assert lines[-1] == f"timeout -k 10 240 {added.command}   # {added.what}"


@pytest.mark.parametrize("child, caught", [
    ("import no_such_module", "cannot import"),  # as optlab from notebooks/ with PYTHONPATH=.
    ("raise SystemExit('Torch not compiled with CUDA enabled')", None),  # past its imports, at its first CUDA call
    (None, "started no child process"),  # the chapter's code changed under the probe
])
def test_a_probe_fails_on_a_child_that_cannot_import_and_on_none_started(monkeypatch, child, caught):
    code = ("1 + 1" if child is None else
            f"done = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True)\n"
            "if done.returncode: raise RuntimeError(done.stderr.strip().splitlines()[-1])")
    monkeypatch.setitem(gpu_check.CHILD_PROBES, "trial", code)
    if caught is None:
        gpu_check.probe_children("trial", {"subprocess": subprocess, "sys": sys})
        return
    with pytest.raises(gpu_check.ChildCannotImport, match=caught):
        gpu_check.probe_children("trial", {"subprocess": subprocess, "sys": sys})


def test_without_jupyter_two_chapters_and_their_figures_run_in_one_process():
    """Where IPython is missing (the GPU image), the stand-in serves a second chapter too, and matplotlib, which asks
    any IPython module for its shell and version, draws."""
    code = ("import importlib.util; spec = importlib.util.spec_from_file_location('g', 'tools/gpu_check.py'); "
            "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g); g.hide_jupyter(); "
            "g.chapter_namespace(); namespace = g.chapter_namespace(); "
            "import matplotlib.pyplot as plt; plt.subplots(); namespace['display']('shown')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MPLBACKEND": "Agg"})
    assert run.returncode == 0 and run.stdout.strip() == "shown", run.stderr[-2000:]


def test_the_gpu_page_names_what_the_gpu_run_checks_and_the_parallelism_chapters_it_does_not():
    section = (ROOT / "book" / "using" / "gpu.md").read_text().split("## What the GPU run checks")[1].split("\n## ")[0]
    assert "Chapters 19-21" in section and "not checked on a GPU" in section and "NCCL" in section
    numbers = {int(chapter[:2]) for chapter in check_parts.chapters()}
    assert numbers == {11, 14, 15, 22, 23, 24, *range(29, 38)}, numbers  # the page's "11, 14, 15, 22-24 and 29-37"
    assert not numbers & {19, 20, 21}
