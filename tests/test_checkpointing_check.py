"""Checkpointing trains the same model: the same losses and gradients as without it, from the same weights."""
import pytest

from optlab.core.gpt import transformer
from optlab.core.errors import OptlabError
from optlab.studies.transformer import checkpointing_check


def test_every_setting_gives_the_same_losses_and_gradients():
    table = checkpointing_check.checkpointing_agreement(batch=2, steps=2).set_index("checkpointing")
    assert list(table.index) == list(transformer.CHECKPOINTINGS) and table["agrees"].all()
    assert (table[["loss max abs diff", "gradient max abs diff"]] <= checkpointing_check.TOLERANCE).all().all()


def test_a_recomputation_that_cuts_the_gradient_is_caught(monkeypatch):
    """A broken checkpoint: the recomputed block sees its input detached, so no gradient flows to earlier layers."""
    real = transformer.checkpoint
    monkeypatch.setattr(transformer, "checkpoint", lambda block, x, **options: real(block, x.detach(), **options))
    table = checkpointing_check.checkpointing_agreement(batch=2, steps=2).set_index("checkpointing")
    assert table.loc["none", "agrees"] and not table.loc["full", "agrees"] and not table.loc["selective", "agrees"]
    assert table.loc["full", "loss, step 1"] == table.loc["none", "loss, step 1"]  # the forward alone cannot tell


@pytest.mark.parametrize("options, message", [({"steps": 0}, "steps must be a whole number from 1 to 20, got 0"),
                                              ({"batch": 1000}, "batch must be a whole number from 1 to 256"),
                                              ({"size": "gpt3"}, "unknown GPT size 'gpt3'")])
def test_bad_sizes_are_refused(options, message):
    with pytest.raises(OptlabError, match=message):
        checkpointing_check.checkpointing_agreement(**options)
