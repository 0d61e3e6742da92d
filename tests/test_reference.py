"""The reference run sized to a lent GPU: the plan, the budget, resuming, and failures that stay in their part."""
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from optlab.commands import reference
from optlab.commands.reference import costs, parts_list, planning, running
from optlab.commands.cli import main
from optlab.core.run import experiments
from optlab.core.process import shutdown
from optlab.core.results import store
from optlab.core.errors import OptlabError
from optlab.core.knobs.profiles import get_profile
from optlab.core.techniques.registry import get_experiment
from optlab.core.techniques.cnn import SEED_TECHNIQUES, technique_set
from tests.helpers import TINY
from tests.test_experiments import AA

ROOT = Path(__file__).resolve().parent.parent
QUICK = get_profile("quick")
SHORT = TINY.with_sizes(steps=1, repeats=2)  # the fewest steps and repeats that still make a whole record


def test_the_plan_has_every_part_of_every_set_in_priority_order():
    parts = reference.plan("all", QUICK)
    techniques = list(dict.fromkeys(p.technique for p in parts if p.technique))
    assert techniques == [*SEED_TECHNIQUES, "precision", "data_pipeline", "optimizers", "all_together", "compile",
                          "cuda_graphs", *planning.TECHNIQUE_ORDER["transformer"]]
    assert set(planning.TECHNIQUE_ORDER["transformer"]) == set(technique_set("transformer"))
    assert [p.set_name for p in parts] == sorted((p.set_name for p in parts), key=planning.PRIORITY.index)
    assert {p.name for p in parts if p.module} == {f"{m} tables" for ms in planning.EXTRAS.values() for m in ms}
    assert "autotune tables" in {p.name for p in reference.plan("seed", QUICK)}
    assert all(p.steps > 0 for p in parts if p.technique) and all(p.estimate_s > 0 for p in parts)


def test_no_part_needs_more_than_four_minutes_and_compiling_is_cheap_enough():
    parts = reference.plan("all", QUICK)
    assert max(p.estimate_s for p in parts) <= planning.PART_LIMIT_S
    compiled = {p.model for p in parts if p.technique in ("compile", "cuda_graphs")}
    assert compiled == {"resnet18", "mobilenet_v2"}


def test_the_estimate_follows_the_step_time_table():
    """One model, one variant, train only: setup, then steps at the table's time, worker start-ups per repeat."""
    from optlab.core.techniques.registry import Experiment

    one = Experiment("one", "one", "", phases=("train",), variants=(("A", {}), ("B", {})))
    config = one.configs("resnet50", QUICK)["A"]
    steps, seconds = costs.estimate(one, {"A": config}, QUICK)
    per_repeat = QUICK.warmup_steps + QUICK.steps
    assert steps == per_repeat * QUICK.max_repeats  # planned at the cap on repeats
    expected = (costs.PART_SETUP_S + costs.VARIANT_SETUP_S
                + steps * costs.TRAIN_STEP_S["resnet50"] + QUICK.max_repeats * costs.WORKER_STARTUP_S)
    assert seconds == pytest.approx(expected)
    half = costs.step_seconds(replace(config, amp_dtype="bf16"), "train")
    assert half == pytest.approx(costs.TRAIN_STEP_S["resnet50"] / 2)


