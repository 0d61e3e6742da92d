"""JupyterLab as ``make lab`` starts it: the checkout as its root, so a chapter's links to the files beside it
(``../results/...``) are served, and the chapters opened first; each notebook saved as the project commits it."""
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebook_strip import clean  # noqa: E402

c = get_config()  # noqa: F821  (Jupyter's config loader provides it)
c.ServerApp.root_dir = str(Path(__file__).resolve().parent.parent)
c.LabApp.default_url = "/lab/tree/notebooks"


def saved_clean(model, **_):
    """Outputs, counts and run metadata never reach the file, as the git filter strips them: a chapter run and saved
    in Lab stays as committed, so ``git status`` stays clean; the outputs stay on the screen until it is closed."""
    if model.get("type") == "notebook":
        model["content"] = clean(nbformat.from_dict(model["content"]))


c.FileContentsManager.pre_save_hook = saved_clean
