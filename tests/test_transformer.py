"""The GPT: its size, causality, every attention path against the hand-written one, checkpointing's numbers and
memory, the FLOP count with attention, and a loss that falls on the corpus."""
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from optlab.core.errors import OptlabError
from optlab.core.gpt.text_data import random_batch, text_datasets
from optlab.core.gpt.transformer import (
    ATTENTIONS, CHECKPOINTINGS, GPT, GPT_SIZES, GPTConfig, attention_support, forward_flops,
    parameter_count,
)

TINY = GPT_SIZES["gpt_tiny"]
# float32 on a CPU: the kernels sum in different orders, so logits agree to about 1e-6; gradients to about 1e-5
FORWARD_ATOL, GRADIENT_RTOL = 1e-5, 1e-4


def tokens(n=4, t=32, seed=0):
    return torch.randint(0, TINY.vocab_size, (n, t), generator=torch.Generator().manual_seed(seed))


def twin(attention="manual", checkpointing="none", seed=0):
    torch.manual_seed(seed)
    return GPT(TINY, attention, checkpointing)


def loss_of(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_gpt2_small_has_124m_parameters_with_its_head_tied():
    with torch.device("meta"):
        model = GPT(GPT_SIZES["gpt2_small"])
    assert 124_000_000 < parameter_count(model) < 124_600_000
    assert model.head.weight is model.token_embedding.weight
    assert len(model.blocks) == 12 and isinstance(model.blocks, torch.nn.ModuleList)


def test_logits_have_the_shape_n_t_vocab_and_no_token_sees_a_later_one():
    model = twin("manual").eval()
    idx = tokens()
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert before.shape == (4, 32, TINY.vocab_size)
    torch.testing.assert_close(before[:, :20], after[:, :20], atol=0, rtol=0)
    assert (before[:, 20:] - after[:, 20:]).abs().amax() > 1e-3


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention", [a for a in ATTENTIONS if a != "manual"])
def test_every_attention_path_that_runs_here_agrees_with_the_hand_written_one(attention, device):
    if reason := attention_support(attention, device, backward=False):
        pytest.skip(reason)
    idx = tokens().to(device)
    reference, other = twin("manual").to(device), twin(attention).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention without torch.compile warns that it is slow
        trains = attention_support(attention, device) is None
        with torch.set_grad_enabled(trains):
            torch.testing.assert_close(other(idx), reference(idx), atol=FORWARD_ATOL, rtol=0)
    if trains:
        loss_of(reference, idx).backward()
        loss_of(other, idx).backward()
        for name, grad in gradients(reference).items():
            torch.testing.assert_close(gradients(other)[name], grad, rtol=GRADIENT_RTOL, atol=1e-6, msg=name)


def test_attention_support_says_in_one_line_why_a_path_does_not_run_on_a_cpu():
    assert attention_support("manual", "cpu") is None and attention_support("sdpa_flash", "cpu") is None
    for backend in ("sdpa_efficient", "sdpa_cudnn"):
        reason = attention_support(backend, "cpu")
        assert "No viable backend" in reason and "\n" not in reason
    assert attention_support("flex", "cpu", backward=False) is None  # the forward runs (slowly, eager)
    assert "backward" in attention_support("flex", "cpu")  # training does not


def test_bad_knobs_are_refused_naming_what_is_allowed():
    with pytest.raises(OptlabError, match="unknown attention 'fast'; choose one of: manual, sdpa, sdpa_math"):
        GPT(TINY, attention="fast")
    with pytest.raises(OptlabError, match="choose one of: none, full, selective"):
        GPT(TINY, checkpointing="some")
    with pytest.raises(OptlabError, match="n_layer must be a whole number from 1 to 96"):
        GPTConfig(n_layer=1000)
    with pytest.raises(OptlabError, match="multiple of n_head"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(OptlabError, match="longer than this GPT's block_size 64"):
        twin()(tokens(t=65))


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_checkpointing_gives_the_same_loss_and_gradients(checkpointing):
    idx = tokens()
    plain, checkpointed = twin("sdpa"), twin("sdpa", checkpointing)
    loss, same = loss_of(plain, idx), loss_of(checkpointed, idx)
    loss.backward()
    same.backward()
    assert same.item() == pytest.approx(loss.item(), abs=1e-6)
    for name, grad in gradients(plain).items():
        torch.testing.assert_close(gradients(checkpointed)[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def peak_training_mib(model, idx, path):
    """Peak MiB of CPU tensors over one forward and backward: torch.profiler's memory timeline (every tensor's
    allocation and free, parameters included), summed over its categories at each instant, maximum over time."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        loss_of(model, idx).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA snapshots; the CPU has no other timeline
        prof.export_memory_timeline(str(path), device="cpu")
    times, sizes = json.loads(path.read_text())
    return max(map(sum, sizes)) / 2**20


def test_checkpointing_lowers_the_measured_peak_memory(tmp_path):
    idx = tokens(n=8, t=64)
    peaks = {mode: peak_training_mib(twin("sdpa", mode), idx, tmp_path / f"{mode}.json") for mode in CHECKPOINTINGS}
    # measured here: none 5.1, selective 4.6, full 3.3 MiB (parameters and gradients, 0.8 MiB, included)
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
    assert peaks["none"] - peaks["selective"] > 0.05 * peaks["none"], peaks
    assert peaks["none"] - peaks["full"] > 0.2 * peaks["none"], peaks


def test_the_flop_count_includes_attention_quadratic_in_the_sequence():
    batch, short, long = 2, 32, 64
    per_square_token = 4 * TINY.n_layer * TINY.n_embd  # QK^T and AV per layer: 2 matmuls x 2 FLOPs x T^2 x C
    grown = forward_flops(TINY, batch, long) - 2 * forward_flops(TINY, batch, short)  # the linear parts cancel
    assert grown == batch * per_square_token * (long**2 - 2 * short**2)
    assert forward_flops(GPT_SIZES["gpt2_small"], 1, 1024) > 2 * 124e6 * 1024  # 2 FLOPs per parameter per token, +


def test_the_loss_of_gpt_tiny_falls_below_the_character_frequencies_on_a_small_token_budget():
    train, _, _ = text_datasets(TINY.block_size)
    counts = torch.bincount(train.tokens, minlength=TINY.vocab_size).float()
    frequencies = counts[counts > 0] / counts.sum()
    unigram_entropy = -(frequencies * frequencies.log()).sum().item()  # the loss of a model that ignores context
    torch.manual_seed(0)
    model, generator = GPT(TINY), torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # 1e-2 hovers near the unigram level on real text
    losses = []
    for _ in range(90):  # 90 steps x 8 x 64 = 46,080 tokens
        x, y = random_batch(train, 8, generator)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 4.0  # log(65) = 4.17 at the start
    assert sum(losses[-5:]) / 5 < unigram_entropy - 0.1, (losses[-5:], unigram_entropy)
