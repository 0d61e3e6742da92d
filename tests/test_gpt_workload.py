"""The GPT workload: registered techniques run on it through the same loops, throughput and epochs count tokens, its
knobs reach the model and are refused elsewhere, and each profile sizes it (a tiny fp32 GPT on a CPU, GPT-2 small in
bf16 on a GPU)."""
import itertools
from dataclasses import replace

import pytest
import torch
from torch.utils.data import RandomSampler, TensorDataset

from optlab.core.techniques import gpt as gpt_techniques
from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import effective_config, resolve_device
from optlab.core.errors import OptlabError
from optlab.core.run.experiments import run_experiment
from optlab.core.measuring.flops import config_step_flops, forward_flops_of
from optlab.core.gpt import GPT_WORKLOAD, gpt_config, sequence_length
from optlab.core.techniques.no_effect import NO_EFFECT
from optlab.core.knobs.profiles import get_profile
from optlab.core.techniques.cnn import technique_set
from optlab.core.gpt.text_data import TokenWindows
from optlab.core.gpt.transformer import GPT_SIZES, forward_flops
from optlab.core.run.variants import build_state
from tests.helpers import TINY

GPT_PROFILE = replace(TINY, name="smoke", models=("gpt_tiny",), steps=2, test_steps=1, repeats=2)


def test_a_shapes_run_counts_tokens_and_times_the_same_tokens_alike():
    experiment = gpt_techniques.shapes_experiment("gpt_tiny", 8)
    result = run_experiment(experiment, profile=GPT_PROFILE, device="cpu", progress=False)
    samples = result.samples
    assert set(samples["unit"]) == {"tokens"} and set(samples["status"]) == {"ok"}
    configs = experiment.configs("gpt_tiny", GPT_PROFILE)
    for label, rows in samples.groupby("variant"):
        config = configs[label]
        tokens = config.samples_per_step * sequence_length(config)
        assert tokens == 8 * GPT_SIZES["gpt_tiny"].block_size  # the same tokens a step in every variant
        assert rows["items_per_s"].to_numpy() == pytest.approx(rows["images_per_s"].to_numpy() * sequence_length(config))
        step = rows["step_times_s"].map(lambda times: sum(times) / len(times))
        epoch_steps = (rows["epoch_equiv_s"] - rows["startup_s"]) / step  # an epoch is the training text, in tokens
        assert epoch_steps.to_numpy() == pytest.approx(rows["epoch_images"].to_numpy() / tokens)
    assert result.summary["verdict"].notna().all()


def test_the_knobs_reach_the_model_and_the_flops_count_attention():
    config = RunConfig(workload="gpt", model="gpt_tiny", attention="manual", checkpointing="full", seq_len=32,
                       vocab_size=128, batch_size=4)
    model = GPT_WORKLOAD.build(config)
    assert model.attention == "manual" and model.checkpointing == "full"
    assert model.config.block_size == 32 and model.config.vocab_size == 128
    assert GPT_WORKLOAD.input_for(3, config).shape == (3, 32)
    assert forward_flops_of(config) == forward_flops(gpt_config("gpt_tiny", seq_len=32, vocab_size=128), 1, 32)
    assert config_step_flops(config, train=True) == 3 * 4 * forward_flops_of(config)
    padded = replace(config, vocab_size=65)
    assert forward_flops_of(config) > forward_flops_of(padded)  # a larger head


@pytest.mark.parametrize("changes, message", [
    ({"attention": "flex"}, "cifar workload has no attention knob"),
    ({"seq_len": 32}, "no seq_len knob"),
    ({"workload": "gpt", "model": "gpt_tiny", "seq_len": 0}, "seq_len must be an integer from 1"),
    ({"workload": "gpt", "model": "gpt_tiny", "vocab_size": 10**9}, "vocab_size must be an integer from 1 to"),
    ({"workload": "gpt", "model": "gpt_tiny", "attention": "fast"}, "attention"),
    ({"workload": "gpt", "model": "resnet18"}, "gpt_tiny"),
])
def test_bad_knobs_are_refused_with_what_is_allowed(changes, message):
    with pytest.raises(OptlabError, match=message):
        RunConfig(**changes)


