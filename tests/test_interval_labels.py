"""The interval's level, as every text a reader sees states it: 99.9 %, never a rounded or an older number."""
import re
from pathlib import Path

import pandas as pd

from optlab.book import report
from optlab.core import timing

ROOT = Path(__file__).resolve().parent.parent
WRONG_LEVEL = re.compile(r"\b(100|95)\s?%\s?(confidence\s)?(interval|CI)\b", re.IGNORECASE)


def test_no_readme_page_chapter_or_docstring_names_another_level():
    texts = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("book/*.md"), *ROOT.glob("notebooks/*.ipynb"),
             *ROOT.glob("optlab/**/*.py"), *ROOT.glob("results/**/*.md")]
    problems = [str(path.relative_to(ROOT)) for path in texts if WRONG_LEVEL.search(path.read_text())]
    assert not problems, f"texts naming a 95 % or 100 % interval: {problems}"


def test_the_check_catches_a_rounded_level():
    assert WRONG_LEVEL.search(f"speed-up ({round(100 * timing.CONFIDENCE)} % interval)")
    assert WRONG_LEVEL.search("with a 95 % interval") and WRONG_LEVEL.search("100% CI")
    assert not WRONG_LEVEL.search(f"speed-up ({timing.INTERVAL})")


def test_tables_say_99_9_percent():
    summary = pd.DataFrame([{"model": "m", "phase": "train", "variant": "a", "speedup": 1.0, "ci_low": 1.0,
                             "ci_high": 1.0, "verdict": "baseline", "peak_mem_mb": 1.0}])
    assert "speed-up (99.5 % sequential interval)" in report.comparison_table(summary).columns
