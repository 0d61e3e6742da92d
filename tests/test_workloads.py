"""Workloads: a third one added in one module runs a registered technique; a token workload's shapes work through
the same loops; a bad workload or model is refused with the choices."""
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from optlab.core.measuring import loops, memory
from optlab.core.knobs.config import RunConfig
from optlab.core.errors import OptlabError
from optlab.core.run.experiments import run_experiment
from optlab.core.measuring.flops import forward_flops_per_sample, step_flops
from optlab.core.techniques.registry import get_experiment
from optlab.core.workload import WORKLOADS, DataSource, Workload, get_workload
from tests import tabular_workload
from tests.helpers import TINY

TABULAR_PROFILE = replace(TINY, models=("mlp",), width=1.0)


def test_a_third_workload_in_one_module_runs_a_registered_technique(capsys, monkeypatch):
    assert get_workload("tabular") is tabular_workload.TABULAR and "cifar" in WORKLOADS
    technique = replace(get_experiment("set_to_none"), workload="tabular")
    profiled, real = [], memory.cpu_step_increase_mb
    monkeypatch.setattr(memory, "cpu_step_increase_mb", lambda step: profiled.append(1) or real(step))
    result = run_experiment(technique, profile=TABULAR_PROFILE, progress=False)
    assert len(profiled) == len(technique.labels) * len(technique.phases)  # one profiled step per variant and phase
    assert "data source: stand-in (synthetic tabular rows)" in capsys.readouterr().out
    samples = result.samples
    assert set(samples["model"]) == {"mlp"} and set(samples["status"]) == {"ok"}
    assert set(samples["unit"]) == {"rows"} and (samples["items_per_s"] == samples["images_per_s"]).all()
    assert set(samples["epoch_images"]) == {tabular_workload.TRAIN_ROWS, tabular_workload.TEST_ROWS}
    h = tabular_workload.HIDDEN
    forward = 2 * (tabular_workload.FEATURES * h + h * h + h * tabular_workload.CLASSES)  # FLOPs of one row
    train = samples[samples["phase"] == "train"]
    assert set(train["flops_per_step"]) == {3 * forward * TINY.batch_size}
    accuracy = samples.loc[samples["phase"] == "test", "accuracy"]
    assert accuracy.between(0, 1).all()
    assert all(config["workload"] == "tabular" for config in result.record["configs"]["mlp"].values())


def test_a_workload_validates_its_own_model_names():
    with pytest.raises(OptlabError, match="unknown model 'resnet18'; choose one of: mlp"):
        RunConfig(workload="tabular", model="resnet18")
    with pytest.raises(OptlabError, match="unknown workload 'images'; choose one of: cifar"):
        RunConfig(workload="images")
    with pytest.raises(OptlabError, match="data_on_device"):
        RunConfig(workload="tabular", model="mlp", data_on_device=True)


# A token workload's shapes: token ids [N, T] in, logits [N, T, V] out, targets [N, T]; throughput in tokens.
VOCAB, SEQUENCE = 11, 8


def bigram(name: str, variant: str = "base", width: float = 1.0) -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))


def token_sets(source: DataSource, download: bool = False) -> tuple[TensorDataset, TensorDataset]:
    """Each next token is the current one plus one (mod the vocabulary): a bigram model learns it."""
    def make(count: int, seed: int) -> TensorDataset:
        start = torch.randint(0, VOCAB, (count, 1), generator=torch.Generator().manual_seed(seed))
        tokens = (start + torch.arange(SEQUENCE + 1)) % VOCAB
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return make(256, 0), make(64, 1)


TOKENS = Workload(
    name="test_tokens", description="a bigram model on counting tokens", unit="tokens", sample_name="sequences",
    model_names=("bigram",), build_model=bigram,
    example_input=lambda batch: torch.zeros(batch, SEQUENCE, dtype=torch.long),
    find_source=lambda download=False: DataSource("stand-in", "stand-in (counting tokens)"), datasets=token_sets,
    train_size=256, test_size=64, items_per_sample=SEQUENCE, module=__name__,
)


def test_a_token_workload_counts_tokens_and_scores_every_token(monkeypatch):
    monkeypatch.setitem(WORKLOADS, TOKENS.name, TOKENS)
    assert forward_flops_per_sample("bigram", workload="test_tokens") == 2 * SEQUENCE * 16 * VOCAB  # the head's
    assert step_flops("bigram", "base", 1.0, 4, train=False, workload="test_tokens") == 4 * 2 * SEQUENCE * 16 * VOCAB
    technique = replace(get_experiment("set_to_none"), workload="test_tokens")
    result = run_experiment(technique, profile=replace(TINY, models=(), batch_size=4), progress=False)
    samples = result.samples
    assert set(samples["unit"]) == {"tokens"}
    assert samples["items_per_s"].tolist() == pytest.approx((samples["images_per_s"] * SEQUENCE).tolist())
    assert samples.loc[samples["phase"] == "test", "accuracy"].between(0, 1).all()
    model = bigram("bigram")
    inputs, targets = token_sets(DataSource("stand-in", ""))[1][:4]
    assert TOKENS.loss(model(inputs), targets).ndim == 0  # cross-entropy over [N, T, V] flattened
    config = RunConfig(workload="test_tokens", model="bigram", batch_size=4, num_workers=0, pin_memory=False)
    correct = loops.eval_step(model, (inputs, targets), config, torch.device("cpu"))
    assert 0 <= int(correct) <= inputs.numel()
