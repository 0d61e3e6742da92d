"""What the first GPU run depends on, checked on the CPU: layouts, per-phase memory, isolation of cudnn_benchmark,
records that survive a NaN loss, the commit from the environment, the device index, and the Triton check."""
import json
import math
import os
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from optlab.commands.cli import main
from optlab.core.machine import compiler, device, environment
from optlab.core.run import experiments
from optlab.core.measuring import loops, memory
from optlab.core.results import store
from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import DeviceInfo, effective_config, resolve_device
from optlab.core.cifar.device_data import DeviceResidentLoader, augment
from optlab.core.cifar.models import build_model
from optlab.core.errors import OptlabError
from optlab.core.techniques.registry import Experiment, get_experiment
from optlab.core.techniques.cnn import LAUNCH_BOUND_MODELS, compile_with_max_autotune
from optlab.studies import learning
from tests.helpers import TINY

CPU = torch.device("cpu")
FAKE_CUDA = DeviceInfo(torch.device("cuda", 0), "fake GPU", ("none", "fp16", "bf16"))


def _tiny_dataset(count=32):
    generator = np.random.default_rng(0)
    return SimpleNamespace(data=generator.integers(0, 255, (count, 32, 32, 3), dtype=np.uint8),
                           targets=generator.integers(0, 10, count).tolist())


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_device_resident_batches_take_the_configs_layout(channels_last, train):
    """The batched augmentation returns NHWC strides; the batch a step sees must still be what the config says."""
    loader = DeviceResidentLoader(_tiny_dataset(), 8, CPU, train=train)
    inputs, targets = loops.to_device(next(iter(loader)), RunConfig(channels_last=channels_last), CPU)
    n, c, h, w = inputs.shape
    expected = (h * w * c, 1, w * c, c) if channels_last else (c * h * w, h * w, w, 1)
    assert inputs.stride() == expected and targets.shape == (n,)


def test_augmentation_alone_comes_out_channels_last_strided():
    """Why to_device must set the layout both ways: the gather over NHWC leaves NHWC strides behind."""
    augmented = augment(torch.randn(4, 3, 32, 32), torch.Generator().manual_seed(0))
    assert not augmented.is_contiguous()
    assert loops.to_device((augmented, torch.zeros(4)), RunConfig(), CPU)[0].is_contiguous()


def test_resident_memory_counts_each_storage_once():
    model = torch.nn.Linear(100, 10)  # 1010 parameters, 4 bytes each
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 100)).sum().backward()
    optimizer.step()  # gradients and momentum: two more copies of the parameters
    loader = SimpleNamespace(images=torch.zeros(256), labels=torch.zeros(256, dtype=torch.int64), name="x")
    params = 1010 * 4 / 2**20
    assert memory.resident_mb([model], CPU) == pytest.approx(2 * params)
    assert memory.resident_mb([model, optimizer, loader, model.weight], CPU) == pytest.approx(
        3 * params + (256 * 4 + 256 * 8) / 2**20)
    assert memory.resident_mb([model], torch.device("cuda")) == 0  # only the measured device's tensors


