import pytest
import torch

from optlab.core.run import experiments
from optlab.core.measuring import loops
from optlab.core.measuring.timing import verdicts
from optlab.core.results.store import load_samples
from optlab.core.errors import OptlabError
from optlab.core.techniques.registry import Experiment, get_experiment, list_experiments
from optlab.core.run.experiments import run_experiment
from optlab.core.results.seed import seed_results
from optlab.core.techniques.cnn import SEED_TECHNIQUES
from tests.helpers import TINY

AA = Experiment("a_a", "the same config twice", "", variants=(("A", {}), ("A again", {})))


def test_registry_has_the_nine_seed_sections_named_as_in_the_seed_csv():
    assert set(SEED_TECHNIQUES) == set(seed_results()["technique"])
    listing = list_experiments()
    assert set(SEED_TECHNIQUES) <= set(listing["technique"])
    for name in SEED_TECHNIQUES:
        experiment = get_experiment(name)
        assert experiment.section and experiment.phases and len(experiment.variants) >= 2


def test_seed_variant_labels_match_the_seed_tables():
    seed = seed_results()
    for name in SEED_TECHNIQUES:
        seed_labels = set(seed.loc[seed["technique"] == name, "variant"])
        assert seed_labels <= set(get_experiment(name).labels), name


def test_unknown_technique_lists_them():
    with pytest.raises(OptlabError, match="unknown technique 'turbo'; choose one of: data_loading"):
        get_experiment("turbo")


def test_configs_differ_only_by_the_variant_knobs():
    configs = get_experiment("channels_last").configs("resnet18", TINY)
    a, b = configs.values()
    assert a.amp_dtype == b.amp_dtype == "fp16"  # the shared base knob
    assert (a.channels_last, b.channels_last) == (False, True)
    assert a.batch_size == TINY.batch_size and a.width == TINY.width


@pytest.fixture(scope="module")
def aa_result():
    return run_experiment(AA, profile=TINY, device="cpu", progress=False)


def test_tidy_rows_one_per_model_variant_repeat_phase(aa_result):
    samples = aa_result.samples
    assert len(samples) == 1 * 2 * TINY.repeats * 2
    assert not samples.duplicated(["model", "variant", "repeat", "phase"]).any()
    assert (samples["status"] == "ok").all()
    assert samples["step_times_s"].map(len).eq(samples["steps"]).all()
    assert (samples.loc[samples["phase"] == "train", "steps"] == TINY.steps).all()


def test_runs_interleave_and_alternate_the_order(aa_result):
    order = aa_result.samples.loc[aa_result.samples["phase"] == "train", "variant"].tolist()
    assert order == ["A", "A again", "A again", "A", "A again", "A"][:2 * TINY.repeats]  # mirrored pairs of rounds
    slots = aa_result.samples.loc[aa_result.samples["phase"] == "train", "slot"].tolist()
    assert slots == [0, 1, 0, 1, 0, 1][:2 * TINY.repeats]


def test_an_a_a_run_reads_each_verdict_off_its_own_interval(aa_result):
    """How often an A/A run claims a difference is a rate over many runs (test_sequential bounds it over thousands of
    no-effect draws); one run must read each verdict off its own interval, the first variant the baseline."""
    summary = aa_result.summary
    again = summary[summary["variant"] == "A again"]
    assert len(again) == 2 and (summary.loc[summary["variant"] == "A", "verdict"] == "baseline").all()
    assert again["verdict"].tolist() == list(verdicts(again["speedup"], again["ci_low"], again["ci_high"]))
    assert ((again["ci_low"] <= again["speedup"]) & (again["speedup"] <= again["ci_high"])).all(), again


def test_a_a_sides_compute_the_same_losses(aa_result):
    train = aa_result.samples[aa_result.samples["phase"] == "train"]
    a, b = (train[train["variant"] == v]["losses"].tolist() for v in ("A", "A again"))
    assert a == b


def test_record_holds_knobs_environment_and_notes(aa_result):
    record = aa_result.record
    assert record["configs"]["resnet18"]["A"]["batch_size"] == TINY.batch_size
    assert record["environment"]["data_source"].startswith("stand-in")
    assert record["profile"]["name"] == "tiny"
    assert any("pin_memory" in note for note in record["notes"])


def test_summary_reports_memory_and_throughput(aa_result):
    summary = aa_result.summary
    assert (summary["peak_mem_mb"] > 0).all() and (summary["images_per_s"] > 0).all()
    assert (summary["tflops"] > 0).all() and (summary["n"] == TINY.repeats).all()


def test_a_failing_step_is_recorded_and_the_run_goes_on(monkeypatch, tmp_path):
    """Out of memory inside one variant's training step on the first model: recorded, and everything else runs."""
    real = loops.train_step

    def fail_for_b(model, batch, optimizer, scaler, config, device, micro_step, *rest):
        if config.amp_dtype == "bf16" and config.model == "resnet18":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        if config.amp_dtype == "bf16" and micro_step == 1:
            raise ValueError("something else broke\nsecond line")
        return real(model, batch, optimizer, scaler, config, device, micro_step, *rest)

    monkeypatch.setattr(loops, "train_step", fail_for_b)
    experiment = Experiment("oom", "one variant fails", "", variants=(("A", {}), ("B", {"amp_dtype": "bf16"})),
                            phases=("train",))
    profile = TINY.with_sizes(repeats=2)  # two: A's second repeat runs after B has failed
    result = run_experiment(experiment, models=["resnet18", "mobilenet_v2"], profile=profile, device="cpu",
                            progress=False, out=tmp_path, filename="oom.json")
    status = result.samples.groupby(["model", "variant"])["status"].agg(set)
    assert status[("resnet18", "A")] == {"ok"} and status[("mobilenet_v2", "A")] == {"ok"}
    assert status[("resnet18", "B")] == {"out of memory"}
    assert status[("mobilenet_v2", "B")] == {"failed: ValueError: something else broke"}
    verdicts = result.summary.set_index(["model", "variant"])["verdict"]
    assert verdicts[("resnet18", "B")] == "out of memory"
    stored = load_samples(tmp_path / "oom.json")
    assert set(stored["model"]) == {"resnet18", "mobilenet_v2"}
    assert len(stored[stored["status"] == "ok"]) == 2 * profile.repeats


def test_unknown_model_in_a_run():
    with pytest.raises(OptlabError, match="unknown model 'alexnet'"):
        run_experiment(AA, models=["alexnet"], profile=TINY, device="cpu", progress=False)


def test_output_folder_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OptlabError, match="cannot be written"):
        run_experiment(AA, profile=TINY, device="cpu", progress=False, out=blocker / "sub")


def test_experiment_needs_a_variant():
    with pytest.raises(OptlabError, match="needs a baseline and at least one variant"):
        Experiment("x", "x", "", variants=(("only", {}),))


def test_with_base_changes_every_variant_s_shared_knobs_and_leaves_the_registered_experiment_as_it_was():
    registered = get_experiment("channels_last")
    bf16 = registered.with_base(amp_dtype="bf16")
    profile = experiments.get_profile("smoke")
    configs = bf16.configs("resnet18", profile)
    assert [config.amp_dtype for config in configs.values()] == ["bf16", "bf16"]
    assert [config.channels_last for config in configs.values()] == [False, True]  # the variants' own knobs kept
    assert bf16.labels == registered.labels and bf16.phases == registered.phases
    assert {c.amp_dtype for c in registered.configs("resnet18", profile).values()} == {"fp16"}
    assert get_experiment("channels_last").base == {"amp_dtype": "fp16"}
