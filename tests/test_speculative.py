"""Greedy speculative decoding: the output is the target's greedy decoding token for token whatever the drafter, the
caches roll back to the kept text, and the acceptance rate is the count of kept drafted tokens over those drafted."""
import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from optlab.core.errors import OptlabError
from optlab.core.measuring.timing import VERDICTS
from optlab.core.gpt.transformer import GPT, GPTConfig
from optlab.studies.serving import generation
from optlab.studies.serving import speculative as sp
from optlab.studies.serving import trained

PROMPT_LEN, NEW = 8, 24


def random_gpt(seed: int, layers: int = 2) -> GPT:
    """A random GPT whose greedy text varies (an untied random head: a tied one mostly repeats the last token)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=16, block_size=64, n_layer=layers, n_head=2, n_embd=32))
    model.head.weight = nn.Parameter(torch.randn(16, 32))
    return model.eval()


def perturbed(model: GPT, scale: float) -> GPT:
    """A draft that agrees with ``model`` part of the time: its weights plus noise."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return draft


@pytest.fixture(scope="module")
def target() -> GPT:
    return random_gpt(0)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(16, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def reference(target, prompt) -> torch.Tensor:
    return generation.greedy_reference(target, prompt, NEW)


def drafter(kind: str, k: int, draft: GPT):
    return sp.make_drafter(kind, k, draft, PROMPT_LEN + NEW + k)


def test_prompt_lookup_copies_what_followed_the_latest_earlier_occurrence():
    assert sp.prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], k=2) == [7, 1]  # the latest occurrence of 1 2 3
    assert sp.prompt_lookup([5, 1, 2, 6, 2], k=3) == [6, 2]  # only the last token matches: 2 was followed by 6 2
    assert sp.prompt_lookup([4, 1, 2, 9, 3, 1, 2], k=2, max_ngram=1) == [9, 3]  # 2 alone
    assert sp.prompt_lookup([1, 2, 3], k=2) == []
    assert sp.PromptLookupDrafter(4).propose([1, 2, 3]) == [3, 3, 3, 3]  # nothing found: the last token, repeated


