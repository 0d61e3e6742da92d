"""The machine's ceilings: each figure's arithmetic on a fake clock (FLOPs of a product, bytes of a copy and a read,
time per launch), the interval of a median over rounds, bounded arguments, and one real measurement on this CPU."""
import math
import types

import pandas as pd
import pytest
import torch

from optlab.commands.cli import main
from optlab.core.errors import OptlabError
from optlab.core.machine.device import resolve_device
from optlab.core.results import store
from optlab.studies.limits import ceilings, peaks, sweep

BLOCKS = [1.0, 3.0, 2.0, 5.0, 4.0, 7.0]  # one block a round: 95 % interval of the median: min..max
BASES = {"torch.mm(a, b)": 1e-3, "target.copy_(source)": 2e-2, "source.sum()": 5e-3, "x + 1": 1e-6}


def constant_timer(calls):
    """Each statement's seconds per run, the same at every block; every call is kept."""
    def timer(stmt, globals_, runs):
        calls.append((stmt, globals_, runs))
        return BASES[stmt]
    return timer


def test_each_figure_is_its_work_over_the_fake_time():
    calls = []
    table = ceilings.measure("cpu", ["fp32", "bf16"], mib=3, timer=constant_timer(calls))
    matmul = table[table["ceiling"] == "matmul"]
    assert len(matmul) == 2 * len(ceilings.MATMUL_SHAPES["cpu"])
    for row in matmul.itertuples():
        m, n, k = map(int, row.detail.split("x"))
        assert row.value == row.ci_low == row.ci_high == pytest.approx(2 * m * n * k / 1e-3 / 1e12)
    # the operands have the shapes the rows name, in the dtype asked for
    products = [g for s, g, _ in calls if s == "torch.mm(a, b)"]
    assert {(g["a"].shape[0], g["b"].shape[1], g["a"].shape[1]) for g in products} == set(ceilings.MATMUL_SHAPES["cpu"])
    assert {g["a"].dtype for g in products} == {torch.float32, torch.bfloat16}
    nbytes = 3 * 2**20
    copy, read, launch = (table[table["ceiling"] == name].iloc[0] for name in ("copy", "read", "launch"))
    assert copy["value"] == pytest.approx(2 * nbytes / 2e-2 / 1e9)  # read and written
    assert read["value"] == pytest.approx(nbytes / 5e-3 / 1e9)
    assert launch["value"] == pytest.approx(1.0) and launch["unit"] == "µs"
    assert table["blocks"].eq(ceilings.ROUNDS).all() and table["rounds"].eq(ceilings.ROUNDS).all()


def handmade(figure, seconds, runs=10, other_busy_cores=0.0):
    """A sweep of one figure whose blocks took ``seconds`` per run, on a machine that other work kept that busy."""
    load = {"load_1m_start": 1.0, "load_1m_end": 1.0, "cpu_count": 2, "seconds": 9.0,
            "other_busy_cores": other_busy_cores}
    return sweep.Sweep([sweep.Timed(figure, list(seconds), runs)], len(seconds), 9.0, load)


def test_the_interval_is_the_order_statistic_interval_of_the_rounds_medians():
    """Six rounds: the 95 % interval of the median is the slowest and fastest round (binomial(6, 1/2): 1 - 2/64
    covers 96.9 %, the next pair 1 - 14/64 only 78 %), and its width is what those blocks give, to the last digit;
    the median of six rates is the mean of the middle two."""
    figure = ceilings.matmul_figure(torch.device("meta"), "fp32", 64, 64, 64)
    flops = 2 * 64**3
    row = ceilings.table_of(handmade(figure, [1e-3 * b for b in BLOCKS]), "cpu").iloc[0]
    assert row["value"] == pytest.approx(flops * (1 / 3e-3 + 1 / 4e-3) / 2 / 1e12)
    assert row["ci_low"] == pytest.approx(flops / 7e-3 / 1e12) and row["ci_high"] == pytest.approx(flops / 1e-3 / 1e12)
    assert row["ci_high"] - row["ci_low"] == pytest.approx(flops / 1e12 * (1 / 1e-3 - 1 / 7e-3))
    ten = [1e-3 * b for b in range(1, 11)]  # ten rounds: j = 2 covers 1 - 2 x 11/1024 = 97.9 %, j = 3 only 89 %
    row = ceilings.table_of(handmade(figure, ten), "cpu").iloc[0]
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((flops / 9e-3 / 1e12, flops / 2e-3 / 1e12))


