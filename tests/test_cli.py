import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optlab.commands.cli import main
from optlab.core.techniques import SEED_TECHNIQUES

ROOT = Path(__file__).resolve().parent.parent


def test_list_shows_the_nine_seed_techniques(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SEED_TECHNIQUES)


@pytest.mark.parametrize("argv, message", [
    (["run", "turbo"], "unknown technique 'turbo'"),
    (["run", "set_to_none", "--models", "alexnet"], "unknown model 'alexnet'"),
    (["run", "set_to_none", "--profile", "fast"], "unknown profile 'fast'"),
    (["run", "set_to_none", "--batch-size", "0"], "batch_size must be at least 1, got 0"),
    (["run", "set_to_none", "--num-workers", "-2"], "num_workers must be at least 0, got -2"),
    (["run", "set_to_none", "--device", "tpu"], "unknown device 'tpu'"),
    (["reference", "--set", "everything"], "unknown technique set 'everything'"),
])
def test_bad_input_is_one_line_not_a_traceback(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optlab: error: ") and message in err and "\n" not in err


def test_run_prints_a_comparison_and_writes_a_record(tmp_path):
    # the README's example, as a user would type it, from a plain checkout with PYTHONPATH
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "optlab", "run", "mixed_precision", "--models", "resnet18", "--profile", "smoke",
         "--out", str(tmp_path), "--quiet", "--repeats", "2", "--max-repeats", "2", "--batch-size", "4", "--steps",
         "1"],  # 16-bit autocast is slow on a CPU: the fewest images and steps that still print a whole comparison
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "profile smoke" in done.stdout and "data source: stand-in" in done.stdout
    assert "; batch 4; " in done.stdout, "the header names the batch size typed, not the profile's"
    assert "speed-up (99.5 % sequential interval)" in done.stdout and "w mixed precision" in done.stdout
    assert "compared with" in done.stdout and "resnet18: " in done.stdout and " repeats, stopped " in done.stdout
    verdicts = {row["verdict"] for row in json.loads(next(tmp_path.glob("*.json")).read_text())["summary"]}
    assert verdicts <= {"baseline", "faster", "slower", "same within 2 %", "can't tell yet"}
    (path,) = tmp_path.glob("mixed_precision-*.json")
    record = json.loads(path.read_text())
    assert record["technique"] == "mixed_precision" and record["profile"]["name"] == "smoke"
    assert {row["model"] for row in record["summary"]} == {"resnet18"}