def test_cuda_peak_is_the_variants_own_tensors_plus_the_phases_increase(monkeypatch):
    """Another variant's 5 GiB, allocated before the phase began, must not show in this phase's peak."""
    allocator = {"allocated": 5 * 2**30, "peak": 9 * 2**30}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: allocator.update(peak=allocator["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocator["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"])
    cuda = torch.device("cuda")
    start = memory.phase_start(cuda)
    assert start == 5 * 2**30 and allocator["peak"] == start
    allocator["peak"] = start + 300 * 2**20  # the phase's activations
    assert memory.phase_peak_mb(cuda, start, resident=40.0) == pytest.approx(340.0)
    assert "phase" in memory.memory_kind(cuda) and "profiler" in memory.memory_kind(CPU)


def _mib(tensors):
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def test_each_variants_resident_memory_is_its_own():
    """SGD keeps one momentum per parameter, Adam two moments: run side by side, each records its own."""
    experiment = Experiment("memory", "SGD against Adam", "", phases=("train",),
                            variants=(("sgd", {}), ("adam", {"optimizer": "adam"})))
    result = experiments.run_experiment(experiment, profile=TINY, device="cpu", progress=False)
    later = result.samples[result.samples["repeat"] > 0].groupby("variant")["resident_mem_mb"].agg(["min", "max"])
    model = build_model("resnet18", width=TINY.width)
    weights, trainable = _mib([*model.parameters(), *model.buffers()]), _mib(model.parameters())
    assert later.loc["sgd", "min"] == later.loc["sgd", "max"] == pytest.approx(weights + trainable, rel=1e-6)
    assert later.loc["adam", "min"] == pytest.approx(weights + 2 * trainable, rel=1e-3)  # + Adam's step counters


def test_a_nan_loss_is_written_and_read_back(monkeypatch, tmp_path):
    real = loops.train_step

    def nan_loss(*args):
        return real(*args) * float("nan")

    monkeypatch.setattr(loops, "train_step", nan_loss)
    experiment = Experiment("nan", "a loss that blew up", "", phases=("train",), variants=(("A", {}), ("B", {})))
    result = experiments.run_experiment(experiment, profile=TINY, device="cpu", progress=False, out=tmp_path,
                                        filename="nan.json")
    assert all(math.isnan(v) for v in result.samples["losses"].iloc[0])
    stored = store.load_samples(tmp_path / "nan.json")
    assert stored["losses"].iloc[0] == [None] * TINY.steps and stored["loss_last"].isna().all()
    text = (tmp_path / "nan.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_records_are_cleaned_inside_lists_and_dicts(tmp_path):
    record = {"schema_version": store.SCHEMA_VERSION, "technique": "x",
              "nested": {"a": [1.0, float("inf"), np.float32(2.5), [float("-inf"), np.nan]], "b": np.arange(2)}}
    path = store.save_record(record, tmp_path, "x.json")
    assert store.load_record(path)["nested"] == {"a": [1.0, None, 2.5, [None, None]], "b": [0, 1]}


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
def test_cudnn_benchmark_runs_each_variant_in_a_fresh_process_of_its_own():
    """Two copies of one configuration (on the CPU the flag does nothing, so its variant is not timed there): the
    isolated run must compute exactly what the in-process run computes; what differs is where: one new process per
    variant, the same one for all its repeats, never this one."""
    copies = get_experiment("cudnn_benchmark").with_variants(("first copy", {}), ("second copy", {}))
    assert copies.isolate_variants
    profile = TINY.with_sizes(repeats=2, max_repeats=2)  # two repeats: each variant's process must serve both
    isolated = experiments.run_experiment(copies, profile=profile, device="cpu", progress=False)
    local = experiments.run_experiment(replace(copies, isolate_variants=False), profile=profile, device="cpu",
                                       progress=False)
    pids = isolated.samples.groupby("variant")["pid"].agg(set)
    assert all(len(p) == 1 for p in pids) and len(set.union(*pids)) == 2 and os.getpid() not in set.union(*pids)
    assert set(local.samples["pid"]) == {os.getpid()}
    key = ["variant", "repeat", "phase"]
    pairs = isolated.samples.set_index(key)["losses"].align(local.samples.set_index(key)["losses"])
    assert pairs[0].tolist() == pairs[1].tolist()
    assert (isolated.samples["status"] == "ok").all()


def test_git_commit_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("OPTLAB_GIT_COMMIT", "0123abcd" * 5)
    assert environment.git_commit() == "0123abcd" * 5
    assert environment.capture(resolve_device("cpu"), "stand-in", "tiny")["git_commit"] == "0123abcd" * 5
    with pytest.raises(SystemExit):
        main(["reference", "--help"])
    assert "OPTLAB_GIT_COMMIT" in capsys.readouterr().out


def test_cuda_n_becomes_the_current_device(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"GPU {index}")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    info = device.resolve_device("cuda:1")
    assert chosen == [1] and info.device == torch.device("cuda", 1) and info.name == "GPU 1"
    assert device.resolve_device("cuda").device == torch.device("cuda", 0) and chosen == [1, 0]


def test_prefetching_falls_back_on_the_cpu_with_a_note():
    config, notes = effective_config(RunConfig(prefetch_to_device=True, non_blocking=True), resolve_device("cpu"))
    assert not config.prefetch_to_device and any(n.startswith("prefetch_to_device: skipped on cpu") for n in notes)
    assert effective_config(RunConfig(prefetch_to_device=True), FAKE_CUDA)[0].prefetch_to_device


@pytest.fixture
def fresh_triton_check():
    compiler.triton_problem.cache_clear()
    yield
    compiler.triton_problem.cache_clear()


def test_triton_check_names_what_is_missing(monkeypatch, fresh_triton_check, tmp_path):
    monkeypatch.setattr(compiler.importlib.util, "find_spec", lambda name: object())  # as if triton were installed
    monkeypatch.setenv("CC", "false")
    assert "cannot compile a file that includes Python.h" in compiler.triton_problem()
    compiler.triton_problem.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert "could not be run" in compiler.triton_problem()
    compiler.triton_problem.cache_clear()
    monkeypatch.setattr(compiler, "python_include_dir", lambda: str(tmp_path))
    assert "Python.h is not in" in compiler.triton_problem()
    compile_config = RunConfig(compile_mode="default")
    with pytest.raises(OptlabError, match="on CUDA needs Triton .* Python.h is not in"):
        compiler.require_compiler([compile_config], FAKE_CUDA)
    compiler.require_compiler([RunConfig()], FAKE_CUDA)  # nothing compiles: nothing to check


def test_triton_check_passes_with_a_compiler_and_headers(monkeypatch, fresh_triton_check):
    if not (compiler.shutil.which("gcc") or compiler.shutil.which("clang")):
        pytest.skip("no C compiler here")
    monkeypatch.setattr(compiler.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("CC", raising=False)
    assert compiler.triton_problem() is None


def test_cache_state_words():
    assert [compiler.cache_state(h, m) for h, m in ((0, 3), (2, 0), (1, 1), (0, 0))] == [
        "cold", "warm", "mixed", "no cache lookups"]


def test_the_learning_checks_training_time_leaves_compilation_out(monkeypatch):
    """A step during which a graph was compiled counts as compile time, every other step as training time, and
    nothing between steps (evaluation) counts: steps 1 and 3 compile here, and a fake clock gives each step a
    duration that says which sum it went to."""
    graphs = iter([0, 1, 1, 1, 1, 2, 2, 2])  # read before and after each of the 4 steps
    clock = iter([0.0, 1.0, 50.0, 52.0, 100.0, 104.0, 200.0, 208.0])  # steps of 1, 2, 4 and 8 s, gaps between
    monkeypatch.setattr(compiler, "compiled_graphs", lambda: next(graphs))
    monkeypatch.setattr(learning, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    config = RunConfig(batch_size=8, width=TINY.width, num_workers=0, pin_memory=False)
    curves = learning.learning_curves({"A": config}, resolve_device("cpu"), steps=4, eval_every=2, eval_images=8,
                                      progress=False)
    assert curves[["step", "compile_s", "train_s"]].values.tolist() == [[2, 1.0, 2.0], [4, 5.0, 10.0]]
    assert next(graphs, None) is None and next(clock, None) is None  # one reading of each before and after a step


def test_multiple_of_8_separates_channels_and_batch_in_fp32_and_fp16():
    experiment = get_experiment("multiple_of_8")
    full = experiment.configs("resnet18", TINY)
    assert list(full)[:2] == ["base model", "rec model (channels-1 batch+1)"]
    changes = {label: (c.model_variant, c.batch_offset, c.amp_dtype) for label, c in full.items()}
    assert changes == {"base model": ("base", 0, "none"), "rec model (channels-1 batch+1)": ("rec", 1, "none"),
                       "channels-1": ("rec", 0, "none"), "batch+1": ("base", 1, "none"),
                       "base model, fp16": ("base", 0, "fp16"), "channels-1, fp16": ("rec", 0, "fp16"),
                       "batch+1, fp16": ("base", 1, "fp16")}
    assert list(experiment.configs("resnet101", TINY)) == list(full)[:2]  # the seed's pair on every model


def test_compiling_techniques_read_data_on_the_device_and_skip_max_autotune():
    for name in ("compile", "cuda_graphs"):
        configs = get_experiment(name).configs("resnet18", TINY).values()
        assert all(c.data_on_device and c.num_workers == 0 for c in configs)
        assert "max-autotune" not in {c.compile_mode for c in configs}
    assert "max-autotune" in {c.compile_mode for c in compile_with_max_autotune().configs("resnet18", TINY).values()}
    stack = get_experiment("all_together")
    assert "+ torch.compile" in stack.configs(LAUNCH_BOUND_MODELS[0], TINY)
    assert "+ torch.compile" not in stack.configs("resnet50", TINY)


def test_fp16_with_a_fused_optimizer_trains_under_the_scaler():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10))
    config = RunConfig(amp_dtype="fp16", optimizer_impl="fused", num_workers=0, pin_memory=False)
    assert ("fp16 autocast, fused SGD", {"amp_dtype": "fp16", "optimizer_impl": "fused"}) in \
        get_experiment("precision").variants
    before = [p.detach().clone() for p in model.parameters()]
    optimizer, scaler = loops.make_optimizer(model, config), loops.make_scaler(config, CPU)
    loss = loops.train_step(model, (torch.randn(4, 3, 8, 8), torch.arange(4)), optimizer, scaler, config, CPU, 0)
    assert torch.isfinite(loss) and optimizer.defaults["fused"]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