def test_a_sequence_longer_than_the_model_holds_is_refused_with_its_limit():
    with pytest.raises(OptlabError, match="gpt_tiny holds at most 64 tokens"):
        GPT_WORKLOAD.build(RunConfig(workload="gpt", model="gpt_tiny", seq_len=65))


def test_each_profile_sizes_the_gpt():
    smoke = gpt_techniques.CHECKPOINTING.configs("gpt_tiny", get_profile("smoke"))
    assert {(c.batch_size, c.width, c.amp_dtype) for c in smoke.values()} == {(8, 1.0, "none")}
    quick = get_profile("quick")
    assert gpt_techniques.CHECKPOINTING.default_models(quick) == ("gpt2_small",)
    gpu = gpt_techniques.CHECKPOINTING.configs("gpt2_small", quick)
    assert {(c.batch_size, c.amp_dtype) for c in gpu.values()} == {(16, "bf16")}
    precision = gpt_techniques.GPT_PRECISION.configs("gpt2_small", quick)
    assert precision["fp32 strict"].amp_dtype == "none" and precision["bf16 autocast"].amp_dtype == "bf16"
    assert set(technique_set("transformer")) == set(gpt_techniques.TRANSFORMER_TECHNIQUES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's fallback")
def test_fp8_on_a_cpu_is_named_not_timed_with_its_reason():
    config = RunConfig(workload="gpt", model="gpt_tiny", fp8=True)
    effective, notes = effective_config(config, resolve_device("cpu"))
    assert not effective.fp8 and any(note.startswith("fp8: skipped on cpu (FP8 training needs") for note in notes)
    experiment = gpt_techniques.GPT_PRECISION.with_variants(
        ("bf16 autocast", {"amp_dtype": "none"}), ("bf16 autocast + FP8 linears", {"amp_dtype": "none", "fp8": True}))
    result = run_experiment(experiment, profile=GPT_PROFILE, device="cpu", progress=False)
    fp8 = result.summary.reset_index()
    verdict = fp8.loc[fp8["variant"] == "bf16 autocast + FP8 linears", "verdict"].iloc[0]
    assert verdict.startswith(NO_EFFECT) and "compute capability 8.9" in verdict


def test_the_stack_and_the_shapes_refuse_an_unknown_size_or_step():
    with pytest.raises(OptlabError, match="GPT size"):
        gpt_techniques.shapes_experiment("gpt_huge", 8)
    with pytest.raises(OptlabError, match="stack step"):
        gpt_techniques.gpt_all_together("gpt_tiny", skip=("+ nothing",))
    stack = gpt_techniques.gpt_all_together("gpt_tiny", skip=("+ bf16 autocast",))
    assert all(changes.get("amp_dtype", "none") == "none" for _, changes in stack.variants)



def test_the_gpt_draws_random_windows_with_replacement_and_cifar_shuffles_a_pass():
    info = resolve_device("cpu")
    tokens = torch.arange(5000) % 65
    train, test = TokenWindows(tokens[:4000], 1, 65), TokenWindows(tokens[4000:], 1, 65)
    config = RunConfig(workload="gpt", model="gpt_tiny", batch_size=4, num_workers=0)

    def first_batches(seed: int) -> list[torch.Tensor]:
        loader = build_state(config, info, train, test, seed).loaders["train"]
        assert isinstance(loader.sampler, RandomSampler) and loader.sampler.replacement
        assert len(loader.sampler) == len(loader.dataset)  # a pass draws as many windows as the text holds
        return [x for x, _ in itertools.islice(loader, 3)]

    assert all(torch.equal(a, b) for a, b in zip(first_batches(0), first_batches(0)))  # the seed fixes the draws
    assert not all(torch.equal(a, b) for a, b in zip(first_batches(0), first_batches(1)))
    images = TensorDataset(torch.zeros(64, 3, 32, 32), torch.zeros(64, dtype=torch.long))
    cifar = build_state(RunConfig(model="resnet18", width=0.125, batch_size=4, num_workers=0), info, images, images, 0)
    sampler = cifar.loaders["train"].sampler
    assert isinstance(sampler, RandomSampler) and not sampler.replacement  # a shuffled pass: each image once
