"""benchmarks/answers.py counts, per record, the timed claims that end in a verdict: controls and untimed variants are
left out, and the share follows the verdicts."""
import sys
from pathlib import Path

import pytest

from optlab.core.results import store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from answers import answer_table, main  # noqa: E402


def _record(folder, name, rows):
    summary = [{"model": "m", "phase": "train", "variant": f"v{i}", "verdict": verdict, "noise": noise, "role": role}
               for i, (verdict, noise, role) in enumerate(rows)]
    store.save_record({"schema_version": store.SCHEMA_VERSION, "technique": name, "summary": summary, "samples": []},
                      folder, f"{name}.json")


def test_answered_claims_are_counted_and_controls_and_untimed_variants_are_not(tmp_path, capsys):
    _record(tmp_path, "a", [("baseline", None, "claim"), ("faster", 0.02, "claim"), ("can't tell yet", 0.08, "claim"),
                            ("same within 2 %", 0.01, "claim"), ("can't tell yet", 0.05, "A/A control"),
                            ("no effect on this device (x: why)", None, "claim")])
    _record(tmp_path, "b", [("baseline", None, "claim"), ("can't tell yet", 0.04, "claim")])
    table = answer_table(tmp_path).set_index("record")
    assert table.loc["a", ["timed", "answered"]].tolist() == [3, 2]
    assert table.loc["a", "median noise"] == pytest.approx(0.02)
    assert table.loc["b", "share answered"] == 0 and table.loc["all", "share answered"] == pytest.approx(2 / 4)
    assert main([str(tmp_path)]) == 0 and "67%" in capsys.readouterr().out
    assert main([str(tmp_path / "none")]) == 1


def test_the_overall_noise_is_the_median_of_the_records_not_their_mean(tmp_path):
    """Skewed noise: one round far noisier than the others within a record, and one record far noisier than the
    others. Medians stay with the typical round and record; a mean would be dragged up by the outliers."""
    _record(tmp_path, "a", [("faster", 0.01, "claim"), ("faster", 0.012, "claim"), ("faster", 0.2, "claim")])
    _record(tmp_path, "b", [("slower", 0.02, "claim")])
    _record(tmp_path, "c", [("faster", 0.3, "claim"), ("faster", 0.25, "claim"), ("faster", 0.4, "claim")])
    noise = answer_table(tmp_path).set_index("record")["median noise"]
    assert noise["a"] == pytest.approx(0.012) and noise["c"] == pytest.approx(0.3)
    assert noise["all"] == pytest.approx(0.02)  # the mean of the three would be 0.111
