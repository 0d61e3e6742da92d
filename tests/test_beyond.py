"""The knobs beyond the seed: optimizers, TF32 switches, compile, data resident on the device."""
import pytest
import torch
from torch import nn

from optlab.core.knobs.config import RunConfig
from optlab.core.cifar.data import StandInCIFAR10
from optlab.core.machine.device import effective_config, resolve_device
from optlab.core.cifar.device_data import DeviceResidentLoader, augment
from optlab.core.errors import OptlabError
from optlab.core.techniques.registry import get_experiment
from optlab.core.run.experiments import run_experiment
from optlab.core.measuring.loops import backend_flags, make_optimizer
from optlab.core.techniques.cnn import BEYOND_TECHNIQUES
from tests.helpers import TINY


@pytest.mark.parametrize("impl, flag, value", [("for_loop", "foreach", False), ("foreach", "foreach", True),
                                               ("fused", "fused", True)])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_optimizer_implementations(name, impl, flag, value):
    optimizer = make_optimizer(nn.Linear(2, 2), RunConfig(optimizer=name, optimizer_impl=impl))
    assert type(optimizer).__name__.lower() == name and optimizer.defaults[flag] is value


def test_unknown_optimizer_and_compile_mode():
    with pytest.raises(OptlabError, match="unknown optimizer 'lamb'; choose one of: sgd, adam"):
        RunConfig(optimizer="lamb")
    with pytest.raises(OptlabError, match="unknown compile mode 'fast'"):
        RunConfig(compile_mode="fast")


def test_backend_flags_are_set_for_a_phase_and_restored():
    before = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with backend_flags(RunConfig(cudnn_benchmark=not before[0], matmul_tf32=not before[1], cudnn_tf32=not before[2])):
        assert torch.backends.cuda.matmul.allow_tf32 is (not before[1])
        assert torch.backends.cudnn.allow_tf32 is (not before[2])
    assert (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32) == before


def test_tf32_is_skipped_on_cpu():
    effective, notes = effective_config(RunConfig(matmul_tf32=True), resolve_device("cpu"))
    assert not effective.matmul_tf32 and any(n.startswith("matmul_tf32/cudnn_tf32: skipped") for n in notes)


def test_device_augmentation_is_a_padded_crop_or_its_mirror():
    images = torch.rand(6, 3, 32, 32)
    out = augment(images, torch.Generator().manual_seed(0))
    padded = nn.functional.pad(images, (4, 4, 4, 4))
    for image, result in zip(padded, out):
        windows = [image[:, y:y + 32, x:x + 32] for y in range(9) for x in range(9)]
        assert any(torch.equal(result, w) or torch.equal(result, w.flip(2)) for w in windows)


def test_device_resident_loader_yields_normalized_batches_in_a_seeded_order():
    test_set = StandInCIFAR10(False)
    loader = DeviceResidentLoader(test_set, 16, torch.device("cpu"), train=True, seed=1)
    again = DeviceResidentLoader(test_set, 16, torch.device("cpu"), train=True, seed=1)
    (images, labels), (images2, labels2) = next(iter(loader)), next(iter(again))
    assert images.shape == (16, 3, 32, 32) and images.dtype == torch.float32
    assert torch.equal(labels, labels2) and torch.equal(images, images2)
    other_seed = DeviceResidentLoader(test_set, 16, torch.device("cpu"), train=True, seed=2)
    assert not torch.equal(next(iter(other_seed))[1], labels), "another seed must give another order"
    assert not torch.equal(labels, torch.as_tensor(test_set.targets[:16])), "the training order is not shuffled"
    second_epoch = list(loader)[0][1]
    assert not torch.equal(second_epoch, labels), "each epoch draws a new order"
    assert len(loader) == 10_000 // 16 and abs(float(images.mean())) < 1.0


def test_cuda_only_technique_is_refused_on_cpu_with_a_reason(no_cuda):
    with pytest.raises(OptlabError, match="cuda_graphs needs a CUDA device"):
        run_experiment("cuda_graphs", profile=TINY, device="cpu", progress=False)


def test_beyond_techniques_are_registered():
    for name in BEYOND_TECHNIQUES:
        assert get_experiment(name).section == ""
    stack = get_experiment("all_together").configs("resnet18", TINY)
    last = list(stack.values())[-1]
    assert last.compile_mode == "default" and last.amp_dtype == "bf16" and last.data_on_device


def test_optimizer_and_device_data_variants_run():
    experiment = get_experiment("data_pipeline").with_variants(
        ("loader", {"num_workers": 0, "pin_memory": False}),
        ("data on device", {"num_workers": 0, "pin_memory": False, "data_on_device": True, "optimizer_impl": "fused"}),
    )
    result = run_experiment(experiment, profile=TINY, device="cpu", progress=False)
    assert (result.samples["status"] == "ok").all() and len(result.summary) == 4
    assert result.samples["first_step_s"].notna().all()


def test_compiling_techniques_default_to_the_launch_bound_models_of_a_profile():
    from optlab.core.knobs.profiles import get_profile

    quick, smoke = get_profile("quick"), get_profile("smoke")
    assert get_experiment("compile").default_models(quick) == ("resnet18", "mobilenet_v2")
    assert get_experiment("all_together").default_models(quick) == quick.models
    assert get_experiment("cuda_graphs").default_models(TINY) == ("resnet18",)
    assert get_experiment("compile").default_models(smoke) == smoke.models


def test_every_beyond_technique_is_in_exactly_one_reference_set():
    from optlab.commands.reference.planning import EXTRAS
    from optlab.core.techniques.cnn import technique_set

    sets = {name: set(technique_set(name)) for name in ("beyond", "compile", "stack")}
    assert sorted(t for s in sets.values() for t in s) == sorted(BEYOND_TECHNIQUES)
    assert "all_together" in sets["stack"] and "learning" in EXTRAS["stack"]
