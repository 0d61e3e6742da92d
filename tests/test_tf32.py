"""The TF32 switches timed apart: refused on the CPU, the table's shape, and its errors against fp64."""
import pytest

from optlab import resolve_device
from optlab.studies.kernels import tf32
from optlab.core.errors import OptlabError
from optlab.studies.limits.peaks import has_tf32

needs_cuda = pytest.mark.cuda


def test_the_cpu_is_refused_with_a_reason():
    with pytest.raises(OptlabError, match=r"needs a CUDA device .* tensor-core math mode"):
        tf32.tf32_benchmark("cpu")


@pytest.mark.parametrize("size, shape, message", [(0, (2, 4, 8, 8), "matmul_size"), (64, (2, 4, 8), "conv_shape"),
                                                  (64, (2, 0, 8, 8), "conv_shape")])
def test_bad_sizes_are_refused(size, shape, message):
    with pytest.raises(OptlabError, match=message):
        tf32.tf32_benchmark("cpu", matmul_size=size, conv_shape=shape)


def test_each_switch_times_its_own_operation_and_does_nothing_on_the_cpu():
    table = tf32._measure_ops(resolve_device("cpu"), 32, (2, 4, 8, 8), min_run_time=0.01)
    assert table["switch"].tolist() == ["matmul_tf32", "matmul_tf32", "cudnn_tf32", "cudnn_tf32"]
    assert table["tf32"].tolist() == [False, True, False, True]
    assert (table.loc[~table["tf32"], "speedup"] == 1).all() and (table["tflops"] > 0).all()
    errors = table.groupby("op")["rel_err_vs_fp64"]
    assert (errors.max() < 1e-5).all() and (errors.nunique() == 1).all()  # the switch changes nothing here


@needs_cuda
def test_tf32_on_a_gpu_trades_precision_for_speed():
    table = tf32.tf32_benchmark("cuda", matmul_size=1024, conv_shape=(8, 64, 16, 16), min_run_time=0.05)
    assert len(table) == 4 and (table["median_s"] > 0).all()
    if has_tf32(resolve_device("cuda")):
        errors = table.set_index(["switch", "tf32"])["rel_err_vs_fp64"]
        assert errors[("matmul_tf32", True)] > 10 * errors[("matmul_tf32", False)]
