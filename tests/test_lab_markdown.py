"""A chapter's text reads the same in JupyterLab and in the built book: no markdown cell holds MyST-only syntax
(a ``(label)=`` target, a ``{role}`` or a ``{directive}`` fence, a colon fence, a substitution, a ``%`` comment or a
``+++`` break), which Lab shows as literal text; and a link to a section lands on it in both, though Lab's heading
ids keep capitals and the book's anchors (``myst_heading_anchors`` in ``_config.yml``) do not."""
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MYST_ONLY = {
    "a target label": re.compile(r"^\s*\([^()\s]+\)=\s*$", re.MULTILINE),
    "a role": re.compile(r"\{[A-Za-z][\w:+.-]*\}`"),
    "a directive": re.compile(r"^\s*(`{3,}|~{3,})\s*\{[\w:+.-]+\}", re.MULTILINE),
    "a colon fence": re.compile(r"^\s*:{3,}", re.MULTILINE),
    "a substitution": re.compile(r"\{\{[^{}]*\}\}"),
    "a comment": re.compile(r"^%", re.MULTILINE),
    "a block break": re.compile(r"^\+\+\+", re.MULTILINE),
}


def myst_only(text: str) -> list[str]:
    """What MyST-only syntax ``text`` holds, each as its kind and the line it stands on."""
    found = []
    for kind, pattern in MYST_ONLY.items():
        for match in pattern.finditer(text):
            start = text.rfind("\n", 0, match.start()) + 1
            end = text.find("\n", match.end())
            found.append(f"{kind}: {text[start:end if end >= 0 else None].strip()}")
    return found


@pytest.mark.parametrize("text", [
    "(your-model-inference)=\n## The same models at inference",
    "see {ref}`the section <your-model-inference>`",
    "Download {download}`the trace <../results/trace.json.gz>`",
    "```{note}\nA note.\n```",
    ":::{tip}\nA tip.\n:::",
    "the {{ version }} of the book",
    "% a comment\ntext",
    "+++\nthe next block",
])
def test_each_myst_only_construct_is_found(text):
    assert myst_only(text), text


def test_plain_markdown_is_not_taken_for_myst():
    text = ("## The same models at inference\n\n[chapter 37](37_your_model.ipynb#the-same-models-at-inference), "
            "`{'a': 1}`, a dict `{}`, 50 % of it, (a remark) = nothing, ```bash\nmake lab\n```")
    assert myst_only(text) == []


def test_no_notebook_markdown_cell_holds_myst_only_syntax():
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for number, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                found += [f"{path.name}, cell {number}: {what}" for what in myst_only("".join(cell["source"]))]
    assert not found, "Lab shows these as text; use a plain Markdown link or heading:\n" + "\n".join(found)


LINK_TO_A_HEADING = re.compile(r"\]\(((?:[\w./-]+\.(?:ipynb|md))?)#([^)\s]*)\)")  # a chapter's or this page's


def lab_id(heading: str) -> str:
    """The id JupyterLab gives a rendered heading: its text with each space a '-', capitals and punctuation kept."""
    return heading.replace(" ", "-")


def book_slug(heading: str) -> str:
    """The anchor the book makes of a heading (MyST's ``myst_heading_anchors``): lower case, spaces as '-',
    punctuation dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace(" ", "-"))


def headings_of(path: Path, depth: int) -> list[str]:
    """The text of every heading of a notebook's markdown cells, up to level ``depth``."""
    return [line.lstrip("#").strip() for cell in json.loads(path.read_text())["cells"]
            if cell["cell_type"] == "markdown" for line in "".join(cell["source"]).splitlines()
            if re.match(rf"#{{1,{depth}}} ", line)]


def unresolved_anchors(text: str, here: Path, depth: int) -> list[str]:
    """Each link to a heading in ``text`` (a notebook at ``here``) that does not land on it both in Lab and in the
    book: the anchor must be a heading's Lab id and its book anchor at once."""
    unresolved = []
    for target, anchor in LINK_TO_A_HEADING.findall(text):
        path = here.parent / target if target else here
        headings = headings_of(path, depth) if path.suffix == ".ipynb" and path.exists() else []
        if not any(anchor == lab_id(heading) == book_slug(heading) for heading in headings):
            unresolved.append(f"{target}#{anchor}")
    return unresolved


def test_an_anchor_must_be_the_same_in_lab_and_in_the_book(tmp_path):
    chapter = tmp_path / "37_your_model.ipynb"
    chapter.write_text(json.dumps({"cells": [{"cell_type": "markdown",
                                              "source": ["## The same models at inference\n", "## gloo\n"]}]}))
    here = tmp_path / "07_inference.ipynb"
    assert unresolved_anchors("[37](37_your_model.ipynb#the-same-models-at-inference)", here, 3)  # not Lab's id
    assert unresolved_anchors("[37](37_your_model.ipynb#The-same-models-at-inference)", here, 3)  # not the book's
    assert unresolved_anchors("[37](37_your_model.ipynb#no-such-heading)", here, 3)
    assert unresolved_anchors("[37](37_your_model.ipynb#gloo)", here, 3) == []  # the same in both
    assert unresolved_anchors("[37](37_your_model.ipynb) (its section *The same models at inference*)", here, 3) == []


def test_every_link_to_a_heading_lands_on_it_in_lab_and_in_the_book():
    """A chapter's link to a section (``NN_name.ipynb#anchor`` or ``#anchor``) must land in both: JupyterLab keeps a
    heading's capitals in its id and the book lower-cases them, so a link names the chapter and the section in words
    unless the heading reads the same both ways."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    depth = config["sphinx"]["config"].get("myst_heading_anchors", 0)
    unresolved = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for number, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                unresolved += [f"{path.name}, cell {number}: {link}"
                               for link in unresolved_anchors("".join(cell["source"]), path, depth)]
    assert not unresolved, "these anchors do not land in Lab and in the book alike:\n" + "\n".join(unresolved)
