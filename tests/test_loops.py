import copy
import math
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from optlab.core.measuring import memory
from optlab.core.knobs.config import RunConfig
from optlab.core.measuring.loops import (
    eval_phase, grad_mode, make_optimizer, make_scaler, run_timed, train_phase, train_step,
)

CPU = torch.device("cpu")


def _bn_free_model():
    # no BatchNorm: its batch statistics would make micro-batches differ from the full batch
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


def _batch(n=16, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def _config(**changes):
    return RunConfig(num_workers=0, pin_memory=False, **changes)


def _train(model, batches, config):
    optimizer, scaler = make_optimizer(model), make_scaler(config, CPU)
    for index, batch in enumerate(batches):
        train_step(model, batch, optimizer, scaler, config, CPU, index)
    return model


def test_four_accumulated_micro_batches_equal_one_full_batch_step():
    inputs, targets = _batch(16)
    full = _train(_bn_free_model(), [(inputs, targets)], _config(batch_size=16, accumulation_steps=1))
    micro = [(inputs[i:i + 4], targets[i:i + 4]) for i in range(0, 16, 4)]
    accumulated = _train(_bn_free_model(), micro, _config(batch_size=4, accumulation_steps=4))
    for a, b in zip(full.parameters(), accumulated.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(full.parameters(), _bn_free_model().parameters()))


def test_accumulation_does_not_step_before_the_boundary():
    inputs, targets = _batch(4)
    model = _train(_bn_free_model(), [(inputs, targets)], _config(accumulation_steps=2))
    for a, b in zip(model.parameters(), _bn_free_model().parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("accumulation, warmup, steps, expected", [
    (1, 1, 1, (1, 1)), (2, 1, 1, (2, 2)), (2, 0, 3, (0, 4)), (4, 1, 4, (4, 4)), (3, 2, None, (3, None))])
def test_a_training_window_holds_whole_optimizer_steps(accumulation, warmup, steps, expected):
    assert _config(accumulation_steps=accumulation).train_window(warmup, steps) == expected


def test_an_accumulating_pass_times_whole_optimizer_steps():
    """1 warm-up + 1 timed micro-step asked with 2 micro-steps an optimizer step: the pass runs 2 + 2, so the timed
    window holds one optimizer step, not a micro-step that steps every time."""
    config = _config(batch_size=4, accumulation_steps=2)
    loader = DataLoader(TensorDataset(*_batch(32)), batch_size=4)
    model = _bn_free_model()
    result = train_phase(model, loader, make_optimizer(model), make_scaler(config, CPU), config, CPU, steps=1,
                         warmup=1)
    assert len(result.warmup_times_s) == 2 and len(result.step_times_s) == 2 and len(result.losses) == 2


def test_set_to_none_both_ways_gives_identical_weights():
    batches = [_batch(8, seed) for seed in range(4)]
    with_none = _train(_bn_free_model(), batches, _config(set_to_none=True))
    with_zeros = _train(_bn_free_model(), batches, _config(set_to_none=False))
    for a, b in zip(with_none.parameters(), with_zeros.parameters()):
        assert torch.equal(a, b)


def test_set_to_none_is_explicit_both_ways():
    model = _bn_free_model()
    optimizer, config = make_optimizer(model), _config(set_to_none=False)
    train_step(model, _batch(4), optimizer, make_scaler(config, CPU), config, CPU, 0)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    config = _config(set_to_none=True)
    train_step(model, _batch(4), optimizer, make_scaler(config, CPU), config, CPU, 0)
    assert all(p.grad is None for p in model.parameters())


def test_scaler_is_on_only_for_fp16():
    assert make_scaler(_config(amp_dtype="fp16"), CPU).is_enabled()
    assert not make_scaler(_config(amp_dtype="bf16"), CPU).is_enabled()
    assert not make_scaler(_config(), CPU).is_enabled()


def test_grad_modes():
    x = torch.ones(2, requires_grad=True)
    with grad_mode("grad"):
        assert (x * 2).requires_grad
    with grad_mode("no_grad"):
        assert not (x * 2).requires_grad
    with grad_mode("inference_mode"):
        assert torch.is_inference_mode_enabled()


def _loader(n=40, batch=8):
    inputs, targets = _batch(n)
    return DataLoader(TensorDataset(inputs, targets), batch_size=batch, drop_last=True)


def test_train_phase_keeps_raw_samples_after_warmup():
    model = _bn_free_model()
    config = _config(batch_size=8)
    result = train_phase(model, _loader(), make_optimizer(model), make_scaler(config, CPU), config, CPU, steps=3, warmup=2)
    assert len(result.step_times_s) == 3 and len(result.losses) == 3
    assert result.samples == 24 and result.startup_s >= 0 and result.wall_s > 0 and result.peak_mem_mb > 0


def test_whole_epoch_when_steps_is_none():
    model = _bn_free_model()
    config = _config(batch_size=8)
    result = eval_phase(model, _loader(40, 8), config, CPU, steps=None, warmup=1)
    assert len(result.step_times_s) == 4 and result.samples == result.predictions == 32 and 0 <= result.correct <= 32


def test_autocast_bf16_runs_on_cpu():
    model = copy.deepcopy(_bn_free_model())
    config = _config(amp_dtype="bf16")
    loss = train_step(model, _batch(4), make_optimizer(model), make_scaler(config, CPU), config, CPU, 0)
    assert torch.isfinite(loss)


def _wide_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


def _phase_peaks(batch: int) -> tuple:
    model, config = _wide_model(), _config(batch_size=batch)
    loader = _loader(batch * 4, batch)
    train = train_phase(model, loader, make_optimizer(model), make_scaler(config, CPU), config, CPU, steps=2, warmup=1)
    return train, eval_phase(model, loader, config, CPU, steps=2, warmup=1)


def test_cpu_peak_memory_is_per_variant_and_per_phase():
    """On the CPU the peak is the variant's resident tensors plus one profiled step's own increase: a bigger batch
    holds more activations, and training (activations kept for backward) holds more than evaluation."""
    small_train, small_eval = _phase_peaks(4)
    big_train, big_eval = _phase_peaks(64)
    assert big_train.peak_mem_mb - big_train.resident_mem_mb > 8 * (small_train.peak_mem_mb - small_train.resident_mem_mb)
    assert big_eval.peak_mem_mb > big_eval.resident_mem_mb  # the eval step's own activations count too
    assert big_train.peak_mem_mb - big_train.resident_mem_mb > 1.3 * (big_eval.peak_mem_mb - big_eval.resident_mem_mb)
    assert len(big_train.step_times_s) == len(big_train.losses) == 2  # the profiled step is not a timed one


def test_cpu_peak_memory_is_no_number_where_no_step_was_profiled():
    assert math.isnan(memory.phase_peak_mb(CPU, 0, resident=10.0))
    assert memory.phase_peak_mb(CPU, 0, resident=10.0, step_increase_mb=2.5) == 12.5
    block = memory.cpu_step_increase_mb(lambda: torch.empty(4 * 2**20, dtype=torch.uint8))  # 4 MiB, freed at once
    assert 4 <= block < 4.5


def test_a_known_cpu_figure_spares_the_profiled_step(monkeypatch):
    monkeypatch.setattr(memory, "cpu_step_increase_mb", lambda step: pytest.fail("profiled again"))
    model = _bn_free_model()
    config = _config(batch_size=8)
    result = eval_phase(model, _loader(), config, CPU, steps=2, warmup=1, step_increase_mb=1.5)
    assert result.peak_mem_mb == pytest.approx(result.resident_mem_mb + 1.5)


class _SlowItems(torch.utils.data.Dataset):
    """Items that take ``seconds`` each to load."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.seconds)
        return torch.zeros(1)


@pytest.mark.parametrize("warmup", [0, 1])
def test_every_timed_step_pays_for_loading_its_batch_and_the_start_up_holds_the_first_only_before_a_warm_up(warmup):
    load_s = 0.1  # far above the start-up of a loader without workers
    result, _ = run_timed(lambda batch, index: batch, DataLoader(_SlowItems(load_s), batch_size=1), CPU,
                          steps=2, warmup=warmup)
    assert len(result.step_times_s) == 2 and min(result.step_times_s) >= load_s, result.step_times_s
    assert (result.startup_s >= load_s) == (warmup == 1), result.startup_s
