from dataclasses import replace

import pytest
import torch

from optlab.core.run import experiments
from optlab.core.measuring import flops
from optlab.core.stats import sequential
from optlab.core.knobs.config import RunConfig
from optlab.core.errors import OptlabError
from optlab.core.measuring.flops import forward_flops_per_image, step_flops
from optlab.core.cifar.models import MODEL_NAMES, build_model, conv_and_linear_widths, count_parameters, example_input
from optlab.core.techniques.registry import Experiment
from tests.helpers import TINY


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_maps_cifar_images_to_ten_classes(name):
    model = build_model(name, width=0.125).eval()
    with torch.no_grad():
        assert model(example_input(2)).shape == (2, 10)


@pytest.mark.parametrize("name, gmacs, mparams", [("resnet18", 0.555, 11.17), ("resnet50", 1.298, 23.52),
                                                  ("resnet101", 2.510, 42.51)])
def test_cifar_resnets_match_the_published_sizes(name, gmacs, mparams):
    # 3x3 stem and no max-pool: the published CIFAR ResNet MACs and parameter counts
    assert forward_flops_per_image(name) / 2e9 == pytest.approx(gmacs, rel=0.01)
    with torch.device("meta"):
        assert count_parameters(build_model(name)) / 1e6 == pytest.approx(mparams, rel=0.01)


def test_mobilenet_v2_keeps_32x32_in_its_stem_and_ends_at_4x4():
    model = build_model("mobilenet_v2", width=0.25).eval()
    with torch.no_grad():
        assert model.features[0](example_input(1)).shape[-1] == 32
        assert model.features(example_input(1)).shape[-1] == 4


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_rec_variant_is_one_channel_narrower_everywhere(name):
    base, rec = build_model(name, width=0.25), build_model(name, "rec", width=0.25)
    base_widths, rec_widths = conv_and_linear_widths(base), conv_and_linear_widths(rec)
    assert rec_widths[:-1] == [w - 1 for w in base_widths[:-1]]
    assert rec_widths[-1] == base_widths[-1] == 10  # the classifier keeps ten classes
    with torch.no_grad():
        assert rec.eval()(example_input(2)).shape == (2, 10)


def test_width_scales_channels():
    widths = conv_and_linear_widths(build_model("resnet18", width=0.25))
    assert widths[0] == 16 and max(widths[:-1]) == 128


def test_unknown_model_lists_valid_names():
    with pytest.raises(OptlabError, match="unknown model 'resnet7'; choose one of: resnet18, resnet50"):
        build_model("resnet7")


def test_training_flops_are_three_forwards_per_image():
    forward = forward_flops_per_image("resnet18", "base", 0.125)
    assert step_flops("resnet18", "base", 0.125, samples=4, train=True) == 12 * forward
    assert step_flops("resnet18", "base", 0.125, samples=4, train=False) == 4 * forward


def test_configs_that_differ_only_in_how_they_run_a_model_share_one_flop_count():
    flops._shape_flop_counts.cache_clear()
    base = RunConfig(model="resnet18", width=0.125)
    counts = {flops.forward_flops_of(replace(base, **changes))
              for changes in ({}, {"amp_dtype": "bf16"}, {"channels_last": True}, {"batch_size": 8},
                              {"optimizer": "adam"})}
    assert len(counts) == 1 and flops._shape_flop_counts.cache_info().misses == 1
    assert flops.forward_flops_of(replace(base, width=0.25)) > counts.pop()  # another shape is counted again
    assert flops._shape_flop_counts.cache_info().misses == 2


def test_a_run_counts_its_flops_before_its_time_budget_starts(monkeypatch):
    events = []
    counted, started = experiments.forward_flops_of, sequential.StoppingRule.start
    monkeypatch.setattr(experiments, "forward_flops_of", lambda config: events.append("count") or counted(config))
    monkeypatch.setattr(sequential.StoppingRule, "start", lambda rule: events.append("start") or started(rule))
    experiment = Experiment("flops_first", "", "", (("fp32", {}), ("bf16", {"amp_dtype": "bf16"})), phases=("test",))
    experiments.run_experiment(experiment, profile=TINY, device="cpu", progress=False)
    assert events == ["count", "count", "start"]
