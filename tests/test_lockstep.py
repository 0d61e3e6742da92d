"""Lockstep rounds on a CPU: the variants of a round take turns step by step, each step timed on its own, each
variant with its own random stream; where a variant needs a pass of its own, the round runs passes as before."""
import contextlib
import io
import time
from dataclasses import replace

import pytest
import torch

from optlab.core.run import experiments
from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import resolve_device
from optlab.core.knobs.profiles import get_profile
from optlab.core.techniques.registry import Experiment
from optlab.core.measuring.timing import StepTimer

TWO_COPIES = Experiment("two_copies", "one configuration twice", "", variants=(("A", {}), ("A again", {})))
WORKERS = Experiment("two_loaders", "no workers against one", "", phases=("train",),
                     variants=(("main process", {}), ("one worker", {"num_workers": 1})))


def run(experiment: Experiment, repeats: int = 2, lockstep: bool = True, **options):
    prof = get_profile("smoke").with_sizes(repeats=repeats, max_repeats=repeats)
    prof = prof if lockstep else replace(prof, lockstep_steps=None)
    with contextlib.redirect_stdout(io.StringIO()):
        return experiments.run_experiment(experiment, models=["resnet18"], profile=prof, device="cpu",
                                          progress=False, **options)


def test_time_between_pause_and_resume_counts_in_no_step_and_not_in_the_wall_time():
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    time.sleep(0.02)
    timer.mark()
    timer.pause()
    time.sleep(0.2)  # another variant's step
    timer.resume()
    time.sleep(0.02)
    timer.mark()
    steps, wall = timer.finish()
    assert len(steps) == 2 and all(0.015 < step < 0.1 for step in steps), steps
    assert wall < 0.15, wall


def test_a_cpu_run_of_in_process_variants_runs_in_lockstep_with_the_profile_s_steps():
    result = run(TWO_COPIES)
    smoke = get_profile("smoke")
    assert result.record["rounds"]["resnet18"]["lockstep_steps"] == smoke.lockstep_steps == 3
    assert (result.samples["step_times_s"].map(len) == smoke.lockstep_steps).all()
    assert set(result.samples["phase"]) == {"train", "test"}


def test_every_variant_of_a_lockstep_round_sees_the_batches_and_dropout_of_a_pass_of_its_own():
    result = run(TWO_COPIES)
    every = result.samples.assign(all_losses=result.samples["warmup_losses"] + result.samples["losses"])
    losses = every.set_index(["repeat", "phase", "variant"])["all_losses"]
    accuracy = every.set_index(["repeat", "phase", "variant"])["accuracy"]
    assert (losses.xs("train", level="phase").map(len) > 0).all()  # a test pass keeps its warm-up loss only
    for repeat, phase in {(r, p) for r, p, _ in losses.index}:
        assert losses[repeat, phase, "A"] == losses[repeat, phase, "A again"], (repeat, phase)
        if phase == "test":
            assert accuracy[repeat, phase, "A"] == accuracy[repeat, phase, "A again"], repeat
    passes = run(TWO_COPIES, lockstep=False)
    assert passes.record["rounds"]["resnet18"]["lockstep_steps"] is None
    alone = passes.samples.set_index(["repeat", "phase", "variant"])["warmup_losses"]
    assert alone[0, "train", "A"] == losses[0, "train", "A"][:1]  # (the test phase follows more training steps here)


def test_only_a_model_s_first_lockstep_round_takes_warm_up_steps():
    result = run(TWO_COPIES, repeats=3)
    warmups = result.samples.groupby("repeat")["warmup_times_s"].apply(lambda runs: {len(run) for run in runs})
    assert warmups[0] == {get_profile("smoke").warmup_steps} and warmups[0] != {0}
    assert all(warmups[repeat] == {0} for repeat in (1, 2)), warmups
    assert (result.samples["step_times_s"].map(len) == get_profile("smoke").lockstep_steps).all()


def test_a_variant_that_loads_with_workers_keeps_a_pass_of_its_own():
    result = run(WORKERS)
    assert result.record["rounds"]["resnet18"]["lockstep_steps"] is None
    assert (result.samples["step_times_s"].map(len) == get_profile("smoke").steps).all()


@pytest.mark.parametrize("case", ["workers", "compile", "flags", "one variant", "no lockstep in the profile",
                                  "isolated"])
def test_lockstep_needs_in_process_variants_without_workers_or_compiled_code(case):
    info, prof = resolve_device("cpu"), get_profile("smoke")
    configs = {"A": RunConfig(num_workers=0), "B": RunConfig(num_workers=0)}
    variants = {label: object.__new__(experiments.LocalVariant) for label in configs}
    assert experiments.lockstep_ready(variants, configs, prof, info)
    if case == "workers":
        configs["B"] = RunConfig(num_workers=2)
    elif case == "compile":
        configs["B"] = RunConfig(num_workers=0, compile_mode="default")
    elif case == "flags":
        configs["B"] = RunConfig(num_workers=0, cudnn_benchmark=True)
    elif case == "one variant":
        del variants["B"]
    elif case == "no lockstep in the profile":
        prof = get_profile("quick")
    else:
        variants["B"] = object.__new__(experiments.IsolatedVariant)
    assert not experiments.lockstep_ready(variants, configs, prof, info)


def test_a_variant_that_fails_in_lockstep_is_recorded_and_the_others_go_on(monkeypatch):
    real = experiments.LocalVariant.start

    def start(self, phase, profile):
        if self.state.config.batch_offset:
            raise RuntimeError("broken variant")
        return real(self, phase, profile)

    monkeypatch.setattr(experiments.LocalVariant, "start", start)
    broken = Experiment("broken", "one variant breaks", "", phases=("train",),
                        variants=(("A", {}), ("A + 1 image", {"batch_offset": 1}), ("A again", {})))
    result = run(broken, repeats=4)
    status = result.samples.groupby("variant")["status"].agg(set)
    assert status["A"] == status["A again"] == {"ok"}
    assert any("broken variant" in s for s in status["A + 1 image"]), status
