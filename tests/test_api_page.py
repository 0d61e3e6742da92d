"""The API page documents every public name of ``optlab`` from its docstring, and the README links it."""
import re
from pathlib import Path

import yaml

import optlab

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^\.\. auto(?:function|class|exception):: optlab\.(\w+)$", re.MULTILINE)


def test_every_public_name_is_on_the_api_page():
    documented = set(DIRECTIVE.findall((ROOT / "book" / "api.md").read_text()))
    assert documented == set(optlab.__all__), (f"missing: {sorted(set(optlab.__all__) - documented)}, "
                                               f"not public: {sorted(documented - set(optlab.__all__))}")
    missing_docstrings = [name for name in optlab.__all__ if not (getattr(optlab, name).__doc__ or "").strip()]
    assert not missing_docstrings, missing_docstrings


def test_the_api_page_is_in_the_book_with_autodoc_and_linked_from_the_readme():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]
    assert "sphinx.ext.autodoc" in config["extra_extensions"]
    assert "book/api" in (ROOT / "_toc.yml").read_text()
    python_api = (ROOT / "README.md").read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    assert "book/api.html" in python_api
