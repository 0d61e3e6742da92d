"""The machine's ceilings: each figure's arithmetic on a fake clock (FLOPs of a product, bytes of a copy and a read,
time per launch), the interval of a median, bounded arguments, and one real measurement on this CPU."""
import math

import pytest
import torch

from optlab.commands.cli import main
from optlab.core.errors import OptlabError
from optlab.studies import ceilings

BLOCKS = [1.0, 3.0, 2.0, 5.0, 4.0, 7.0, 6.0]  # seconds-scale multipliers: median 4, interval min..max (7 blocks)


def fake_timer(calls):
    """Each statement's block times: a base time per statement kind, times BLOCKS; every call is kept."""
    def timer(stmt, globals_):
        calls.append((stmt, globals_))
        base = {"torch.mm(a, b)": 1e-3, "target.copy_(source)": 2e-2, "source.sum()": 5e-3, "x + 1": 1e-6}[stmt]
        return [base * b for b in BLOCKS]
    return timer


def test_each_figure_is_its_work_over_the_fake_time():
    calls = []
    table = ceilings.measure("cpu", ["fp32", "bf16"], mib=3, timer=fake_timer(calls))
    matmul = table[table["ceiling"] == "matmul"]
    assert len(matmul) == 2 * len(ceilings.MATMUL_SHAPES["cpu"])
    for row in matmul.itertuples():
        m, n, k = map(int, row.detail.split("x"))
        flops = 2 * m * n * k
        assert row.value == pytest.approx(flops / 4e-3 / 1e12)  # the median block: 4 x 1 ms
        assert (row.ci_low, row.ci_high) == pytest.approx((flops / 7e-3 / 1e12, flops / 1e-3 / 1e12))
    # the operands have the shapes the rows name, in the dtype asked for
    products = [g for s, g in calls if s == "torch.mm(a, b)"]
    assert [(g["a"].shape[0], g["b"].shape[1], g["a"].shape[1]) for g in products] == \
        list(ceilings.MATMUL_SHAPES["cpu"]) * 2
    assert {g["a"].dtype for g in products} == {torch.float32, torch.bfloat16}
    nbytes = 3 * 2**20
    copy, read, launch = (table[table["ceiling"] == name].iloc[0] for name in ("copy", "read", "launch"))
    assert copy["value"] == pytest.approx(2 * nbytes / 8e-2 / 1e9)  # read and written
    assert read["value"] == pytest.approx(nbytes / 2e-2 / 1e9)
    assert launch["value"] == pytest.approx(4.0) and launch["unit"] == "µs"
    assert (launch["ci_low"], launch["ci_high"]) == pytest.approx((1.0, 7.0))
    assert table["blocks"].eq(len(BLOCKS)).all()


def test_the_roofs_take_each_dtype_s_best_shape_and_the_faster_bandwidth():
    table = ceilings.measure("cpu", ["fp32"], mib=1, timer=fake_timer([]))
    roofs = ceilings.Roofs.from_table(table)
    side = max(2 * m * n * k for m, n, k in ceilings.MATMUL_SHAPES["cpu"])
    assert roofs.flops_per_s["fp32"] == pytest.approx(side / 4e-3)
    assert roofs.bytes_per_s == pytest.approx(2**20 / 2e-2)  # the read: faster than the copy here
    assert roofs.launch_s == pytest.approx(4e-6)
    best = ceilings.best(table)
    assert list(best["ceiling"]) == ["matmul", "copy", "read", "launch"]


@pytest.mark.parametrize("kwargs, message", [
    ({"dtypes": ["fp64"]}, "choose one of: fp32, bf16"),
    ({"dtypes": ["fp8"]}, "choose one of: fp32, bf16"),
    ({"mib": 0}, "at least 1"),
    ({"mib": ceilings.MAX_MIB + 1}, f"at most {ceilings.MAX_MIB}"),
    ({"mib": 2.5}, "whole number"),
    ({"min_run_time": 0}, "above 0"),
    ({"min_run_time": float("nan")}, "above 0"),
    ({"min_run_time": 60}, "at most 5"),
])
def test_bad_arguments_are_refused_before_anything_is_timed(kwargs, message):
    with pytest.raises(OptlabError, match=message):
        ceilings.measure("cpu", timer=lambda *_: pytest.fail("timed before the arguments were checked"), **kwargs)


def test_the_command_refuses_bad_input_in_one_line(capsys):
    assert main(["ceilings", "--device", "cpu", "--dtypes", "fp32,int8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("optlab: error: unknown dtype") and "int8" in err


def test_a_real_measurement_on_this_cpu(tmp_path, capsys):
    assert main(["ceilings", "--device", "cpu", "--dtypes", "fp32", "--mib", "8", "--min-run-time", "0.02",
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "MAMF fp32" in printed and "copy" in printed and "launch" in printed
    table = ceilings.load(tmp_path)
    assert table is not None and set(table["ceiling"]) == {"matmul", "copy", "read", "launch"}
    assert (table["value"] > 0).all() and (table["ci_low"] <= table["value"]).all()
    assert (table["value"] <= table["ci_high"]).all()
    assert table[["value", "ci_low", "ci_high"]].map(math.isfinite).all().all()


def test_published_ceilings_are_linked_and_below_their_datasheet():
    table = ceilings.published()
    assert table["url"].str.startswith("https://github.com/stas00/ml-engineering/").all()
    assert {"NVIDIA A100 SXM", "NVIDIA H100 SXM", "NVIDIA H200 SXM"} <= set(table["accelerator"])
    assert (table["% of datasheet"] < 100).all() and (table["% of datasheet"] > 40).all()
    h100 = table.set_index(["accelerator", "dtype"]).loc[("NVIDIA H100 SXM", "bf16")]
    assert h100["% of datasheet"] == pytest.approx(80.3, abs=0.05)  # the table's own efficiency column
    assert all(len(shape.split("x")) == 3 for shape in table["best_shape"])