def test_a_graph_replay_is_divided_by_its_operations_and_a_launch_is_a_time():
    """The CUDA-graph row (built on a GPU only) through a CPU fake: a replay of GRAPH_OPS adds over GRAPH_OPS."""
    eager, graph = ceilings.launch_figures(torch.device("meta"), graph=True)
    replay_s = [ceilings.GRAPH_OPS * 2e-6 * b for b in BLOCKS]
    row = ceilings.table_of(handmade(graph, replay_s), "NVIDIA H200").iloc[0]
    assert row["value"] == pytest.approx(3.5 * 2.0) and row["unit"] == "µs"  # per add, in µs
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((2.0, 14.0))
    assert ceilings.table_of(handmade(eager, [5e-6] * 6), "x").iloc[0]["value"] == pytest.approx(5.0)


def test_tf32_is_on_for_the_tf32_figures_alone_and_restored_after():
    seen = []

    def timer(stmt, globals_, runs):
        seen.append((globals_["a"].shape[0], torch.backends.cuda.matmul.allow_tf32))
        return 1e-3
    before = torch.backends.cuda.matmul.allow_tf32
    figures = [ceilings.matmul_figure(torch.device("meta"), "fp32", 8, 8, 8),
               ceilings.matmul_figure(torch.device("meta"), "tf32", 16, 8, 8)]
    sweep.run(figures, rounds=3, block_s=0.01, timer=timer)
    visits = 1 + sweep.CALIBRATION_TRIES + 3 * 2  # a warm-up and calibration's tries, three warmed rounds each
    assert sorted(seen) == [(8, False)] * visits + [(16, True)] * visits
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_a_busy_machine_is_named_once_and_a_quiet_one_is_not():
    figure = ceilings.launch_figures(torch.device("meta"), graph=False)[0]
    busy = ceilings.table_of(handmade(figure, [1e-6] * 6, other_busy_cores=1.8), "cpu")
    quiet = ceilings.table_of(handmade(figure, [1e-6] * 6, other_busy_cores=0.1), "cpu")
    assert ceilings.describe(busy).splitlines()[-1].startswith("warning: the timing competed with other work (other "
                                                               "processes kept 1.8 of 2 cores busy")
    assert "warning" not in ceilings.describe(quiet) and quiet["load_warning"].eq("").all()
    assert "1 figures in 6 rounds across 9 s" in ceilings.describe(quiet)


def test_the_rounds_spread_each_figure_s_blocks_across_the_sweep():
    """Each figure is calibrated once (a block grown 10x until it lasts a tenth of a block, the fastest of a few tries
    at each size), then timed once a round with the runs fixed then: every figure's k-th block comes before any
    figure's (k+1)-th."""
    calls = []

    def timer(stmt, globals_, runs):
        calls.append((globals_["name"], runs))
        return {"fast": 1e-4, "slow": 0.03}[globals_["name"]]
    figures = [sweep.Figure("launch", "fp32", name, 1, lambda name=name: ("pass", {"name": name}))
               for name in ("fast", "slow")]
    result = sweep.run(figures, rounds=4, block_s=0.02, timer=timer)
    tries = sweep.CALIBRATION_TRIES
    calibration = [("fast", 1)] + [("fast", runs) for runs in (1, 10, 100) for _ in range(tries)] + [("slow", 1)] * (
        1 + tries)  # a warm-up run, then each size's tries: 100 x 0.1 ms is past 2 ms
    assert calls[:len(calibration)] == calibration
    assert [t.runs for t in result.timed] == [200, 1]  # 20 ms of 0.1 ms; one 30 ms run
    rounds = calls[len(calibration):]
    assert len(rounds) == 16 and all({name for name, _ in rounds[4 * k:4 * k + 4]} == {"fast", "slow"}
                                     for k in range(4))
    assert rounds[::2] == [(name, 1) for name, _ in rounds[1::2]]  # each block after its visit's warm-up run
    assert {runs for name, runs in rounds[1::2] if name == "fast"} == {200}
    assert [t.seconds for t in result.timed] == [[1e-4] * 4, [0.03] * 4]


