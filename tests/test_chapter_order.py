"""The chapter files are numbered in the table of contents' order, and each chapter's title carries its number."""
import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def toc_notebooks(toc: dict) -> list[str]:
    """The notebooks of the table of contents, in reading order."""
    return [entry["file"] for part in toc["parts"] for entry in part["chapters"]
            if entry["file"].startswith("notebooks/")]


def order_problems(files: list[str], titles: dict[str, str]) -> list[str]:
    """What is out of order: a file whose number is not the one after the previous file's, or whose title
    (``# N. ...``) carries another number."""
    problems = []
    for place, file in enumerate(files, start=1):
        number = int(re.match(r"notebooks/(\d+)_", file)[1])
        if number != place:
            problems.append(f"{file} is chapter {place} in the table of contents")
        title = re.match(r"# (\d+)\. ", titles[file])
        if not title or int(title[1]) != number:
            problems.append(f"{file}'s title {titles[file]!r} does not start with '# {number}. '")
    return problems


def title(path: Path) -> str:
    return "".join(json.loads(path.read_text())["cells"][0]["source"]).splitlines()[0]


def test_the_chapter_files_are_numbered_in_reading_order():
    files = toc_notebooks(yaml.safe_load((ROOT / "_toc.yml").read_text()))
    assert sorted(f"notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("*.ipynb")) == sorted(files)
    assert not order_problems(files, {file: title(ROOT / f"{file}.ipynb") for file in files})


def test_a_chapter_out_of_order_or_titled_with_another_number_is_named():
    files = ["notebooks/01_a", "notebooks/03_c", "notebooks/02_b"]
    titles = {"notebooks/01_a": "# 1. A", "notebooks/03_c": "# 3. C", "notebooks/02_b": "# 2 B"}
    assert order_problems(files, titles) == [
        "notebooks/03_c is chapter 2 in the table of contents", "notebooks/02_b is chapter 3 in the table of contents",
        "notebooks/02_b's title '# 2 B' does not start with '# 2. '"]
