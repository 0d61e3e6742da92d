"""The summary's first screen: per workload, each technique's verdicts over its models summarised in one line, grouped
as faster, the same, slower, mixed or can't tell yet, beside the seed's V100 figure and each stored GPU reference."""
import pandas as pd
import pytest

from optlab.book import answer
from optlab.book.downloads import PAGE_RUNS
from optlab.core.results import store
from optlab.core.stats.summary import CONTROL

ROW = {"phase": "train", "machine": "cpu", "profile": "smoke", "role": "claim"}


def row(technique: str, variant: str, model: str, speedup: float, verdict: str, **extra) -> dict:
    return {**ROW, "technique": technique, "variant": variant, "model": model, "speedup": speedup,
            "verdict": verdict, **extra}


LIVE = pd.DataFrame([
    row("set_to_none", "w/o gradient none", "resnet18", 1.0, "baseline"),
    row("set_to_none", "w gradient none", "resnet18", 1.10, "faster"),  # the seed's V100: 1.025x on resnet18
    row("set_to_none", "w gradient none", "resnet50", 1.30, "faster"),  # the seed's V100: 1.014x on resnet50
    row("mixed_precision", "w mixed precision", "resnet18", 1.50, "faster"),
    row("mixed_precision", "w mixed precision", "mobilenet_v2", 0.96, "can't tell yet"),
    row("compile", "compile default", "resnet18", 0.80, "slower"),
    row("optimizers", "SGD fused", "resnet18", 1.001, "same within 2 %"),
    row("optimizers", "SGD fused", "resnet18", 1.2, "faster", phase="test", role=CONTROL),  # an A/A control
    row("no_grad", "w no_grad", "resnet18", 1.3, "faster", phase="test"),  # inference, as the seed timed it
    row("gpt_precision", "TF32", "gpt_tiny", float("nan"), "no effect on this device (TF32: a GPU format)"),
    row("attention", "SDPA flash", "gpt_tiny", 1.05, "faster", phase="test"),  # the GPT's inference: no workload
    row("tune", "+ bf16 autocast", "ViT (small)", 1.2, "faster"),  # not a registry technique
])
H200 = pd.DataFrame([
    row("set_to_none", "w gradient none", "resnet18", 1.02, "same within 2 %"),
    row("compile", "compile reduce-overhead", "resnet18", 2.5, "faster"),  # not run here
])


@pytest.fixture
def no_serving(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "LIVE_DIR", tmp_path / "live")
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path / "reference")
    return tmp_path


def lines(frame: pd.DataFrame, workload: str) -> pd.DataFrame:
    return frame[frame["workload"] == workload].set_index("line")


def test_each_workload_groups_its_techniques_by_verdict_with_the_seed_and_the_reference_beside(no_serving):
    frame = answer.answer_frame({"live": LIVE, "h200": H200})
    training = lines(frame, "CNN training")
    assert list(training["group"]) == ["faster", "the same", "slower", "mixed", "not run here"]  # GROUPS' order
    several = training.loc["set_to_none: w gradient none"]
    assert (several["here"], several["seed V100"]) == ("on 2 of 2 models, 1.10–1.30x", "1.01–1.02x")
    assert several["h200"] == "the same 1.02x (resnet18)"
    assert training.loc["compile: compile default", ["here", "seed V100", "h200"]].tolist() == [
        "0.800x (resnet18)", "", ""]  # beyond the seed: no seed figure; not in the reference: nothing beside
    assert training.loc["optimizers: SGD fused", "here"] == "1.00x (resnet18)"
    assert training.loc["mixed_precision: w mixed precision", "here"] == (
        "faster on 1 of 2 models (1.50x), can't tell yet on 1 (0.960x)")
    assert training.loc["mixed_precision: w mixed precision", "seed V100"] == "0.919–1.96x"  # its two models
    assert training.loc["compile: compile reduce-overhead", ["here", "h200"]].tolist() == [
        "", "faster 2.50x (resnet18)"]
    inference = lines(frame, "CNN inference")
    assert list(inference.index) == ["no_grad: w no_grad"]  # the control is no claim; the GPT's inference is left out
    assert inference.loc["no_grad: w no_grad", "seed V100"] == "1.00x"  # the seed's inference, not training
    gpt = lines(frame, "GPT training")
    assert (gpt.loc["gpt_precision: TF32", "group"], gpt.loc["gpt_precision: TF32", "here"]) == (
        "no effect here", "gpt_tiny")
    assert "tune: + bf16 autocast" not in set(frame["line"])


