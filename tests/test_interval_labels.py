"""The interval's level, as every text a reader sees states it: the level ``timing.INTERVAL`` names, never a rounded,
an older or any other number."""
import re
from pathlib import Path

import pandas as pd

from optlab.book import report
from optlab.core.measuring import timing

ROOT = Path(__file__).resolve().parent.parent
LEVEL_LABEL = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?%\s?(?:confidence\s)?(?:interval|CI)\b", re.IGNORECASE)


def levels(text: str) -> set[float]:
    """Every level that ``text`` names an interval by ("99.9 % interval", "95% CI", ...), as a number."""
    return {float(level) for level in LEVEL_LABEL.findall(text)}


def allowed_levels() -> set[float]:
    """The level(s) in ``timing.INTERVAL``, the one name of the interval that tables, figures and pages use."""
    found = {float(level) for level in re.findall(r"(\d+(?:\.\d+)?)\s?%", timing.INTERVAL)}
    assert found, f"timing.INTERVAL names no level: {timing.INTERVAL!r}"
    return found


def wrong_levels(text: str) -> set[float]:
    return levels(text) - allowed_levels()


def test_no_readme_page_chapter_or_docstring_names_another_level():
    texts = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("book/**/*.md"), *ROOT.glob("notebooks/*.ipynb"),
             *ROOT.glob("optlab/**/*.py"), *ROOT.glob("results/**/*.md")]
    problems = {str(path.relative_to(ROOT)): sorted(found) for path in texts
                if (found := wrong_levels(path.read_text()))}
    assert not problems, f"texts naming an interval other than the {timing.INTERVAL}: {problems}"


def test_the_check_catches_any_other_level():
    allowed = allowed_levels()
    assert not wrong_levels(f"speed-up ({timing.INTERVAL})") and not wrong_levels(timing.INTERVAL.upper())
    for level in (100, 99.99, 99.9, 99.5, 99, 95, 90):
        if level not in allowed:
            for text in (f"({level:g} % interval)", f"a {level:g}% CI", f"the {level:g} % confidence interval"):
                assert wrong_levels(text) == {level}, text
    rounded = round(100 * timing.CONFIDENCE)
    assert rounded in allowed or wrong_levels(f"speed-up ({rounded} % interval)")
    assert not wrong_levels("a 2 % band, 12 rounds, 99 % of runs")  # a percentage that names no interval


def test_tables_name_the_interval_by_its_level():
    summary = pd.DataFrame([{"model": "m", "phase": "train", "variant": "a", "speedup": 1.0, "ci_low": 1.0,
                             "ci_high": 1.0, "verdict": "baseline", "peak_mem_mb": 1.0}])
    assert f"speed-up ({timing.INTERVAL})" in report.comparison_table(summary).columns