@pytest.mark.parametrize("kind", sp.DRAFTERS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_the_output_is_the_targets_greedy_decoding_and_the_counts_agree(target, prompt, reference, kind, k):
    run = sp.speculative_generate(target, prompt, NEW, drafter(kind, k, perturbed(target, 0.5)))
    assert torch.equal(run.tokens.cpu(), reference), (kind, k)
    assert 0 < run.acceptance_rate < 1  # a draft that is sometimes right, sometimes wrong: both paths are taken
    assert run.acceptance_rate == sp.counted_acceptance(run)
    assert run.accepted == len(run.text) - PROMPT_LEN - 1 - len(run.rounds)  # each round: the kept ones + its own
    assert run.drafted == k * len(run.rounds)
    assert run.target_cache_length == len(run.text) - 1  # rolled back to the kept text, all but its last token
    if kind == "draft model":
        assert run.draft_cache_length == len(run.text) - 1


def test_a_perfect_draft_is_always_accepted_and_a_wrong_one_never(target, prompt, reference):
    perfect = sp.speculative_generate(target, prompt, NEW, drafter("draft model", 3, target))
    assert perfect.acceptance_rate == 1.0 and perfect.tokens_per_round == 4.0
    assert torch.equal(perfect.tokens, reference)

    class Wrong(sp.PromptLookupDrafter):
        def propose(self, sequence):  # a token the target never chooses next
            return [(choice + 1) % 16 for choice in reference[0, len(sequence):len(sequence) + self.k].tolist()] + \
                   [0] * max(0, len(sequence) + self.k - reference.size(1))

    wrong = sp.speculative_generate(target, prompt, NEW, Wrong(2))
    assert wrong.accepted == 0 and wrong.tokens_per_round == 1.0
    assert torch.equal(wrong.tokens, reference)


def test_the_comparison_times_every_setting_against_greedy_and_checks_its_tokens(target, prompt):
    comparison = sp.decode_comparison(target, perturbed(target, 0.5), prompt, 12, ks=(1, 4), rounds=2)
    table = comparison.table().set_index("variant")
    assert list(table.index) == [sp.BASELINE, "draft model, k=1", "draft model, k=4", "prompt lookup, k=1",
                                 "prompt lookup, k=4"]
    assert table["same as greedy"].all() and (table["rounds"] == 2).all()
    assert table.loc[sp.BASELINE, "verdict"] == "baseline"
    assert table.drop(index=sp.BASELINE)["verdict"].isin(VERDICTS).all()
    assert table.loc["prompt lookup, k=4", "drafter MiB"] == 0 < table.loc["draft model, k=1", "drafter MiB"]
    # every setting sat before and after the baseline: the mirrored rounds
    assert all(sorted(shifts) == sorted(-s for s in shifts) for label, shifts in comparison.slot_shifts.items())
    assert len(comparison.speedups("tiny")) == 4
    assert (table["compiled"] == "none").all() and comparison.caveat() is None


def test_compiled_steps_against_eager_verification_are_labelled(target, prompt):
    """With compiled steps the baseline runs through CUDA graphs and the verification does not: the table and the
    caveat say so, rather than pass the comparison off as like for like."""
    eager = sp.decode_comparison(target, perturbed(target, 0.5), prompt, 6, ks=(2,), rounds=2)
    labelled = dataclasses.replace(eager, compiled=True)
    table = labelled.table().set_index("variant")
    assert table.loc[sp.BASELINE, "compiled"] == "every decode step"
    assert table.loc["draft model, k=2", "compiled"] == "the draft's steps; verification eager"
    assert table.loc["prompt lookup, k=2", "compiled"] == "none; verification eager"
    assert "verifies each draft eagerly" in labelled.caveat()


@pytest.mark.parametrize("call, message", [
    (lambda t, p: sp.PromptLookupDrafter(0), "k must be at least 1"),
    (lambda t, p: sp.PromptLookupDrafter(33), "k 33 is more than this run can use: at most 32"),
    (lambda t, p: sp.make_drafter("n-gram", 2, None, 40), "unknown drafter 'n-gram'; choose one of: draft model, "),
    (lambda t, p: sp.make_drafter("draft model", 2, None, 40), "needs a draft GPT"),
    (lambda t, p: sp.speculative_generate(t, p.repeat(2, 1), 4, sp.PromptLookupDrafter(2)), "takes one prompt"),
    (lambda t, p: sp.speculative_generate(t, p, 60, sp.PromptLookupDrafter(2)), "new_tokens 60 is more than"),
    (lambda t, p: sp.decode_comparison(t, None, p, 4, ks=(0,), drafters=("prompt lookup",)), "ks must be draft"),
])
def test_bad_input_is_one_line_naming_what_is_allowed(target, prompt, call, message):
    with pytest.raises(OptlabError, match=message) as error:
        call(target, prompt)
    assert "\n" not in str(error.value)


def test_the_comparison_flags_a_decoder_that_keeps_rejected_guesses(target, prompt, monkeypatch):
    monkeypatch.setattr(sp, "accepted_prefix", lambda drafted, predicted: len(drafted))  # every guess kept
    comparison = sp.decode_comparison(target, perturbed(target, 0.5), prompt, 12, ks=(2,), rounds=2)
    assert comparison.agreements[sp.BASELINE].agrees
    assert not any(comparison.agreements[label].agrees for label in ("draft model, k=2", "prompt lookup, k=2"))


@pytest.mark.parametrize("cuda", [False, True])
def test_the_chapters_plan_fits_both_models_blocks(cuda):
    plan = sp.chapter_plan(cuda)
    for size in (plan.target, plan.draft):
        config = trained.serving_config(size)
        assert plan.prompt_len + plan.new_tokens + max(sp.DRAFT_LENGTHS) <= config.block_size, size
    assert trained.serving_config(plan.target).n_layer > trained.serving_config(plan.draft).n_layer
    assert plan.compiled == cuda and (plan.dtype == torch.bfloat16) == cuda
    assert sp.prompt_tokens(plan.prompt_len).shape == (1, plan.prompt_len)


def test_compiled_verification_goes_through_one_graph_per_k_and_keeps_greedy_tokens(target, prompt, reference,
                                                                                    monkeypatch):
    """With ``compiled`` every round's verification of k + 1 tokens runs the compiled function of its k (a cheap
    counting backend stands in for Inductor here), never the eager call, and the text is still greedy decoding's."""
    counter = CompileCounter()
    real_compile, eager_calls = torch.compile, []

    def cheap(fn, mode=None, **kwargs):
        return real_compile(fn, backend=counter, **kwargs)

    def counted(model, tokens, cache):
        eager_calls.append(tokens.size(1))
        return real_forward(model, tokens, cache)

    real_forward = generation.forward_cached
    monkeypatch.setattr(torch, "compile", cheap)
    monkeypatch.setattr(generation, "forward_cached", counted)
    monkeypatch.setattr(sp, "_VERIFIERS", {})
    torch._dynamo.reset()
    for k in (2, 3):
        run = sp.speculative_generate(target, prompt, NEW, sp.PromptLookupDrafter(k), compiled=True)
        assert torch.equal(run.tokens, reference) and len(run.rounds) > 1
        assert run.target_cache_length == len(run.text) - 1  # the compiled call's keys are kept and rolled back
    assert counter.frame_count == 2 and set(sp._VERIFIERS) == {("default", 2), ("default", 3)}
    assert eager_calls == [PROMPT_LEN, PROMPT_LEN]  # the prefills only: no round verified eagerly
    torch._dynamo.reset()


def test_the_comparison_can_compile_the_verification_alone(target, prompt, monkeypatch):
    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kwargs: real_compile(fn, backend=counter, **kwargs))
    monkeypatch.setattr(sp, "_VERIFIERS", {})
    torch._dynamo.reset()
    comparison = sp.decode_comparison(target, perturbed(target, 0.5), prompt, 6, ks=(2,), rounds=2,
                                      compile_verification=True)
    table = comparison.table().set_index("variant")
    assert table["same as greedy"].all() and counter.frame_count == 1  # one k, one graph, every run
    assert table.loc[sp.BASELINE, "compiled"] == "none"
    assert table.loc["prompt lookup, k=2", "compiled"] == "verification"
    torch._dynamo.reset()


