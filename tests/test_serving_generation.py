"""Generation with and without a KV cache: every variant gives the no-cache reference's tokens, the static cache keeps
its storage, masking hides what lies beyond a row's length, and bad sizes get one-line errors."""
import math

import pytest
import torch

from optlab.core.errors import OptlabError
from optlab.core.gpt.transformer import GPT, GPTConfig
from optlab.studies.serving import decoding
from optlab.studies.serving import generation as g
from optlab.studies.serving.generation import Generation


@pytest.fixture(scope="module")
def model() -> GPT:
    """Weights drawn wider than GPT-2's init, so that attention (and so the cache) moves the greedy tokens."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=50, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        for name, parameter in gpt.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3)
    return gpt


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_cached_greedy_tokens_equal_the_reference(model, prompt, cache):
    reference = g.greedy_reference(model, prompt, 20)
    result = g.generate(model, prompt, 20, cache=cache)
    assert reference.shape == (3, 29)
    assert torch.equal(result.tokens, reference)
    assert len(result.decode_s) == 19 and result.prefill_s > 0 and result.tpot_s > 0
    assert torch.equal(result.new_tokens, reference[:, 9:])


def test_sampling_is_seeded_and_equal_across_caches(model, prompt):
    runs = {cache: g.generate(model, prompt, 15, cache=cache, temperature=1.0, top_k=8, seed=4).tokens
            for cache in g.CACHES}
    assert torch.equal(runs["static"], runs["none"]) and torch.equal(runs["dynamic"], runs["none"])
    other = g.generate(model, prompt, 15, cache="static", temperature=1.0, top_k=8, seed=5).tokens
    assert not torch.equal(other, runs["none"])


@torch.no_grad()
def test_forward_cached_matches_the_full_forward(model, prompt):
    full = model(prompt)
    for cache in (g.StaticKVCache(model, 3, 20), g.DynamicKVCache(model, 3)):
        pieces = [g.forward_cached(model, prompt[:, :4], cache)] + [
            g.forward_cached(model, prompt[:, i:i + 1], cache) for i in range(4, 9)]
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
        assert cache.lengths.tolist() == [9, 9, 9]


@torch.no_grad()
def test_static_cache_keeps_its_storage(model, prompt):
    cache = g.StaticKVCache(model, 3, 30)
    pointers, nbytes = cache.data_pointers(), cache.nbytes
    g.forward_cached(model, prompt, cache)
    for _ in range(10):
        g.forward_cached(model, prompt[:, :1], cache)
    assert cache.data_pointers() == pointers and cache.nbytes == nbytes
    assert nbytes == 2 * 2 * 3 * 2 * 30 * 16 * 4  # keys and values, layers, batch, heads, max_len, head_dim, fp32


@torch.no_grad()
def test_masking_hides_positions_beyond_each_row(model, prompt):
    """Rows of different lengths in one static cache, stale keys left beyond a truncated row: the logits are the
    full forward's at each row's own positions."""
    cache = g.StaticKVCache(model, 3, 20)
    g.forward_cached(model, prompt, cache)
    for layer in range(len(cache.keys)):
        cache.keys[layer].add_(1e3)  # garbage everywhere; rows rewritten below
    cache.truncate([0, 0, 0])
    g.forward_cached(model, prompt[:, :7], cache)
    cache.truncate([7, 3, 5])  # the slots past each row's length keep stale keys
    step = torch.stack([prompt[0, 7], prompt[1, 3], prompt[2, 5]])[:, None]
    logits = g.forward_cached(model, step, cache)[:, 0]
    expected = torch.stack([model(prompt[b:b + 1, :n + 1])[0, -1] for b, n in enumerate((7, 3, 5))])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert cache.lengths.tolist() == [8, 4, 6]


@torch.no_grad()
def test_load_row_and_reset_rows(model, prompt):
    single = g.StaticKVCache(model, 1, 20)
    g.forward_cached(model, prompt[2:3, :6], single)
    batch = g.StaticKVCache(model, 2, 20)
    g.forward_cached(model, prompt[:2, :4], batch)
    batch.load_row(1, single)
    assert batch.lengths.tolist() == [4, 6]
    logits = g.forward_cached(model, torch.stack([prompt[0, 4], prompt[2, 6]])[:, None], batch)[:, 0]
    expected = torch.stack([model(prompt[0:1, :5])[0, -1], model(prompt[2:3, :7])[0, -1]])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    batch.reset_rows([0])
    assert batch.lengths.tolist() == [0, 7] and batch.longest == 7


@torch.no_grad()
def test_a_loaded_row_longer_than_the_others_moves_longest(model, prompt):
    """A row loaded into a cache whose rows are shorter raises ``longest``, the bound forward_cached checks: a stale
    one would let a step write past the cache's end."""
    single = g.StaticKVCache(model, 1, 8)
    g.forward_cached(model, prompt[:1, :7], single)
    batch = g.StaticKVCache(model, 2, 8)  # both rows empty: longest 0
    batch.load_row(0, single)
    assert batch.longest == 7
    with pytest.raises(OptlabError, match="do not fit"):
        g.forward_cached(model, prompt[:2, :2], batch)