def test_a_gpt_step_is_estimated_per_token_by_what_its_configuration_changes():
    """The transformer set's parts come from the per-token costs: the same tokens per step cost the same in the
    matmuls however they are split into sequences, and attention's share falls with the length; the precision, the
    attention kernel, compilation and checkpointing each change the estimate in the direction they change the work."""
    shapes = get_experiment("gpt_shapes").configs("gpt2_small", QUICK)
    by_shape = {label: costs.token_costs(config) for label, config in shapes.items()}
    assert len({round(cost["matmul"], 15) for cost in by_shape.values()}) == 1
    attention = [cost["attention"] for cost in by_shape.values()][1:]  # padded vocabulary, 1024, 512 and 256 tokens
    assert attention == sorted(attention, reverse=True) and attention[0] == pytest.approx(4 * attention[-1])
    config = shapes[next(iter(shapes))]
    assert config.amp_dtype == "bf16"  # the GPU profiles train the GPT in bf16

    def per_token(**knobs) -> float:
        return sum(costs.token_costs(replace(config, **knobs)).values())

    assert per_token(amp_dtype="none") > per_token(amp_dtype="none", matmul_tf32=True) > per_token() > per_token(fp8=True)
    assert per_token(attention="manual") > per_token(attention="sdpa_efficient") > per_token(attention="sdpa")
    assert per_token(attention="flex") > per_token(attention="sdpa")
    assert per_token(checkpointing="full") > per_token(checkpointing="selective") > per_token()
    assert per_token(compile_mode="default") < per_token()
    assert costs.compile_seconds(replace(config, attention="flex"), "train") == costs.FLEX_COMPILE_S > 0
    assert costs.compile_seconds(replace(config, compile_mode="max-autotune-no-cudagraphs"), "train") > \
        costs.compile_seconds(replace(config, compile_mode="default"), "train") > 0
    for_loop, fused = (costs.step_seconds(replace(config, optimizer_impl=impl), "train")
                       for impl in ("for_loop", "fused"))
    assert for_loop > fused


def test_every_timed_gpt_configuration_that_changes_the_work_changes_the_estimate():
    for technique in ("gpt_all_together", "attention", "gpt_precision", "checkpointing", "gpt_optimizers",
                      "gpt_shapes", "gpt_compile", "gpt_compile_max_autotune"):
        configs = get_experiment(technique).configs("gpt2_small", QUICK)
        seconds = {label: (costs.step_seconds(config, "train"), costs.compile_seconds(config, "train"))
                   for label, config in configs.items()}
        same_work = [{"SDPA (PyTorch picks)", "SDPA flash"},  # PyTorch picks flash in bf16 on an H200
                     {"hand-written attention", "SDPA math"}]  # both write the scores out, kernel by kernel
        alike = sum(len(group) - 1 for group in same_work if group <= set(seconds))
        assert len(set(seconds.values())) == len(seconds) - alike, (technique, seconds)


