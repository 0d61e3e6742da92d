"""The serving chapters' briefly trained GPTs: trained once, cached by size, steps, seed, corpus and torch version,
loaded on the next call; the validation loss they are judged by."""
import math

import pytest
import torch

from optlab.core.errors import OptlabError
from optlab.core.gpt.transformer import GPT
from optlab.studies.serving import trained


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_second_call_loads_the_cached_weights_without_training(tmp_path, monkeypatch):
    first = trained.trained_gpt("gpt_draft", 2, "cpu", seed=0, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.pt"))
    assert len(files) == 1 and "gpt_draft-2steps-seed0" in files[0].name
    assert torch.__version__.split("+")[0] in files[0].name

    def no_training(*args, **kwargs):
        raise AssertionError("a cached model was trained again")

    monkeypatch.setattr(trained, "train_gpt", no_training)
    again = trained.trained_gpt("gpt_draft", 2, "cpu", seed=0, cache_dir=tmp_path)
    assert isinstance(again, GPT) and not again.training
    assert same_weights(first, again)


def test_the_seed_and_the_steps_are_part_of_the_key(tmp_path):
    base = trained.trained_gpt("gpt_draft", 2, "cpu", seed=0, cache_dir=tmp_path)
    other_seed = trained.trained_gpt("gpt_draft", 2, "cpu", seed=1, cache_dir=tmp_path)
    more_steps = trained.trained_gpt("gpt_draft", 3, "cpu", seed=0, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 3
    assert not same_weights(base, other_seed) and not same_weights(base, more_steps)


def test_training_lowers_the_validation_loss(tmp_path):
    untrained = GPT(trained.serving_config("gpt_draft")).eval()
    model = trained.trained_gpt("gpt_draft", 40, "cpu", cache_dir=tmp_path)
    before = trained.validation_loss(untrained, "cpu", batches=2)
    after = trained.validation_loss(model, "cpu", batches=2)
    assert math.isclose(before, math.log(65), rel_tol=0.05)  # an untrained head: about uniform over the alphabet
    assert after < before - 0.6


@pytest.mark.parametrize("call, message", [
    (lambda: trained.trained_gpt("gpt_huge", 1, "cpu"), "unknown serving GPT size 'gpt_huge'; choose one of: gpt_"),
    (lambda: trained.trained_gpt("gpt_draft", 0, "cpu"), "steps must be at least 1"),
    (lambda: trained.trained_gpt("gpt_draft", 10**6, "cpu"), "at most 100000"),
    (lambda: trained.trained_gpt("gpt_draft", 1, "cpu", seed=-1), "seed must be at least 0"),
    (lambda: trained.validation_loss(GPT(trained.serving_config("gpt_draft")), "cpu", batches=0),
     "batches must be at least 1"),
])
def test_bad_input_is_one_line_naming_what_is_allowed(call, message):
    with pytest.raises(OptlabError, match=message.replace("(", r"\(")) as error:
        call()
    assert "\n" not in str(error.value)