class AsyncDevice:
    """A fake GPU: launches queue work and return at once; ``synchronize`` waits for it on the host's clock."""

    def __init__(self):
        self.host_s, self.queued_s, self.synchronized = 0.0, 0.0, 0

    def launch(self, seconds):
        self.queued_s += seconds

    def synchronize(self, device=None):
        self.synchronized += 1
        self.host_s, self.queued_s = self.host_s + self.queued_s, 0.0

    def now(self):
        return self.host_s


def test_a_gpu_block_waits_for_its_work(monkeypatch):
    """On a GPU the block clock synchronizes before it reads the time: a block of queued work is timed whole (and
    the operands' own queued work, launched while they were built, stays out of it)."""
    device = AsyncDevice()
    monkeypatch.setattr(torch.cuda, "synchronize", device.synchronize)
    monkeypatch.setattr(sweep.time, "perf_counter", device.now)

    def build():
        device.launch(0.5)  # building the operands queues work too
        return "device.launch(0.002)", {"device": device}
    figure = sweep.Figure("matmul", "bf16", "fake", 1, build)
    timer = sweep.block_timer(sweep.device_clock(torch.device("cuda")))
    result = sweep.run([figure], rounds=6, block_s=0.02, timer=timer)
    assert result.timed[0].runs == 10
    assert result.timed[0].seconds == pytest.approx([0.002] * 6, rel=1e-9)
    assert device.synchronized >= 2 * (6 + sweep.CALIBRATION_TRIES)  # both ends of every block at least


H200_RATES = {torch.float32: 60e12, torch.bfloat16: 800e12, torch.float16: 800e12, torch.float8_e4m3fn: 1400e12}


class TorchLikeTimer:
    """Python's ``timeit.Timer`` and torch's ``blocked_autorange`` on a simulated clock with a GPU's costs: each timed
    call synchronizes (``SYNC_S``), a run costs its work at H200 rates, and ``blocked_autorange`` searches its block
    size as torch's does (10x steps until the overhead is under 1e-4 of a block)."""

    SYNC_S = 10e-6
    clock_s = 0.0

    def __init__(self, stmt, setup="pass", timer=None, globals=None, num_threads=1):
        self.run_s = self.cost(stmt, globals)

    @staticmethod
    def cost(stmt, g):
        if stmt == "torch.mm(a, b)" or stmt.startswith("torch._scaled_mm"):
            (m, k), n = g["a"].shape, g["b"].shape[1]
            tf32 = g["a"].dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
            return 2 * m * n * k / (400e12 if tf32 else H200_RATES[g["a"].dtype])
        if stmt == "target.copy_(source)":
            return 2 * g["source"].numel() * 4 / 4.3e12
        if stmt == "source.sum()":
            return g["source"].numel() * 4 / 4.3e12
        return {"x + 1": 5e-6, "graph.replay()": 64 * 2e-6}[stmt]

    def _timeit(self, number):
        spent = 2 * self.SYNC_S + number * self.run_s
        TorchLikeTimer.clock_s += spent
        return spent

    def timeit(self, number):
        """Python's ``timeit``: the block alone (torch's adds a warm-up of two runs or more first)."""
        return self._timeit(number)

    def blocked_autorange(self, min_run_time=0.2):
        overhead, number = 2 * self.SYNC_S, 1
        for _ in range(5):
            self._timeit(0)
        while True:
            taken = self._timeit(number)
            if (overhead / taken <= 1e-4 and taken >= min_run_time / 1000) or taken > min_run_time:
                break
            number *= 10
        times, total = [], 0.0
        while total < min_run_time:
            times.append(self._timeit(number) / number)
            total += times[-1] * number
        return types.SimpleNamespace(times=times, median=float(pd.Series(times).median()))


def test_a_gpu_sweep_is_bounded_in_time(monkeypatch):
    """The GPU's 43 figures without the graph (8 shapes x 5 dtypes, copy and read of 4 GiB, an eager launch) at H200
    rates with 10 µs a synchronisation: a block-size search per call costs minutes; a sweep with runs per block
    fixed once costs its rounds' blocks, their warm-ups and one calibration each, well under a minute."""
    monkeypatch.setattr(sweep.timeit, "Timer", TorchLikeTimer)
    monkeypatch.setattr(torch.utils.benchmark, "Timer", TorchLikeTimer)
    TorchLikeTimer.clock_s = 0.0
    figures = ceilings.figures(torch.device("meta"), tuple(ceilings.DTYPES), ceilings.MATMUL_SHAPES["cuda"], 4096,
                               graph=False)
    block_s = ceilings.MIN_RUN_TIME_S["cuda"] / ceilings.ROUNDS
    result = sweep.run(figures, ceilings.ROUNDS, block_s, sweep.block_timer(lambda: 0.0))
    assert len(figures) == 43 and all(len(t.seconds) == ceilings.ROUNDS for t in result.timed)
    # the longest a figure may take: its calibration (a warm-up run, and each try at most a block and its 10x steps
    # below, or one run) and each round's block (at least one run) with its warm-up run, plus synchronisations
    bound = sum((1 + sweep.CALIBRATION_TRIES) * (1.2 * block_s + TorchLikeTimer.cost(*f.build())) + ceilings.ROUNDS * (
        block_s + 2 * TorchLikeTimer.cost(*f.build())) + 0.01 for f in figures)
    assert TorchLikeTimer.clock_s <= bound < 60, (TorchLikeTimer.clock_s, bound)