@torch.no_grad()
def test_dynamic_cache_truncates_to_one_length(model, prompt):
    cache = g.DynamicKVCache(model, 3)
    g.forward_cached(model, prompt, cache)
    cache.truncate(5)
    logits = g.forward_cached(model, prompt[:, 5:6], cache)[:, 0]
    torch.testing.assert_close(logits, model(prompt[:, :6])[:, -1], rtol=1e-5, atol=1e-5)
    with pytest.raises(OptlabError, match="one length"):
        cache.truncate([1, 2, 3])


@pytest.mark.parametrize("call, message", [
    (lambda m, p: g.generate(m, p, 5, cache="paged"), "cache"),
    (lambda m, p: g.generate(m, p, 45), "block_size 48"),
    (lambda m, p: g.generate(m, p, 0), "new_tokens"),
    (lambda m, p: g.generate(m, p, 3, temperature=-1.0), "temperature"),
    (lambda m, p: g.generate(m, p, 3, temperature=1.0, top_k=51), "top_k"),
    (lambda m, p: g.generate(m, p, 3, cache="dynamic", compiled=True), "static"),
    (lambda m, p: g.generate(m, p.float(), 3), "LongTensor"),
    (lambda m, p: g.StaticKVCache(m, 1, 49), "max_len"),
    (lambda m, p: g.StaticKVCache(m, 0, 8), "batch"),
])
def test_bad_input_is_named(model, prompt, call, message):
    with pytest.raises(OptlabError, match=message):
        call(model, prompt)


@torch.no_grad()
def test_a_full_cache_says_so(model, prompt):
    cache = g.StaticKVCache(model, 3, 10)
    g.forward_cached(model, prompt, cache)
    with pytest.raises(OptlabError, match="do not fit"):
        g.forward_cached(model, prompt[:, :2], cache)
    with pytest.raises(OptlabError, match="truncate"):
        cache.truncate([10, 0, 0])
    with pytest.raises(OptlabError, match="one per row"):
        cache.truncate([1, 2])


@pytest.mark.cuda
def test_compiled_decoding_with_cuda_graphs_reproduces_the_reference(model, prompt):
    """On a GPU the compiled step is recorded as a CUDA graph that writes into the static cache's fixed storage:
    its tokens, on the first (recording) generation and a later (replaying) one, are the reference's."""
    gpu, tokens = GPT(model.config).cuda().eval(), prompt.cuda()
    gpu.load_state_dict(model.state_dict())
    reference = g.greedy_reference(gpu, tokens, 20)
    for _ in range(3):
        assert torch.equal(g.generate(gpu, tokens, 20, cache="static", compiled=True).tokens, reference)
    assert g.compiled_decode(tokens.device) is g.compiled_decode(tokens.device)


def test_tpot_is_the_mean_gap_as_vllm_defines_it():
    result = Generation(torch.zeros(1, 5, dtype=torch.long), 1, 0.5, [0.01, 0.01, 0.04, 0.02])
    assert result.tpot_s == pytest.approx(0.02) and result.median_step_s == pytest.approx(0.015)
    assert math.isnan(Generation(torch.zeros(1, 2, dtype=torch.long), 1, 0.5, []).tpot_s)


@pytest.mark.cuda
def test_the_compiled_variant_counts_only_its_own_graph_pool():
    """A CUDA graph recorded before the study holds 64 MiB in a private pool of its own: the compiled variant's peak
    is its pool's growth during the variant, so that other pool stays out of it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=32)).cuda().eval()
    other = torch.cuda.CUDAGraph()
    source = torch.ones(2**24, device="cuda")  # 64 MiB of fp32
    with torch.cuda.graph(other):
        held = source * 2
    prompt = torch.randint(0, 40, (1, 24), generator=torch.Generator().manual_seed(2)).cuda()
    study = decoding.decode_study(model, prompt, 4, rounds=2, variants=("no cache", "static cache, compiled"))
    assert held.numel() == 2**24 and study.agreements["static cache, compiled"].agrees
    assert study.peak_mb["static cache, compiled"] < 32, study.peak_mb
