"""CONTRIBUTING.md's recipe, followed once with its throwaway technique: registry entry, listing, a run, a table."""
import re
from pathlib import Path

import pytest

from optlab.book import chapter, report
from optlab.core.techniques import registry
from tests.helpers import TINY

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "CONTRIBUTING.md").read_text()


@pytest.fixture
def throwaway():
    """Run the guide's registry entry, as written, and take it out of the registry afterwards."""
    entry = re.search(r"### 1\. One registry entry.*?```python\n(.*?)```", GUIDE, re.S).group(1)
    exec(compile(entry, "CONTRIBUTING.md", "exec"), {})
    yield registry.get_experiment("throwaway")
    registry.REGISTRY.pop("throwaway", None)


def test_the_recipe_adds_a_technique_that_runs_end_to_end(throwaway, monkeypatch, tmp_path):
    assert "throwaway" in set(registry.list_experiments()["technique"])
    assert "eval_grad_mode: 'grad' -> 'no_grad'" in chapter.code_changes("throwaway", profile=TINY)
    monkeypatch.setattr(chapter.store, "LIVE_DIR", tmp_path)
    result = chapter.run("throwaway", profile=TINY, device="cpu", progress=False)
    table = report.comparison_table(result.summary)
    assert list(table["variant"]) == ["with autograd", "without autograd"]
    assert (tmp_path / "throwaway.json").is_file()


def test_the_recipe_names_the_toc_line_the_notebook_test_checks():
    toc_line = re.search(r"### 3\. One line in `_toc.yml`.*?```yaml\n(.*?)```", GUIDE, re.S).group(1)
    assert re.fullmatch(r"\s+- file: notebooks/NN_name\n", toc_line)
    assert "- file: notebooks/" in (ROOT / "_toc.yml").read_text()
