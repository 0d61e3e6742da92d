"""The project speaks to anyone with a GPU: nothing in the README, results, book, chapters or package speaks of a
borrowed machine, its minutes, its per-command limits or its output-folder variable."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLACES = ("README.md", "CONTRIBUTING.md", "results", "book", "notebooks", "optlab")
SUFFIXES = {".md", ".py", ".ipynb", ".yml", ".csv", ".txt"}
OUTPUT_VARIABLE = re.compile(r"\$OUT\b|\bOUT/")  # capitals only: ``out/`` is a parameter
FORBIDDEN = re.compile(r"\blent\b|\bborrowed (machine|GPU|session)|\bsessions?\b|\bof device time\b"
                       r"|device time (left|budget)|\bper-command limit|minutes a command", re.IGNORECASE)


def _files():
    for place in PLACES:
        path = ROOT / place
        yield from ([path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES
                                                         and "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts))


@pytest.mark.parametrize("path", list(_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_borrowed_machine_its_minutes_or_its_output_variable(path):
    found = [f"line {n}: {line.strip()[:120]}" for n, line in enumerate(path.read_text().splitlines(), 1)
             if FORBIDDEN.search(line) or OUTPUT_VARIABLE.search(line)]
    assert not found, "\n".join(found)