def test_max_autotune_keeps_a_margin_inside_its_part_and_the_plan_says_what_it_assumes(capsys):
    parts = {part.name: part for part in reference.plan("transformer", QUICK)}
    autotune = parts["gpt_compile_max_autotune gpt2_small"]
    assert costs.GPT_COMPILE_S["max-autotune-no-cudagraphs"] < autotune.estimate_s
    assert autotune.estimate_s <= (1 - planning.PART_MARGIN) * planning.PART_LIMIT_S
    assert main(["reference", "--plan", "--set", "transformer", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assumed = out[out.index("assumptions per part"):]
    for name, part in parts.items():
        lines = assumed[assumed.index(f"{name}:\n"):].split("\n")[1:]
        for label in get_experiment(part.technique).labels:
            assert any(line.startswith(f"  {label}: ") and "us a token" in line for line in lines), (name, label)
    assert "flex, compile none, checkpointing none) + 3 ms AdamW foreach + 20 s compile" in assumed
    assert "warning" not in out


def test_the_estimate_stops_at_the_time_budget():
    """Repeats past the minimum start only while they fit the profile's time budget, which the rounds' compilation
    counts in: the plan counts the set-up and the budget, or the fewest repeats where they take longer."""
    from optlab.core.techniques.registry import Experiment

    one = Experiment("one", "one", "", phases=("train",), variants=(("A", {}), ("B", {})))
    configs = {"A": one.configs("resnet101", QUICK)["A"]}
    _, at_minimum = costs.estimate(one, configs, QUICK, QUICK.warmup_repeats + QUICK.repeats)
    _, unbounded = costs.estimate(one, configs, QUICK.with_sizes(time_budget_s=float("inf")))
    setup = costs.PART_SETUP_S + costs.VARIANT_SETUP_S
    assert unbounded > at_minimum + setup + 1
    for budget in (1.0, (at_minimum + unbounded) / 2 - setup):
        planned = costs.estimate(one, configs, QUICK.with_sizes(time_budget_s=budget))[1]
        assert planned == pytest.approx(max(at_minimum, setup + budget))


def test_the_seed_set_fits_a_nine_minute_command_at_three_repeats():
    seed = reference.plan("seed", QUICK.with_sizes(repeats=3, max_repeats=3))
    assert sum(p.estimate_s for p in seed) <= 540


def test_the_budget_skips_a_part_that_does_not_fit_and_runs_later_ones_that_do():
    parts = [parts_list.Part("seed", f"p{i}", 1, seconds) for i, seconds in enumerate((5, 10, 50, 20, 5))]
    budget = planning.STARTUP_S + planning.PACK_RESERVE_S + 35  # the start-up and the packing reserve come first
    table = planning.plan_table(parts, done={"p0"}, budget_s=budget, cuda=True)
    assert list(table["this run"]) == ["recorded: skip", "run", "left: over budget", "run", "run"]


def test_the_readme_recipe_runs_every_seed_technique_on_resnet18_first_and_fits_its_minutes(capsys):
    command = planning.RECIPE[0].split()
    assert command[:4] == ["python3", "-m", "optlab", "reference"]
    assert planning.RECIPE[0] in (ROOT / "book" / "using" / "gpu.md").read_text()
    assert main([*command[3:command.index("--archive")], "--plan", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("seed ")]
    first_nine = [row[1:3] for row in rows[:9]]
    assert sorted(technique for technique, _ in first_nine) == sorted(SEED_TECHNIQUES)
    assert {model for _, model in first_nine} == {"resnet18"}
    assert "set seed: 39 parts" in out and "cut: --budget" in out
    profile = QUICK.with_sizes(max_repeats=int(command[command.index("--max-repeats") + 1]))
    parts = reference.plan("seed", profile)
    table = planning.plan_table(parts, set(), float(command[command.index("--budget") + 1]), cuda=True)
    assert set(table["this run"]) == {"run"}, "on a GPU the recipe leaves parts of the seed set out"
    assert sum(p.estimate_s for p in parts) <= 8 * 60


def test_plan_on_the_command_line(capsys, tmp_path):
    assert main(["reference", "--plan", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(f"set {name}:" in out for name in planning.PRIORITY) and "est_s" in out and "estimate from" in out
    assert not list(tmp_path.iterdir())  # nothing ran


def test_a_budget_that_is_not_positive_is_one_line(capsys, tmp_path):
    assert main(["reference", "--device", "cpu", "--out", str(tmp_path), "--budget", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "optlab: error: --budget must be a positive number of seconds, got 0"


def test_a_budget_that_is_not_a_number_is_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        main(["reference", "--out", str(tmp_path), "--budget", "soon"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.startswith("optlab: error: argument --budget: invalid float value: 'soon'")
    assert "\n" not in err


def _two_parts(set_name, profile, measured=None):
    return [parts_list.Part("seed", f"{name} resnet18", 1, 1.0, technique=name, model="resnet18")
            for name in ("set_to_none", "no_grad")]


def test_a_second_run_skips_what_is_recorded_and_a_failing_part_stays_in_its_part(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(running, "plan", _two_parts)
    real = experiments.run_experiment

    def first_fails(name, **options):
        if name == "set_to_none":
            raise OptlabError("set_to_none broke")
        return real(name, **options)

    monkeypatch.setattr(running, "run_experiment", first_fails)
    with pytest.raises(OptlabError, match="these parts failed and have no new results: set_to_none resnet18"):
        list(reference.run_reference(tmp_path, profile=SHORT, device="cpu", progress=False))
    assert store.load_record(tmp_path / "no_grad.json")["technique"] == "no_grad"
    manifest = pd.read_csv(tmp_path / f"{parts_list.MANIFEST}.csv").set_index("part")
    assert manifest.loc["set_to_none resnet18", "status"].startswith("failed: OptlabError: set_to_none broke")
    assert manifest.loc["no_grad resnet18", "status"] == "ok"

    monkeypatch.setattr(running, "run_experiment", real)
    capsys.readouterr()
    ran = list(reference.run_reference(tmp_path, profile=SHORT, device="cpu", progress=False))
    assert [r.experiment.name for r in ran] == ["set_to_none"]  # the failed part again; the recorded one skipped
    assert "skipped 1 part(s) already recorded" in capsys.readouterr().out
    assert list(reference.run_reference(tmp_path, profile=SHORT, device="cpu", progress=False)) == []


def test_another_commit_or_profile_is_not_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(running, "plan", _two_parts)
    parts = _two_parts("seed", SHORT)
    list(reference.run_reference(tmp_path, profile=SHORT, device="cpu", progress=False))
    key = parts_list.run_key(planning.resolve_device("cpu"))
    assert parts_list.recorded(parts, tmp_path, key, SHORT) == {p.name for p in parts}
    assert parts_list.recorded(parts, tmp_path, {**key, "git_commit": "other"}, SHORT) == set()
    assert parts_list.recorded(parts, tmp_path, key, SHORT.with_sizes(repeats=4)) == set()


def test_a_budget_too_small_runs_nothing_and_says_what_it_left(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(running, "plan", _two_parts)
    assert list(reference.run_reference(tmp_path, profile=TINY, device="cpu", progress=False, budget_s=0.5)) == []
    out = capsys.readouterr().out
    assert "left for a later run (over --budget 0.5 s): set_to_none resnet18, no_grad resnet18" in out


def test_resume_keeps_the_recorded_models_and_runs_the_others(tmp_path, capsys):
    two = replace(SHORT, models=("resnet18", "mobilenet_v2"))
    first = experiments.run_experiment(AA, models=["resnet18"], profile=two, device="cpu", progress=False,
                                       out=tmp_path, filename="aa.json")
    both = experiments.run_experiment(AA, profile=two, device="cpu", progress=False, out=tmp_path,
                                      filename="aa.json", resume=True)
    assert "resumed: resnet18 already in" in capsys.readouterr().out
    kept = both.samples[both.samples["model"] == "resnet18"].reset_index(drop=True)
    assert kept["step_times_s"].tolist() == first.samples["step_times_s"].tolist()
    assert set(both.samples["model"]) == {"resnet18", "mobilenet_v2"}
    record = store.load_record(tmp_path / "aa.json")
    assert set(record["configs"]) == {"resnet18", "mobilenet_v2"} and len(record["samples"]) == len(both.samples)
    again = experiments.run_experiment(AA, profile=two, device="cpu", progress=False, out=tmp_path,
                                       filename="aa.json", resume=True)
    assert again.samples["step_times_s"].tolist() == both.samples["step_times_s"].tolist()  # nothing ran


@pytest.mark.parametrize("technique, model", [("set_to_none", "resnet18"), ("multiple_of_8", "mobilenet_v2")])
def test_the_plans_step_counts_are_the_steps_a_run_takes(technique, model):
    """multiple_of_8 on MobileNetV2 runs the seed's pair only: the plan must count what the run does."""
    experiment = planning.get_experiment(technique)
    planned, _ = costs.estimate(experiment, experiment.configs(model, TINY), TINY)
    result = experiments.run_experiment(technique, models=[model], profile=TINY, device="cpu", progress=False)
    ran = sum(len(row["warmup_times_s"]) + len(row["step_times_s"]) for _, row in result.samples.iterrows())
    assert ran == planned


def test_a_deadline_stops_a_slow_part_at_a_repeat_and_skips_a_part_that_does_not_fit(monkeypatch, tmp_path):
    """On a fake clock where every phase of a variant takes 5 s, under --budget 200: set_to_none (estimated 30 s, so
    a share of 55 s; rounds of two variants, train and test: 20 s) stops after 2 rounds of the profile's minimum of 4;
    no_grad (500 s) is skipped; gradient_accumulation (20 s, a share of 40 s; two variants: 20 s rounds) still runs,
    and stops after two rounds."""
    clock = {"t": 0.0}
    monkeypatch.setattr(shutdown, "now", lambda: clock["t"])
    monkeypatch.setattr(shutdown, "PROCESS_START", 0.0)
    real_phase = experiments.run_variant_phase

    def slow_phase(*args, **kwargs):
        clock["t"] += 5.0
        return real_phase(*args, **kwargs)

    monkeypatch.setattr(experiments, "run_variant_phase", slow_phase)
    monkeypatch.setattr(running, "plan", lambda set_name, profile, measured=None: [
        parts_list.Part("seed", f"{name} resnet18", 1, seconds, technique=name, model="resnet18")
        for name, seconds in (("set_to_none", 30.0), ("no_grad", 500.0), ("gradient_accumulation", 20.0))])
    profile = TINY.with_sizes(steps=1, repeats=4, max_repeats=8)  # the clock is fake: one real step is enough
    ran = list(reference.run_reference(tmp_path, profile=profile, device="cpu", progress=False, budget_s=200))
    assert [r.experiment.name for r in ran] == ["set_to_none", "gradient_accumulation"]
    rows = pd.read_csv(tmp_path / f"{parts_list.MANIFEST}.csv").set_index("part")
    for part, share, repeats, seconds in (("set_to_none", 30 * 1.5 + 10, 2, 40.0),
                                          ("gradient_accumulation", 20 * 1.5 + 10, 2, 40.0)):
        rounds = store.load_record(tmp_path / f"{part}.json")["rounds"]["resnet18"]
        assert {key: rounds[key] for key in ("repeats", "stopped")} == {"repeats": repeats,
                                                                          "stopped": "at the run's deadline"}
        assert rows.loc[f"{part} resnet18", "seconds"] == seconds <= share  # ended at a repeat, within its share
        assert rows.loc[f"{part} resnet18", "repeats"] == repeats
    assert "no_grad resnet18" not in rows.index and clock["t"] == 80.0 < 200 - planning.PACK_RESERVE_S


class _SlowStudy:
    """A study whose tables take far past their estimate: one written at once, then a wait of 30 s."""

    @staticmethod
    def run_reference(out, device):
        written = Path(out) / "slow-first.csv"
        written.write_text("a\n1\n")
        yield written
        time.sleep(30)
        yield Path(out) / "slow-never.csv"


class _QuickStudy:
    @staticmethod
    def run_reference(out, device):
        written = Path(out) / "quick.csv"
        written.write_text("a\n1\n")
        return [written]


def test_a_study_past_its_deadline_is_ended_there_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    """A study's tables (the ceilings on a GPU, say) estimated at 0.2 s that would run 30 s: its deadline (1.5 x the
    estimate + 1 s here) ends it within 10 s, what it wrote before is kept, its row says so, and the next part runs."""
    monkeypatch.setattr(planning, "SHARE_SLACK_S", 1.0)
    monkeypatch.setattr(running, "plan", lambda set_name, profile, measured=None: [
        parts_list.Part("seed", f"{name} tables", 0, 0.2, module=name) for name in ("slow", "quick")])
    monkeypatch.setattr(running, "study", {"slow": _SlowStudy, "quick": _QuickStudy}.get)
    began = time.monotonic()
    with pytest.raises(OptlabError, match="ran past their deadline and were ended there, what they wrote before kept: "
                                          "slow tables"):
        list(reference.run_reference(tmp_path, profile=SHORT, device="cpu", progress=False))
    assert time.monotonic() - began < 1.3 + 10
    rows = pd.read_csv(tmp_path / f"{parts_list.MANIFEST}.csv").set_index("part")
    assert rows.loc["slow tables", "status"] == "stopped: past its deadline of 1 s" and rows.loc["quick tables",
                                                                                                   "status"] == "ok"
    assert rows.loc["slow tables", "seconds"] < 10
    assert (tmp_path / "slow-first.csv").is_file() and (tmp_path / "quick.csv").is_file()
    assert "stopped part slow tables: past its deadline of 1 s" in (tmp_path / "reference.log").read_text()


def test_the_plan_gives_every_part_a_deadline_inside_its_command(capsys):
    """Without a budget a part's deadline is at most PART_LIMIT_S (inside a 10-minute command); with one, inside what
    the budget leaves for parts."""
    for budget in (None, 230):
        text = planning.describe_plan("all", device="cpu", budget_s=budget)
        table = pd.read_fwf(__import__("io").StringIO(text.split("\n\n")[0].split("\n", 1)[1]))
        limit = planning.PART_LIMIT_S if budget is None else planning.available_s(budget)
        assert table["deadline_s"].between(1, limit).all() and len(table) > 50, (budget, table["deadline_s"].max())