def test_a_workload_without_records_is_one_line_and_no_reference_means_no_column(no_serving):
    frame = answer.answer_frame({"live": LIVE[LIVE["technique"] == "set_to_none"]})
    assert list(frame["workload"]) == ["CNN training", "CNN inference", "GPT training", "serving"]
    assert list(frame["group"][1:]) == [answer.NO_RECORD] * 3
    assert "h200" not in frame.columns
    shown = answer.answer({"live": LIVE})
    page = shown._repr_html_()
    assert "<td colspan='2'>no record yet</td>" in page  # serving: one line, not an empty table
    assert "none stored yet" in page
    assert "<b>set_to_none</b>: w gradient none on 2 of 2 models, 1.10–1.30x" in page
    assert "[seed V100 1.01–1.02x; h200: the same 1.02x (resnet18)]" not in page  # no h200 here
    assert "[seed V100 1.01–1.02x]" in page


def test_serving_lines_come_from_the_kept_tables_live_and_stored(no_serving):
    pages = no_serving / "live" / PAGE_RUNS
    pages.mkdir(parents=True)
    pd.DataFrame({"variant": ["fp32 weights", "int8 weight-only", "fp32 weights", "int8 weight-only"],
                  "batch": [1, 1, 16, 16], "speed-up": [1.0, 0.79, 1.0, 0.26], "low": [None, 0.6, None, 0.2],
                  "high": [None, 1.01, None, 0.3], "verdict": ["reference", "can't tell yet", "reference", "slower"]}
                 ).to_csv(pages / "weight-only-quantization-decode-timings.csv", index=False)
    stored = no_serving / "reference" / "h200"
    stored.mkdir(parents=True)
    pd.DataFrame({"batch": [1, 2, 4], "throughput x": [1.0, 1.9, 3.6], "verdict": ["reference", "faster", "faster"]}
                 ).to_csv(stored / "serving-decode-sweep.csv", index=False)
    frame = answer.answer_frame({"live": pd.DataFrame(), "h200": pd.DataFrame()})
    serving = lines(frame, "serving")
    assert serving.loc["quantization: int8 weight-only", ["group", "here"]].tolist() == [
        "mixed", "slower on 1 of 2 batch sizes (0.260x), can't tell yet on 1 (0.790x)"]
    batched = serving.loc["batched decoding: throughput against batch 1"]
    assert (batched["group"], batched["here"], batched["h200"]) == (
        "not run here", "", "faster on 2 of 2 batch sizes, 1.90–3.60x")
    assert list(frame.loc[frame["workload"] != "serving", "group"]) == [answer.NO_RECORD] * 3


def test_a_kept_table_without_its_columns_names_them(no_serving):
    pages = no_serving / "live" / PAGE_RUNS
    pages.mkdir(parents=True)
    pd.DataFrame({"decode speed-up": [1.0, 2.0], "verdict": ["reference", "faster"]}).to_csv(
        pages / "kv-cache-and-compiled-decoding-timings.csv", index=False)
    with pytest.raises(ValueError, match="has no column 'variant'"):
        answer.serving_rows()


def test_the_brief_groups_name_each_technique_once_and_the_answering_ones_each_variant():
    frame = pd.DataFrame([
        {"workload": "CNN training", "group": group, "technique": "optimizers", "line": f"optimizers: {variant}",
         "here": f"{speedup}x (resnet18)", "seed V100": ""}
        for group, variant, speedup in (("faster", "SGD fused", 1.2), ("faster", "Adam fused", 1.1),
                                        ("can't tell yet", "SGD foreach", 1.0), ("can't tell yet", "Adam foreach", 0.9))])
    page = answer.Answer(frame)._repr_html_()
    assert "<b>optimizers</b>: SGD fused 1.2x (resnet18), Adam fused 1.1x (resnet18)" in page
    assert "<b>optimizers</b> (2 variants)" in page
    assert "SGD foreach" not in page
