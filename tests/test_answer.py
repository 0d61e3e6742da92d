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
    row("optimizers", "Adam fused", "resnet50", 2.5, "faster"),  # not run here
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
    several = training.loc["set_to_none"]  # its one variant: the technique names the line
    assert (several["here"], several["seed V100"]) == ("on 2 of 2 models, 1.10–1.30x", "1.01–1.02x")
    assert several["h200"] == "the same 1.02x"  # the reference's group and range
    assert training.loc["compile", ["here", "seed V100", "h200"]].tolist() == [
        "0.800x (resnet18)", "", ""]  # beyond the seed: no seed figure; not in the reference: nothing beside
    assert training.loc["optimizers: SGD fused", "here"] == "1.00x (resnet18)"
    mixed = training.loc["mixed_precision: w mixed precision"]
    assert (mixed["here"], mixed["seed V100"]) == ("of 2 models: faster 1.50x, can't tell yet 0.960x", "0.919–1.96x")
    assert training.loc["optimizers: Adam fused", ["here", "h200"]].tolist() == ["", "faster 2.50x"]
    assert set(training["on"]) == {"mobilenet_v2, resnet18, resnet50"}  # a line on fewer models names them
    inference = lines(frame, "CNN inference")
    assert list(inference.index) == ["no_grad: w no_grad"]  # the control is no claim; the GPT's inference is left out
    assert inference.loc["no_grad: w no_grad", ["here", "seed V100"]].tolist() == ["1.30x", "1.00x"]  # the seed's test
    gpt = lines(frame, "GPT training")
    assert gpt.loc["gpt_precision: TF32", ["on", "group", "here"]].tolist() == ["gpt_tiny", "no effect here", ""]
    assert not any(line.startswith("tune") for line in frame["line"])


def test_lines_on_every_model_of_their_workload_leave_the_models_to_its_heading(no_serving):
    live = pd.DataFrame([row("set_to_none", "w gradient none", model, speedup, verdict)
                         for model, speedup, verdict in (("resnet18", 1.1, "faster"), ("mobilenet_v2", 1.3, "faster"))]
                        + [row("compile", "compile default", "resnet18", 1.2, "faster"),
                           row("compile", "compile default", "mobilenet_v2", 0.9, "slower")])
    training = lines(answer.answer_frame({"live": live}), "CNN training")
    assert training.loc["set_to_none", ["on", "here"]].tolist() == ["mobilenet_v2, resnet18", "1.10–1.30x"]
    assert training.loc["compile", "here"] == "faster 1.20x, slower 0.900x"


def test_a_workload_without_records_is_one_line_and_no_reference_means_no_column(no_serving):
    frame = answer.answer_frame({"live": LIVE[LIVE["technique"] == "set_to_none"]})
    assert list(frame["workload"]) == ["CNN training", "CNN inference", "GPT training", "serving"]
    assert list(frame["group"][1:]) == [answer.NO_RECORD] * 3
    assert "h200" not in frame.columns
    page = answer.answer({"live": LIVE})._repr_html_()
    assert "<tr><th>serving</th><td>no record yet</td></tr>" in page  # one line, not an empty table
    assert "none stored yet" in page
    assert ("<b>set_to_none</b> on 2 of 2 models, 1.10–1.30x "
            "<span class='optlab-beside'>[V100 1.01–1.02x]</span>") in page
    assert "<b style='color: #0173b2'>faster</b>: " in page  # coloured as the figures colour the verdict
    assert "<th>GPT training<div class='optlab-answer-on'>on gpt_tiny</div></th>" in page


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
        "mixed", "of 2 batch sizes: slower 0.260x, can't tell yet 0.790x"]
    batched = serving.loc["batching (throughput against batch 1)"]
    assert (batched["group"], batched["here"], batched["h200"]) == ("not run here", "", "faster 1.90–3.60x")
    assert list(frame.loc[frame["workload"] != "serving", "group"]) == [answer.NO_RECORD] * 3


def test_a_kept_table_without_its_columns_names_them(no_serving):
    pages = no_serving / "live" / PAGE_RUNS
    pages.mkdir(parents=True)
    pd.DataFrame({"decode speed-up": [1.0, 2.0], "verdict": ["reference", "faster"]}).to_csv(
        pages / "kv-cache-and-compiled-decoding-timings.csv", index=False)
    with pytest.raises(ValueError, match="has no column 'variant'"):
        answer.serving_rows()


def figures(group: str, variant: str, low: float, high: float, seed: float = float("nan")) -> dict:
    return {"workload": "CNN training", "on": "", "group": group, "technique": "optimizers",
            "line": f"optimizers: {variant}", "here": f"{low:.2f}x", "seed V100": "", "low": low, "high": high,
            "seed low": seed, "seed high": seed}


def test_many_variants_of_a_technique_in_one_group_are_counted_with_their_range():
    frame = pd.DataFrame([figures("faster", "SGD fused", 1.2, 1.3), figures("faster", "Adam fused", 1.1, 1.15),
                          figures("slower", "SGD foreach", 0.8, 0.8), figures("slower", "Adam foreach", 0.7, 0.75),
                          figures("slower", "Adam for-loop", 0.5, 0.6, seed=1.5),
                          figures("can't tell yet", "SGD for-loop", 1.0, 1.0, seed=1.7),
                          figures("mixed", "Lion", 0.9, 1.4),
                          figures("mixed", "Lion fused", 0.95, 1.5)])
    page = answer.Answer(frame)._repr_html_()
    assert "<b>optimizers</b> (2 variants, 1.10–1.30x)</div>" in page  # two: counted with their range
    three = "<b>optimizers</b> (3 variants, 0.500–0.800x) <span class='optlab-beside'>[V100 1.50x]</span>"
    assert three in page  # three: counted
    # the groups with no one answer share one line; no answer: the technique named, no figure of ours
    assert ("<div><i>can&#x27;t tell yet</i>: <b>optimizers</b> <span class='optlab-beside'>[V100 1.70x]</span>; "
            "<i>mixed</i>: <b>optimizers</b> (2)</div>") in page


def test_counted_variants_keep_the_seed_and_each_reference_beside(no_serving):
    stored = pd.DataFrame([row("optimizers", variant, "resnet18", speedup, "faster")
                           for variant, speedup in (("SGD foreach", 1.1), ("SGD fused", 1.4), ("Adam fused", 1.9))])
    shown = answer.answer({"live": pd.DataFrame(), "h200": stored})
    page = shown._repr_html_()
    assert shown.machines == ["h200"]
    assert ("<b>optimizers</b> (3 variants) <span class='optlab-beside'>[h200: 1.10–1.90x]</span>" in page)
    assert "GPU reference (h200)" in page
