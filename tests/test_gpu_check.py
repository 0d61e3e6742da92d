"""make gpu-check: it selects the tests that need CUDA by their ``cuda`` marker, not by how a skip reason is worded,
lists them with the chapters whose CUDA checks it runs, and says in one line that a CPU has nothing to run."""
import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

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


def test_gpu_check_says_in_one_line_that_a_cpu_has_nothing_to_run():
    run = _gpu_check(CUDA_VISIBLE_DEVICES="")
    assert run.returncode == 0 and run.stdout.splitlines() == [
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


def test_gpu_check_lists_every_cuda_test_and_the_chapters_cuda_checks():
    listed = _gpu_check("--list").stdout.splitlines()
    tests = [line.split(" ", 1)[1] for line in listed if line.startswith("test ")]
    files = {test.split("::")[0] for test in tests}
    assert files == {f"tests/test_{name}.py" for name in ("attention_check", "autotune", "cuda_graphs", "fp8",
                                                          "largest_batch", "memory_breakdown", "microbench", "numerics",
                                                          "optimizer_bench", "profiling", "serving_generation",
                                                          "speculative", "tf32", "transformer", "tune_memory")}
    assert "tests/test_cuda_graphs.py::test_graphed_inference_and_training_match_eager" in tests
    assert any(test.startswith("tests/test_fp8.py::") and test.endswith("[cuda]") for test in tests)
    assert any(test.startswith("tests/test_transformer.py::") and test.endswith("-cuda]") for test in tests)
    assert not any("cpu" in test.partition("[")[2] for test in tests)  # a parametrized test's CPU case stays out
    assert [line for line in listed if line.startswith("chapter ")] == [
        f"chapter notebooks/{name}.ipynb" for name in ("11_cuda_graphs", "14_data_pipeline", "15_profiling",
                                                       "22_attention", "23_checkpointing", "24_gpt_precision",
                                                       "29_memory", "30_kv_cache", "31_quantization",
                                                       "32_speculative_decoding", "33_serving", "37_your_model")]


def test_gpu_check_runs_a_chapters_cells_with_its_magics_made_pass():
    """The install cell's ``%pip`` is the only line of its ``except`` block: dropped, the cell would not compile."""
    install = gpu_check.check_cells("22_attention")[0]
    compile(install, "install cell", "exec")
    assert "    pass" in install and "%pip" not in install


def test_a_chapters_cells_get_display_without_importing_it_as_in_jupyter(capsys):
    """Chapters 14, 15 and 29 call ``display`` as a Jupyter kernel's builtin; plain Python has none."""
    exec("display('shown')", gpu_check.chapter_namespace())
    assert "shown" in capsys.readouterr().out
