"""One source for the repository's address: ``_config.yml``'s ``repository.url`` and ``branch``. The launch buttons
and the 404 page's prefix are derived from it at build time; the chapters' install cell, the README's badges and
links, the book's pages and the Pages workflow name it, and must agree with it."""
import json
import re
import urllib.parse
from pathlib import Path

import yaml

from tools.site_server import site_prefix

ROOT = Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
OWNER, REPO = urllib.parse.urlparse(CONFIG["url"]).path.strip("/").split("/")
GITHUB = re.compile(r"github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?(?=[/@#)\s\"'`]|$)")
PAGES = re.compile(r"([\w-]+)\.github\.io/([\w.-]+)")
BRANCH = re.compile(r"[?&]branch=([\w./-]+)|/(?:blob|tree)/([\w./-]+?)/")
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "book").rglob("*.md")), ROOT / "CONTRIBUTING.md"]
ELSEWHERE = {"example", "github"}  # README may name github.com/<user>/... as a placeholder, never another project


def disagreements(text: str) -> list[str]:
    found = [f"github.com/{owner}/{repo}" for owner, repo in GITHUB.findall(text)
             if (owner, repo) != (OWNER, REPO) and owner not in ELSEWHERE]
    found += [f"{owner}.github.io/{repo}" for owner, repo in PAGES.findall(text) if (owner, repo) != (OWNER, REPO)]
    found += [f"branch {a or b}" for a, b in BRANCH.findall(text) if (a or b) != CONFIG["branch"]]
    return found


def test_the_readme_links_the_repository_the_site_and_the_workflows():
    readme = (ROOT / "README.md").read_text()
    for needed in (CONFIG["url"], f"https://{OWNER}.github.io/{REPO}/",
                   f"{CONFIG['url']}/actions/workflows/test.yml/badge.svg?branch={CONFIG['branch']}"):
        assert needed in readme, f"README does not link {needed}"


def test_every_address_in_the_documents_is_the_configured_repository():
    problems = {path.name: found for path in DOCUMENTS if (found := disagreements(path.read_text()))}
    assert not problems, f"addresses that disagree with _config.yml ({CONFIG['url']} @ {CONFIG['branch']}): {problems}"


def test_every_chapter_installs_from_the_configured_repository_and_branch():
    install = f"git+{CONFIG['url']}@{CONFIG['branch']}"
    problems = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        first = "".join(next(cell for cell in cells if cell["cell_type"] == "code")["source"])
        named = re.findall(r"git\+(https://[^\s\"'@]+)@([\w./-]+)", first)
        if named != [(CONFIG["url"], CONFIG["branch"])]:
            problems.append(f"{path.name}: {named or 'no git+ address'} (expected {install})")
    assert not problems, problems


def test_the_site_is_served_under_the_repository_name():
    assert site_prefix() == f"/{REPO}/"


def test_the_check_catches_another_owner_branch_or_site():
    assert disagreements(f"see {CONFIG['url']} and https://{OWNER}.github.io/{REPO}/") == []
    assert disagreements("https://github.com/someone/optlab/blob/dev/x.md badge.svg?branch=dev "
                         "https://someone.github.io/optlab/") == [
        "github.com/someone/optlab", "someone.github.io/optlab", "branch dev", "branch dev"]
