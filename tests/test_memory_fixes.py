"""The memory fixes: each moves the category of the breakdown it should, and the checks say so when one is broken
(set_to_none made a no-op, checkpointing that saves everything, categories that do not add up); the arithmetic beside
the measurement; what needs a GPU says so in one line on a CPU; bad input ends in one line."""
import gzip
import json
import os
import re
from dataclasses import replace
from functools import cache
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from optlab.core.process.children import child_environment
from optlab.core.results import store
from children import WITHOUT_INSTALLED_OPTLAB
from optlab.core.gpt import transformer
from optlab.core.errors import OptlabError
from optlab.core.gpt.transformer import GPT, GPTConfig
from optlab.studies.memory import downloads, fixes

SMALL = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=32)
CHECKPOINTING = (fixes.BASELINE, "checkpointing full", "checkpointing selective")
SET_TO_NONE = (fixes.BASELINE, "set_to_none=False")


def small_gpt() -> fixes.Subject:
    """A GPT small enough that a profiled step takes a moment, with the activations still most of its peak (two
    blocks: with one, recomputing it in the backward rebuilds all it saved, and checkpointing cannot lower the peak)."""
    def batch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(SMALL.vocab_size, (n, SMALL.block_size + 1), generator=torch.Generator().manual_seed(n))
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    return fixes.Subject("small GPT", lambda checkpointing: GPT(SMALL, checkpointing=checkpointing), batch,
                         fixes.next_token_loss, batch_size=8, checkpointing=True)


def study(labels: tuple[str, ...]) -> fixes.FixStudy:
    return fixes.study_fixes(small_gpt(), "cpu", rounds=2, steps=1, labels=labels)


@cache
def unbroken(labels: tuple[str, ...]) -> fixes.FixStudy:
    return study(labels)


def failing(found: fixes.FixStudy) -> set[str]:
    return {line.split(":")[0] for line in fixes.fix_failures(found)}


def test_set_to_none_lowers_the_gradients_at_the_peak():
    found = unbroken(SET_TO_NONE)
    row = found.table().loc["set_to_none"]
    assert row["category MiB after"] < row["category MiB before"] and row["peak MiB after"] < row["peak MiB before"]
    assert "set_to_none" not in failing(found)


def test_a_set_to_none_that_keeps_the_gradients_is_caught(monkeypatch):
    keep = torch.optim.Optimizer.zero_grad
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", lambda self, set_to_none=True: keep(self, False))
    assert "set_to_none" in failing(study(SET_TO_NONE))


def test_checkpointing_lowers_the_activations_full_below_selective():
    table = unbroken(CHECKPOINTING).table()
    after = table["category MiB after"]
    assert after["checkpointing (full)"] < after["checkpointing (selective)"] < table["category MiB before"].iloc[1]
    assert not failing(unbroken(CHECKPOINTING))


def test_checkpointing_that_saves_everything_is_caught(monkeypatch):
    monkeypatch.setattr(transformer, "checkpoint", lambda block, x, **options: block(x))  # no recomputation
    monkeypatch.setattr(transformer, "save_matmuls_policy", lambda *args, **kwargs: CheckpointPolicy.MUST_SAVE)
    assert {"checkpointing (full)", "checkpointing (selective)"} <= failing(study(CHECKPOINTING))


def test_categories_that_do_not_add_up_are_caught():
    found = unbroken(SET_TO_NONE)
    assert all(b.adds_up() for b in found.breakdowns.values())
    base = found.breakdowns[fixes.BASELINE]
    dropped = replace(base, categories={name: size for name, size in base.categories.items() if name != "activation"})
    broken = replace(found, breakdowns={**found.breakdowns, fixes.BASELINE: dropped})
    assert any("add up" in line for line in fixes.fix_failures(broken))


def test_the_optimizers_move_their_step_temporaries():
    found = unbroken((fixes.BASELINE, "foreach AdamW", "fused AdamW"))
    table = found.table()
    assert table.loc["foreach AdamW", "category MiB after"] > table.loc["foreach AdamW", "category MiB before"]
    assert table.loc["fused AdamW", "category MiB after"] < table.loc["fused AdamW", "category MiB before"]
    weights = {b.categories["parameter"] for b in found.breakdowns.values()}
    assert len(weights) == 1 and not failing(found)


def test_a_fix_not_studied_says_so_and_has_no_numbers():
    table = unbroken(SET_TO_NONE).table()
    assert table.loc["bf16 autocast", "not measured"] == "not in this study"
    assert pd.isna(table.loc["bf16 autocast", "speed-up"])
    assert table.loc["set_to_none", "verdict"] in {"faster", "slower", "same within 2 %", "can't tell yet"}


