"""Mutation testing of the modules where a wrong number is silent: mutmut makes hundreds of small changes to one
module (a ``<`` for a ``<=``, a 2 for a 3, a dropped call), runs that module's own fast test files against each, and
reports every change that no test noticed (a *survivor*) and the share of changes caught (the *kill rate*).

``make mutants`` runs every module below; ``make mutants MODULE=timing`` one. Each runs in a fresh copy under
``_build/mutants/<module>`` (mutmut writes its mutated tree there), so the working tree is never changed. A survivor
is either a bug class no test sees (write a test whose inputs separate the two: see CONTRIBUTING) or an equivalent
mutant, one that changes no result; those are listed with their reason in ``tools/mutants_equivalent.txt`` and
reported apart. Mutant numbers follow the order of the changes inside a function, so a list entry is re-checked
(``mutmut show NAME`` in the module's folder) when that function changes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "_build" / "mutants"
EQUIVALENT = Path(__file__).with_name("mutants_equivalent.txt")
COPIED = ("optlab", "tests", "book", "pyproject.toml")
SIMULATIONS = ("tests/test_timing.py::test_summaries_pair_the_repeats_of_simulated_runs",  # test_sequential's job:
               "tests/test_timing.py::test_real_effects_still_get_their_verdict")  # seconds a mutant, no more kills
MODULES = {  # name: (the module, its own fast test files, tests of those files left out)
    "summary": ("optlab/core/stats/summary.py", ("tests/test_values_stats.py", "tests/test_stopping_failures.py"), ()),
    "sequential": ("optlab/core/stats/sequential.py", ("tests/test_values_stats.py", "tests/test_answered_early.py",
                                                       "tests/test_stopping_failures.py"), ()),
    "timing": ("optlab/core/measuring/timing.py", ("tests/test_timing.py", "tests/test_values_stats.py",
                                                   "tests/test_values_timing.py"), SIMULATIONS),
    "checks": ("optlab/core/results/checks.py", ("tests/test_values_checks.py",), ()),
    "requests": ("optlab/studies/serving/requests.py", ("tests/test_serving_batching.py",), ()),
    "bandwidth": ("optlab/studies/serving/bandwidth.py", ("tests/test_kv_cache_chapter.py", "tests/test_mig_peaks.py"),
                  ()),
    "breakdown": ("optlab/studies/memory/breakdown.py", ("tests/test_memory_breakdown.py",
                                                         "tests/test_values_studies.py"), ()),
}


def equivalent_mutants(path: Path = EQUIVALENT) -> dict[str, str]:
    """``{mutant name: why it changes no result}`` from the list (``name  # why`` a line)."""
    if not path.exists():
        return {}
    entries = {}
    for line in path.read_text().splitlines():
        name, _, why = line.partition("#")
        if name.strip():
            entries[name.strip()] = why.strip()
    return entries


def prepare(name: str, module: str, tests: tuple[str, ...], left_out: tuple[str, ...]) -> Path:
    """A fresh copy of the repository's code and tests under ``_build/mutants/<name>``, with mutmut's configuration
    for this module alone."""
    folder = WORK / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for item in COPIED:
        source = ROOT / item
        if source.is_dir():
            shutil.copytree(source, folder / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, folder / item)
    (folder / "setup.cfg").write_text(
        "[mutmut]\nsource_paths = optlab\n"
        f"only_mutate = {module}\n"
        "pytest_add_cli_args_test_selection =\n" + "".join(f"    {test}\n" for test in tests)
        + "pytest_add_cli_args =\n    -p no:cacheprovider\n    -q\n"
        + "".join(f"    --deselect={test}\n" for test in left_out))
    return folder


def mutmut(folder: Path, *arguments: str, log: Path | None = None) -> str:
    """Run mutmut in ``folder``; its output (to ``log`` where given: its progress line is long)."""
    command = [sys.executable, "-m", "mutmut", *arguments]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # the mutated copy comes first
    if log is None:
        return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, check=True).stdout
    with log.open("w") as out:
        subprocess.run(command, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)
    return ""


def statuses(folder: Path) -> dict[str, str]:
    """Every mutant of the run in ``folder`` and its status (killed, survived, no tests, timeout, ...)."""
    listed = mutmut(folder, "results", "--all", "true")
    found = {}
    for line in listed.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            found[name] = status
    return found


def report(name: str, found: dict[str, str], equivalent: dict[str, str], folder: Path) -> dict[str, object]:
    """Print the survivors (with their change) and the kill rate of one module; return the figures."""
    killed = sum(status in ("killed", "timeout") for status in found.values())
    known = sorted(mutant for mutant, status in found.items() if status == "survived" and mutant in equivalent)
    survivors = sorted(mutant for mutant, status in found.items() if status == "survived" and mutant not in equivalent)
    untested = sorted(mutant for mutant, status in found.items() if status == "no tests")
    judged = len(found) - len(known)
    rate = killed / judged if judged else float("nan")
    print(f"\n== {name}: {killed} of {judged} mutants killed ({100 * rate:.1f} %), {len(survivors)} survived, "
          f"{len(known)} equivalent (listed), {len(untested)} reached by no test")
    for mutant in survivors:
        print(f"-- survived: {mutant}")
        print(mutmut(folder, "show", mutant).rstrip())
    for mutant in untested:
        print(f"-- no test reaches: {mutant}")
    return {"module": name, "mutants": len(found), "killed": killed, "survived": len(survivors),
            "equivalent": len(known), "no_tests": len(untested), "kill_rate": rate}


def run(name: str, children: int) -> dict[str, object]:
    module, tests, left_out = MODULES[name]
    folder = prepare(name, module, tests, left_out)
    print(f"{name}: mutating {module} against {', '.join(tests)} (progress in {folder / 'mutmut.log'})", flush=True)
    mutmut(folder, "run", "--max-children", str(children), log=folder / "mutmut.log")
    return report(name, statuses(folder), equivalent_mutants(), folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", choices=sorted(MODULES), action="append",
                        help="the module(s) to mutate (default: every one)")
    parser.add_argument("--children", type=int, default=2, choices=range(1, 65), metavar="{1..64}",
                        help="mutants tested at once (default 2)")
    args = parser.parse_args(argv)
    figures = [run(name, args.children) for name in args.module or MODULES]
    print("\nkill rate per module:")
    for row in figures:
        judged = row["mutants"] - row["equivalent"]
        print(f"  {row['module']:<11} {100 * row['kill_rate']:5.1f} %  ({row['killed']}/{judged}, {row['survived']} "
              f"survived, {row['no_tests']} reached by no test)")
    (WORK / "kill-rates.json").write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