def test_the_bandwidth_buffer_is_past_every_cache_of_the_machine(tmp_path, monkeypatch):
    """Fifteen 32 MiB L3 caches (480 MiB, one per chiplet) and their private L2s, as sysfs lists them: the buffer is
    4 x 480 MiB, where cpu0's cache alone (32 MiB) would make it 128 MiB, inside the caches."""
    for cpu in range(30):
        for index, (level, size, shared) in enumerate([(2, "1024K", str(cpu)), (3, "32768K", f"{cpu // 2 * 2}-"
                                                                                           f"{cpu // 2 * 2 + 1}")]):
            folder = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
            folder.mkdir(parents=True)
            for name, text in (("level", str(level)), ("size", size), ("shared_cpu_list", shared)):
                (folder / name).write_text(text + "\n")
    from optlab.studies.serving import bandwidth
    assert bandwidth.all_last_level_caches_bytes("cpu", tmp_path) == 15 * 32 * 2**20
    monkeypatch.setattr(ceilings, "all_last_level_caches_bytes", lambda device: 15 * 32 * 2**20)
    assert ceilings.bandwidth_mib(torch.device("cpu")) == 4 * 480
    monkeypatch.setattr(ceilings, "all_last_level_caches_bytes", lambda device: 32 * 2**20)
    assert ceilings.bandwidth_mib(torch.device("cpu")) == 128
    monkeypatch.setattr(ceilings, "all_last_level_caches_bytes", lambda device: 2 * 2**20)
    assert ceilings.bandwidth_mib(torch.device("cpu")) == 64  # the floor
    monkeypatch.setattr(ceilings, "all_last_level_caches_bytes", lambda device: None)
    assert ceilings.bandwidth_mib(torch.device("cpu")) == 256  # caches unknown
    monkeypatch.setattr(ceilings, "all_last_level_caches_bytes", lambda device: 50 * 2**20)  # an H100's L2
    assert ceilings.bandwidth_mib(torch.device("cuda")) == 4096
    monkeypatch.setattr(ceilings, "all_last_level_caches_bytes", lambda device: 8 * 2**30)
    assert ceilings.bandwidth_mib(torch.device("cpu")) == ceilings.MAX_MIB


def test_a_cpu_sweep_makes_its_bandwidth_buffers_once_and_a_gpu_s_visits_make_their_own():
    """A CPU's fresh buffer is new pages faulted in one by one: both bandwidth figures share one pair for the
    sweep. Elsewhere (the meta device stands in for a GPU: no memory behind it) each visit makes its own."""
    def visits(device: str) -> list[dict]:
        copy, read = ceilings.bandwidth_figures(torch.device(device), 1)
        return [copy.build()[1], copy.build()[1], read.build()[1]]

    first, second, third = visits("cpu")
    assert first["source"] is second["source"] is third["source"] and first["target"] is second["target"]
    assert first["source"] is not first["target"] and first["source"].numel() == 2**20 // 4
    assert bool((first["source"] == 1).all())  # filled: a read of untouched pages would read the zero page
    first, second, third = visits("meta")
    assert len({id(first["source"]), id(second["source"]), id(third["source"])}) == 3
    assert first["target"] is not second["target"]