def test_the_arithmetic_agrees_and_a_wrong_count_does_not():
    step = unbroken(SET_TO_NONE).breakdowns[fixes.BASELINE]
    count = fixes.arithmetic(step)
    assert count["agrees"].all(), count
    assert (count.loc[["parameter", "optimizer_state", "gradient"], "difference"] == 0).all()
    wrong = replace(step, expected={**step.expected, "optimizer_state": step.expected["optimizer_state"] // 2})
    assert not fixes.arithmetic(wrong).loc["optimizer_state", "agrees"]


def test_the_timings_read_a_clear_slowdown():
    timings = fixes.Timings({"a": [1.0, 1.01, 0.99, 1.0], "b": [2.0, 2.02, 1.98, 2.01]},
                            {"a": [0, 1, 0, 1], "b": [1, 0, 1, 0]})
    cost = timings.cost("a", "b")
    assert cost.ratio == pytest.approx(0.5, rel=0.02) and cost.verdict == "slower"


def test_what_needs_a_gpu_says_so_on_a_cpu():
    assert "GPU" in fixes.allocator_table("cpu")
    assert fixes.largest_batches(small_gpt(), "cpu").startswith("not bounded on a CPU")


def test_fsdp2_leaves_each_rank_its_share():
    shares = fixes.sharded_share(small_gpt(), world_sizes=(1, 2))
    assert shares.loc[2, "share of one rank"] == pytest.approx(0.5, abs=0.01)
    with pytest.raises(OptlabError, match="sharding needs a model with a non-empty .blocks nn.ModuleList, got ResNet"):
        fixes.sharded_share(fixes.cnn_subject(False))


def test_a_subject_says_which_settings_do_not_apply():
    cnn = fixes.cnn_subject(False)
    assert "no checkpointing knob" in cnn.applies(fixes.SETTINGS["checkpointing full"])
    assert cnn.applies(fixes.SETTINGS[fixes.BASELINE]) is None
    odd = replace(small_gpt(), batch_size=3)
    assert "does not split into 2" in odd.applies(fixes.SETTINGS["2 micro-batches"])


@pytest.mark.parametrize("make, message", [
    (lambda: fixes.Setting(checkpointing="half"), "unknown checkpointing 'half'; choose one of"),
    (lambda: fixes.Setting(optimizer="sgd"), "unknown AdamW implementation 'sgd'; choose one of"),
    (lambda: fixes.Setting(accumulation=0), "accumulation must be at least 1"),
    (lambda: fixes.Setting(accumulation=65), "accumulation 65 is more than this run can use: at most 64"),
    (lambda: fixes.study_fixes(small_gpt(), "cpu", labels=("faster",)), "unknown setting 'faster'"),
    (lambda: fixes.study_fixes(small_gpt(), "cpu", labels=("fused AdamW",)), "must include 'baseline'"),
    (lambda: fixes.time_settings(small_gpt(), {}, torch.device("cpu"), rounds=1), "rounds must be at least 2"),
    (lambda: fixes.time_settings(small_gpt(), {}, torch.device("cpu"), rounds=201), "at most 200"),
    (lambda: fixes.gpt_subject(False, batch_size=5000), "batch size 5000 is more than this run can use"),
    (lambda: fixes.largest_batches(small_gpt(), "cpu", labels=("huge",)), "unknown setting 'huge'"),
    (lambda: fixes.largest_batches(small_gpt(), "cpu", limit=0), "batch limit must be a whole number from 1"),
    (lambda: fixes.allocator_table("cpu", steps=0), "steps must be at least 1"),
])
def test_bad_input_ends_in_one_line(make, message):
    with pytest.raises(OptlabError, match=message) as error:
        make()
    assert "\n" not in str(error.value)


def test_the_timeline_download_is_gzipped_json_beside_the_records(tmp_path):
    step = unbroken(SET_TO_NONE).breakdowns[fixes.BASELINE]
    path = downloads.save_timeline(step, tmp_path / "pages" / "timeline.json.gz")
    record = json.loads(gzip.decompress(path.read_bytes()))
    assert record["peak_bytes"] == step.peak_bytes and len(record["timeline"]) == len(step.timeline)
    assert store.record_paths(tmp_path) == []  # not read as a run's record
    assert downloads.save_snapshot(step, tmp_path / "snapshot.pickle") is None  # a CPU has no allocator snapshot
    with pytest.raises(OptlabError, match="ending in .json.gz, not 'timeline.json'"):
        downloads.save_timeline(step, tmp_path / "timeline.json")
    with pytest.raises(OptlabError, match="ending in .pickle, not 'snapshot.pkl'"):
        downloads.save_snapshot(step, tmp_path / "snapshot.pkl")


def test_a_child_process_imports_this_optlab_from_a_chapters_folder(monkeypatch):
    """The allocator comparison's child inherits ``PYTHONPATH=.`` while the working folder is notebooks/ (as the
    book's runs start it): it must still import the optlab that started it, not another one or none."""
    import optlab

    root = Path(optlab.__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", ".")
    monkeypatch.chdir(root / "notebooks")
    done = fixes.run_python(f"{WITHOUT_INSTALLED_OPTLAB}; import optlab.studies.memory.fixes, optlab; print(optlab.__file__)",
                            {})
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == Path(optlab.__file__).resolve()
    entries = child_environment({"X": "1"})["PYTHONPATH"].split(os.pathsep)
    assert entries == [str(root), str(root / "notebooks")] and all(Path(entry).is_absolute() for entry in entries)


def test_only_the_kept_setting_records_an_allocator_snapshot(monkeypatch):
    """Recording the allocator's history costs time on a GPU; the page keeps the baseline's snapshot only."""
    asked = []
    measure = fixes.step_breakdown

    def recorded(*args, **options):
        asked.append(options["snapshot"])
        return measure(*args, **options)

    monkeypatch.setattr(fixes, "step_breakdown", recorded)
    found = study(SET_TO_NONE)
    assert list(found.breakdowns) == [fixes.BASELINE, "set_to_none=False"] and asked == [True, False]


def test_checkpointing_is_read_at_the_forwards_end_with_the_peak_beside():
    """At the peak a checkpointed block's recomputed tensors are back (and partly counted as another category): the
    activations are read where checkpointing acts, the forward's end, and the peak is in the same row."""
    found = unbroken(CHECKPOINTING)
    table = found.table()
    for name, label in (("checkpointing (full)", "checkpointing full"), (fixes.BASELINE, fixes.BASELINE)):
        at_end = found.breakdowns[label].at_end_of("forward")["activation"] / fixes.MiB
        column = "category MiB before" if label == fixes.BASELINE else "category MiB after"
        assert table.loc["checkpointing (full)", column] == pytest.approx(at_end)
    assert set(table.loc[["checkpointing (full)", "checkpointing (selective)"], "measured at"]) == {"the forward's end"}
    assert table.loc["checkpointing (full)", "peak MiB after"] < table.loc["checkpointing (full)", "peak MiB before"]
    assert {fix.name for fix in fixes.FIXES if fix.at_end_of == "forward"} == {
        "checkpointing (full)", "checkpointing (selective)", "bf16 autocast", "gradient accumulation"}


def test_an_interval_too_wide_to_read_is_not_printed_or_drawn():
    found = unbroken(SET_TO_NONE)
    wild = fixes.Timings({fixes.BASELINE: [1.0, 1.0, 1.0, 1.0], "set_to_none=False": [0.01, 9.0, 0.02, 7.0]},
                         {fixes.BASELINE: [0, 1, 0, 1], "set_to_none=False": [1, 0, 1, 0]})
    noisy = replace(found, timings=wild)
    row = noisy.table().loc["set_to_none"]
    assert row["interval"] == "too wide to tell (4 rounds)" and row["verdict"] == "can't tell yet"
    drawn = noisy.speedups().set_index("variant").loc["set_to_none"]
    assert pd.isna(drawn["ci_low"]) and pd.isna(drawn["ci_high"]) and drawn["speedup"] > 0
    said = fixes.fix_sentence("set_to_none", row)
    assert "(can't tell yet, interval too wide to tell (4 rounds))" in said and not re.search(r"\d-\d", said)


def test_each_fix_is_said_as_its_numbers_and_verdict_have_it():
    found = unbroken(SET_TO_NONE)
    [line] = found.describe()
    row = found.table().loc["set_to_none"]
    assert line.startswith(f"set_to_none: gradient {row['category MiB before']:.3g} -> {row['category MiB after']:.3g} "
                           "MiB at the step's peak")
    assert f"({row['verdict']}" in line and f"the peak {row['peak MiB before']:.3g} -> " in line


def test_the_summary_rows_come_from_the_stored_tables(tmp_path):
    found = unbroken(SET_TO_NONE)
    live, reference = tmp_path / "live", tmp_path / "reference" / "h200"
    for folder in (live, reference):
        store.save_table(found.record_table(), folder, fixes.SUMMARY_TABLE)
    rows = fixes.summary_rows(reference_dir=tmp_path / "reference", live_dir=live)
    assert list(rows.columns) == fixes.SUMMARY_COLUMNS and list(rows["source"]) == ["h200", "live"]
    assert set(rows["fix"]) == {"set_to_none"} and set(rows["model"]) == {"small GPT"}  # not-measured rows left out
    table = found.table().loc["set_to_none"]
    assert rows.loc[0, "peak change"] == pytest.approx(table["peak MiB after"] / table["peak MiB before"] - 1)
    assert rows.loc[0, "peak change"] < 0 and rows.loc[0, "category change"] < 0
    empty = fixes.summary_rows(reference_dir=tmp_path / "none", live_dir=tmp_path / "none")
    assert empty.empty and list(empty.columns) == fixes.SUMMARY_COLUMNS


def test_torchs_future_warning_about_hooks_does_not_reach_the_reader():
    """Saved-tensor hooks around selective checkpointing make torch warn about a future default under every cell
    that counts saved tensors or runs MemTracker; the page does not show it."""
    import warnings

    from optlab.studies.memory import saved_activations, tracked_peak

    torch.manual_seed(0)
    subject = small_gpt()
    model = subject.build("selective")
    batch = subject.batch(4, torch.device("cpu"))
    optimizer = fixes.make_optimizer(model, "for_loop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert saved_activations(model, batch, subject.loss, None)["bytes"].sum() > 0
        assert tracked_peak(model, batch, subject.loss, optimizer, device="cpu")["total"] > 0
    assert not [str(w.message)[:80] for w in caught if issubclass(w.category, FutureWarning)]