def test_compiled_verification_is_labelled_like_the_compiled_baseline(target, prompt):
    eager = sp.decode_comparison(target, perturbed(target, 0.5), prompt, 6, ks=(2,), rounds=2)
    table = dataclasses.replace(eager, compiled=True, verification_compiled=True).table().set_index("variant")
    assert table.loc[sp.BASELINE, "compiled"] == "every decode step"
    assert table.loc["draft model, k=2", "compiled"] == "the draft's steps and verification"
    assert table.loc["prompt lookup, k=2", "compiled"] == "verification"
    assert dataclasses.replace(eager, compiled=True, verification_compiled=True).caveat() is None
    alone = dataclasses.replace(eager, verification_compiled=True).table().set_index("variant")
    assert alone.loc[sp.BASELINE, "compiled"] == "none" and alone.loc["draft model, k=2", "compiled"] == "verification"


@pytest.mark.cuda
def test_on_a_gpu_every_part_runs_under_cuda_graphs_and_keeps_greedy_tokens():
    """The real thing: the baseline, the draft and the verification compiled with CUDA graphs, in bf16."""
    cuda = torch.device("cuda")
    target = random_gpt(0).to(cuda, torch.bfloat16)
    draft = perturbed(random_gpt(0), 0.5).to(cuda, torch.bfloat16)
    prompt = torch.randint(16, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    comparison = sp.decode_comparison(target, draft, prompt, 16, ks=(2, 4), rounds=2, compiled=True)
    table = comparison.table().set_index("variant")
    assert table["same as greedy"].all(), table
    assert comparison.verification_compiled and comparison.caveat() is None
    assert table.loc["draft model, k=4", "compiled"] == "the draft's steps and verification"
    assert {("reduce-overhead", 2), ("reduce-overhead", 4)} <= set(sp._VERIFIERS)


def test_a_reused_target_cache_keeps_its_storage_and_gives_the_same_tokens(target, prompt, reference):
    """The comparison's runs refill one cache per setting: CUDA graphs recorded on it replay, and the text is
    greedy decoding's every time."""
    cache = generation.StaticKVCache(target, 1, sp.target_cache_len(PROMPT_LEN, NEW, 3))
    where = cache.data_pointers()
    for _ in range(2):
        run = sp.speculative_generate(target, prompt, NEW, sp.PromptLookupDrafter(3), reuse=cache)
        assert torch.equal(run.tokens, reference) and cache.data_pointers() == where
        assert run.target_cache_length == len(run.text) - 1
    with pytest.raises(OptlabError, match="reuse needs a StaticKVCache of one row holding at least 35 positions"):
        sp.speculative_generate(target, prompt, NEW, sp.PromptLookupDrafter(3),
                                reuse=generation.StaticKVCache(target, 1, 34))


def test_the_comparison_builds_one_target_cache_per_setting_for_all_its_runs(target, prompt, monkeypatch):
    built = []
    real = generation.StaticKVCache

    def counted(*args, **kwargs):
        built.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "StaticKVCache", counted)
    comparison = sp.decode_comparison(target, perturbed(target, 0.5), prompt, 6, ks=(2,), rounds=3)
    assert all(check.agrees for check in comparison.agreements.values())
    assert len(built) == 4  # the draft's own, the baseline's and the two settings' target caches: 4 runs each
