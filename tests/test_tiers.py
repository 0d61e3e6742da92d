"""`make check`, the fast tier, selects every test but the full tier's: no chapter run, no test that reads the book or
opens it in a browser, none that runs processes of its own beside the book's build (tests/conftest.py marks them
``slow`` as they are collected, so a new test is fast unless it needs one of those)."""
import gc
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import conftest

ROOT = Path(__file__).resolve().parent.parent


def full_tier_reasons(test: dict) -> list[str]:
    """Why a collected test (tests/tier_record.py's description) belongs to the full tier only, if it does."""
    reasons = ["needs the book fixture"] * ("book" in test["fixtures"])
    reasons += ["runs a chapter"] * (test["name"] == conftest.CHAPTER_TEST)
    reasons += ["opens the book in a browser"] * (test["file"] == "test_browser.py")
    reasons += [f"is marked {conftest.BESIDE_BUILD}"] * (conftest.BESIDE_BUILD in test["markers"])
    return reasons


def check_command() -> list[str]:
    """`make check`'s pytest command line, as the Makefile writes it, with this Python."""
    printed = subprocess.run(["make", "-s", "-n", "-o", ".venv/.installed", "check", f"PY={sys.executable}"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return shlex.split(printed.strip())


@pytest.mark.beside_the_book_build  # collects the whole suite in a process of its own: it fills the wait for the book
def test_make_check_collects_no_chapter_book_browser_or_process_heavy_test(tmp_path):
    record = tmp_path / "tiers.json"
    command = [*check_command(), "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "tests.tier_record"]
    collected = subprocess.run(command, cwd=ROOT, env={**conftest.SMOKE_ENV, "OPTLAB_TIER_RECORD": str(record)},
                               capture_output=True, text=True)
    assert collected.returncode == 0, collected.stdout[-4000:] + collected.stderr[-4000:]
    tiers = json.loads(record.read_text())
    in_check = {test["nodeid"]: reasons for test in tiers["selected"] if (reasons := full_tier_reasons(test))}
    assert not in_check, f"make check would run {len(in_check)} of the full tier's tests: {dict(list(in_check.items())[:5])}"
    left_out = [test for test in tiers["deselected"] if full_tier_reasons(test)]
    chapters = {test["nodeid"] for test in left_out if test["name"] == conftest.CHAPTER_TEST}
    assert len(chapters) == len(list((ROOT / "notebooks").glob("*.ipynb"))), "not every chapter's test was left out"
    assert {"test_book.py", "test_browser.py"} <= {test["file"] for test in left_out}
    assert len(tiers["selected"]) > len(tiers["deselected"]), "the fast tier should hold most of the tests"


@pytest.mark.parametrize("quota, workers", [(None, 16), ("max 100000", 16), ("200000 100000", 2),
                                             ("150000 100000", 1), ("50000 100000", 1), ("3200000 100000", 16)])
def test_auto_workers_are_capped_by_the_container_s_cpu_quota(quota, workers):
    assert conftest.cores_in_quota(16, quota) == workers


def test_what_the_collection_built_is_out_of_the_garbage_collector_s_reach():
    """Both tiers' processes froze the collection's objects (tests/conftest.py): a full collection walks only what the
    tests made since, not the modules the collection imported and the tests themselves (this function among them)."""
    itself = test_what_the_collection_built_is_out_of_the_garbage_collector_s_reach
    assert gc.get_freeze_count() > 0 and not any(obj is itself for obj in gc.get_objects()), \
        "the collection's objects are still walked by every collection"
