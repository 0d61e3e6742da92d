"""A notebook as the project commits it: nbstripout without outputs, counts or run metadata, cell ids kept (a diff
shows only what a person changed) and the language details Lab adds dropped. Git's clean filter for notebooks (the
Makefile's ``notebook-filter``: stdin to stdout) and Lab's save hook (``tools/lab_config.py``) both call :func:`clean`,
so a chapter run and saved in Lab reads as unchanged."""
import sys

if __name__ == "__main__":  # git's filter: started once for each notebook whose timestamps git cannot trust (every
    # one in a fresh clone); without jsonschema's IRI grammar, which no notebook schema uses, a start takes a third of
    # a second, not a second and a half (tests/quick_nbformat.py says why). Lab, which imports this module for its
    # save hook, keeps its own.
    sys.modules.setdefault("rfc3987_syntax", None)
import nbformat  # noqa: E402
from nbstripout import strip_output  # noqa: E402

# nbstripout's command line's own defaults (its function strips none of these), then the language details Lab
# writes on a save (kernelspec stays: it names the kernel)
EXTRA_KEYS = (["metadata.signature", "metadata.widgets"]
              + [f"cell.metadata.{key}" for key in ("collapsed", "ExecuteTime", "execution", "heading_collapsed",
                                                     "hidden", "scrolled")]
              + ["metadata.language_info"])


def clean(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``notebook`` without what a run or a front end adds."""
    return strip_output(notebook, keep_output=False, keep_count=False, keep_id=True, extra_keys=EXTRA_KEYS)


def stored(text: str) -> str:
    """The notebook ``text`` as git stores it: what the filter writes on its standard output."""
    written = nbformat.writes(clean(nbformat.reads(text, as_version=nbformat.NO_CONVERT)))
    return written if written.endswith("\n") else written + "\n"


if __name__ == "__main__":
    sys.stdout.write(stored(sys.stdin.read()))
