import pytest

from optlab.core.knobs.config import KNOB_NAMES, RunConfig, apply_changes, changed_knobs
from optlab.core.errors import OptlabError


def test_defaults_are_the_seed_base_config():
    config = RunConfig()
    assert (config.batch_size, config.num_workers, config.pin_memory) == (128, 4, True)
    assert config.images_per_step == 128


@pytest.mark.parametrize("changes, message", [
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
    ({"accumulation_steps": 0}, "accumulation_steps must be an integer >= 1"),
    ({"amp_dtype": "fp8"}, "unknown AMP dtype 'fp8'; choose one of: none, fp16, bf16"),
    ({"model": "vgg16"}, "unknown model 'vgg16'; choose one of: resnet18, resnet50, resnet101, mobilenet_v2"),
    ({"eval_grad_mode": "off"}, "unknown eval grad mode 'off'"),
    ({"model_variant": "wide"}, "unknown model variant 'wide'"),
    ({"num_workers": 0, "prefetch_factor": 2}, "prefetch_factor needs num_workers > 0"),
    ({"num_workers": 0, "persistent_workers": True}, "persistent_workers=True needs num_workers > 0"),
    ({"width": 0}, "width must be a number in (0, 4]"),
    ({"batch_size": 2.5}, "batch_size must be an integer"),
    ({"batch_size": True}, "batch_size must be an integer"),
])
def test_bad_knobs_get_clear_errors(changes, message):
    with pytest.raises(OptlabError) as error:
        RunConfig(**changes)
    assert message in str(error.value)


def test_variant_differs_by_exactly_the_named_knobs():
    base = RunConfig()
    variant = apply_changes(base, {"amp_dtype": "fp16", "channels_last": True})
    assert changed_knobs(base, variant) == {"amp_dtype": ("none", "fp16"), "channels_last": (False, True)}
    assert changed_knobs(base, base) == {}


def test_unknown_knob_lists_the_knobs():
    with pytest.raises(OptlabError, match="unknown knob"):
        apply_changes(RunConfig(), {"turbo": True})
    assert "amp_dtype" in KNOB_NAMES


def test_batch_offset_adds_images():
    assert RunConfig(batch_size=128, batch_offset=1).images_per_step == 129
