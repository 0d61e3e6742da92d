"""A chapter's text reads the same in JupyterLab and in the built book: no markdown cell holds MyST-only syntax
(a ``(label)=`` target, a ``{role}`` or a ``{directive}`` fence, a colon fence, a substitution, a ``%`` comment or a
``+++`` break), which Lab shows as literal text. Plain Markdown links and headings serve both (the book makes an
anchor of every heading: ``myst_heading_anchors`` in ``_config.yml``)."""
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


def test_a_link_to_a_heading_has_the_book_s_anchor():
    """A chapter's link to another chapter's section (``NN_name.ipynb#slug``) needs the book to make heading
    anchors at that section's level, and the slug of a heading that chapter has."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    depth = config["sphinx"]["config"].get("myst_heading_anchors", 0)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            for target, slug in re.findall(r"\]\((\d\d_\w+\.ipynb)#([\w-]+)\)", "".join(cell["source"])):
                headings = [line for other in json.loads((ROOT / "notebooks" / target).read_text())["cells"]
                            if other["cell_type"] == "markdown" for line in "".join(other["source"]).splitlines()
                            if re.match(rf"#{{1,{depth}}} ", line)]
                slugs = {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                         for line in headings}
                assert slug in slugs, f"{path.name}: #{slug} is no heading of {target} up to level {depth}"