def test_a_gpu_sweep_runs_every_dtype_its_capability_allows(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert ceilings.available_dtypes(torch.device("cuda")) == ("fp32", "tf32", "bf16", "fp16", "fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert ceilings.available_dtypes(torch.device("cuda")) == ("fp32", "tf32", "bf16", "fp16")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert ceilings.available_dtypes(torch.device("cuda")) == ("fp32", "bf16", "fp16")


def test_the_gpu_shapes_hold_each_published_hopper_best_shape():
    """ml-engineering's best shapes for H100 and H200, as its table prints them (M x N x K), are in the GPU sweep."""
    table = ceilings.published()
    hopper = table[table["accelerator"].isin(["NVIDIA H100 SXM", "NVIDIA H200 SXM"])]
    shapes = {tuple(map(int, shape.split("x"))) for shape in hopper["best_shape"]}
    assert shapes == {(2048, 2048, 13312), (1024, 9216, 14336), (1280, 4096, 12032)}
    assert shapes <= set(ceilings.MATMUL_SHAPES["cuda"])


def kept_table(device_name):
    """A kept ceilings table whose best fp32 matmul is not its largest square one."""
    rows = [("matmul", "fp32", "1024x1024x1024", 0.05), ("matmul", "fp32", "256x1024x1024", 0.08),
            ("matmul", "bf16", "512x512x512", 0.2), ("copy", "fp32", "256 MiB", 9.0), ("read", "fp32", "256 MiB", 12.0),
            ("launch", "fp32", "eager: one 1-element add", 4.0)]
    return pd.DataFrame([{"ceiling": c, "dtype": d, "detail": s, "value": v, "ci_low": v, "ci_high": v, "unit": "u",
                          "blocks": 6, "runs_per_block": 1, "device": device_name, "rounds": 6, "sweep_s": 9.0,
                          "load_warning": ""} for c, d, s, v in rows])


def test_mfu_and_the_roofline_read_one_measured_ceiling(tmp_path, monkeypatch):
    """A device without a datasheet peak (a CPU) divides MFU by the kept MAMF, the best over the sweep's shapes: the
    figure the summary's roofline reads from the same file, not a fixed shape's rate."""
    info = resolve_device("cpu")
    monkeypatch.setattr(store, "LIVE_DIR", tmp_path)
    ceilings.save(kept_table(info.name))
    monkeypatch.setattr(ceilings, "measure", lambda *a, **k: pytest.fail("measured again though kept"))
    peak = peaks.measured_peak(info, "fp32")
    roofs = ceilings.Roofs.from_table(ceilings.load())
    assert peak.tflops == 0.08 == roofs.flops_per_s["fp32"] / 1e12
    assert peak.source.startswith("measured MAMF") and "256x1024x1024" in peak.source


def test_another_machine_s_ceilings_are_measured_again_and_kept(tmp_path, monkeypatch):
    info = resolve_device("cpu")
    monkeypatch.setattr(store, "LIVE_DIR", tmp_path)
    ceilings.save(kept_table("another machine"))
    monkeypatch.setattr(ceilings, "measure", lambda device: kept_table(info.name).assign(value=0.5))
    assert ceilings.mamf(info, "bf16")[0] == 0.5
    assert ceilings.load()["device"].eq(info.name).all()
    with pytest.raises(OptlabError, match="choose one of: fp32, tf32, bf16, fp16, fp8"):
        ceilings.mamf(info, "int8")


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
    assert "MAMF fp32" in printed and "copy" in printed and "launch" in printed and "in 6 rounds" in printed
    table = ceilings.load(tmp_path)
    assert table is not None and set(table["ceiling"]) == {"matmul", "copy", "read", "launch"}
    assert (table["value"] > 0).all() and (table["ci_low"] <= table["value"]).all()
    assert (table["value"] <= table["ci_high"]).all() and (table["runs_per_block"] >= 1).all()
    assert table[["value", "ci_low", "ci_high"]].map(math.isfinite).all().all()


def test_published_ceilings_are_linked_and_below_their_datasheet():
    table = ceilings.published()
    assert table["url"].str.startswith("https://github.com/stas00/ml-engineering/").all()
    assert {"NVIDIA A100 SXM", "NVIDIA H100 SXM", "NVIDIA H200 SXM"} <= set(table["accelerator"])
    assert (table["% of datasheet"] < 100).all() and (table["% of datasheet"] > 40).all()
    h100 = table.set_index(["accelerator", "dtype"]).loc[("NVIDIA H100 SXM", "bf16")]
    assert h100["% of datasheet"] == pytest.approx(80.3, abs=0.05)  # the table's own efficiency column
    assert all(len(shape.split("x")) == 3 for shape in table["best_shape"])
