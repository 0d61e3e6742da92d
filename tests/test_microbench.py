"""Micro-benchmarks: the tables' shape, rates computed from the measured times, and errors for bad requests."""
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from optlab.studies.kernels import microbench
from optlab import resolve_device
from optlab.core.errors import OptlabError

needs_cuda = pytest.mark.cuda


def test_matmul_benchmark_times_every_size_on_the_cpu():
    table = microbench.matmul_benchmark("cpu", sizes=(63, 64), dtype=torch.float32, min_run_time=0.01)
    assert list(table["n"]) == [63, 64]
    assert list(table["multiple_of_8"]) == [False, True]
    assert set(table["dtype"]) == {"float32"} and set(table["device"]) == {resolve_device("cpu").name}
    assert (table["median_s"] > 0).all() and (table["runs"] >= 4).all() and (table["iqr_s"] >= 0).all()
    assert (table["tflops"] > 0).all()


def test_matmul_rate_comes_from_the_timers_median(monkeypatch):
    fake = SimpleNamespace(median=0.5, iqr=0.1, times=[0.4, 0.5, 0.6])
    monkeypatch.setattr(microbench, "_measure", lambda stmt, globals_, min_run_time: fake)
    row = microbench.matmul_benchmark("cpu", sizes=(100,), dtype=torch.float32).iloc[0]
    assert (row["median_s"], row["iqr_s"], row["runs"]) == (0.5, 0.1, 3)
    assert row["tflops"] == pytest.approx(2 * 100**3 / 0.5 / 1e12)


def test_matmul_runs_the_requested_dtype(monkeypatch):
    seen = []
    monkeypatch.setattr(microbench, "_measure",
                        lambda stmt, globals_, min_run_time: seen.append(globals_["a"].dtype) or
                        SimpleNamespace(median=1.0, iqr=0.0, times=[1.0]))
    table = microbench.matmul_benchmark("cpu", sizes=(8,), dtype=torch.bfloat16)
    assert seen == [torch.bfloat16] and table["dtype"].tolist() == ["bfloat16"]


@pytest.mark.parametrize("sizes", [(), (0,), (-4,), (True,), (8.0,)])
def test_matmul_rejects_bad_sizes(sizes):
    with pytest.raises(OptlabError, match="positive integers"):
        microbench.matmul_benchmark("cpu", sizes=sizes)


def test_matmul_rejects_an_integer_dtype():
    with pytest.raises(OptlabError, match="floating-point"):
        microbench.matmul_benchmark("cpu", sizes=(8,), dtype=torch.int32)


def test_copy_benchmark_refuses_the_cpu():
    with pytest.raises(OptlabError, match="needs a CUDA device"):
        microbench.copy_benchmark("cpu", sizes_mib=(1,))


def test_copy_benchmark_without_cuda_says_so(no_cuda):
    with pytest.raises(OptlabError, match="CUDA is not available"):
        microbench.copy_benchmark("cuda", sizes_mib=(1,))


@needs_cuda
def test_copy_benchmark_covers_every_source_and_setting():
    table = microbench.copy_benchmark("cuda", sizes_mib=(1,), min_run_time=0.01)
    assert len(table) == len(microbench.COPY_SOURCES) * 2
    assert set(table["source"]) == set(microbench.COPY_SOURCES) and set(table["non_blocking"]) == {False, True}
    assert (table["gb_per_s"] > 0).all()


@needs_cuda
def test_copy_rate_comes_from_the_timers_median(monkeypatch):
    fake = SimpleNamespace(median=1e-3, iqr=0.0, times=[1e-3])
    monkeypatch.setattr(microbench, "_measure", lambda stmt, globals_, min_run_time: fake)
    table = microbench.copy_benchmark("cuda", sizes_mib=(2,))
    assert table["gb_per_s"].tolist() == pytest.approx([2 * 2**20 / 1e-3 / 1e9] * len(table))


@needs_cuda
def test_matmul_benchmark_on_cuda_in_half_precision():
    table = microbench.matmul_benchmark("cuda", sizes=(255, 256), dtype=torch.float16, min_run_time=0.01)
    assert table["dtype"].tolist() == ["float16", "float16"] and (table["tflops"] > 0).all()


def test_saved_tables_are_found_per_machine(tmp_path):
    first = pd.DataFrame({"device": ["gpu a"], "n": [4096], "tflops": [1.5]})
    second = pd.DataFrame({"device": ["gpu b"], "n": [4095], "tflops": [0.5]})
    path = microbench.save(first, tmp_path / "a", "matmul")
    microbench.save(second, tmp_path / "b", "matmul")
    assert path == tmp_path / "a" / "microbench-matmul.csv"
    pd.testing.assert_frame_equal(microbench.stored("matmul", tmp_path), pd.concat([first, second], ignore_index=True))
    assert microbench.stored("copy", tmp_path) is None


def test_unknown_kind_is_an_error(tmp_path):
    with pytest.raises(OptlabError, match="unknown micro-benchmark 'conv'"):
        microbench.stored("conv", tmp_path)
    with pytest.raises(OptlabError, match="unknown micro-benchmark"):
        microbench.save(pd.DataFrame(), tmp_path, "conv")
