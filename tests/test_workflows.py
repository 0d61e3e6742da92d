"""The GitHub Actions workflows: actionlint finds nothing in them, it checks the inputs of every action they use (an
unknown input fails it), every action is pinned, and the Pages deployment has the least permissions that work."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
ACTIONLINT = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which("actionlint")
PINNED = re.compile(r"^[\w.-]+/[\w.-]+(/[\w./-]+)?@(v\d+(\.\d+){0,2}|[0-9a-f]{40})$")
PROBE = "optlab-no-such-input"


def workflows() -> dict[str, dict]:
    return {path.name: yaml.safe_load(path.read_text()) for path in sorted(WORKFLOWS.glob("*.yml"))}


def steps(workflow: dict):
    for job_name, job in workflow["jobs"].items():
        for step in job.get("steps", []):
            yield job_name, step


def actionlint(folder: Path) -> subprocess.CompletedProcess:
    assert ACTIONLINT, "actionlint is not installed (requirements.txt installs it)"
    files = sorted(str(path) for path in (folder / ".github" / "workflows").glob("*.yml"))
    return subprocess.run([ACTIONLINT, "-oneline", "-no-color", *files], cwd=folder, capture_output=True, text=True,
                          timeout=120)


def test_the_two_workflows_exist():
    assert set(workflows()) == {"test.yml", "pages.yml"}


def test_actionlint_finds_nothing():
    run = actionlint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_actionlint_checks_the_inputs_of_every_action_used(tmp_path):
    """actionlint knows the inputs of popular actions at their version tags, not at every ref: each step that uses an
    action gets an unknown input here, and each one must be reported."""
    probes = tmp_path / ".github" / "workflows"
    probes.mkdir(parents=True)
    expected = set()
    for name, workflow in workflows().items():
        for job_name, step in steps(workflow):
            if "uses" in step:
                step.setdefault("with", {})[PROBE] = "x"
                expected.add(step["uses"])
        (probes / name).write_text(yaml.safe_dump(workflow, sort_keys=False))
    assert expected, "no workflow step uses an action"
    report = actionlint(tmp_path).stdout
    caught = set(re.findall(rf'input "{PROBE}" is not defined in action "([^"]+)"', report))
    assert caught == expected, f"actionlint does not check the inputs of {sorted(expected - caught)}:\n{report}"


def test_every_action_is_pinned_to_a_version():
    loose = [f"{name}: {step['uses']}" for name, workflow in workflows().items() for _, step in steps(workflow)
             if "uses" in step and not PINNED.match(step["uses"])]
    assert not loose, f"actions not pinned to a version tag or a commit: {loose}"


def test_the_pages_workflow_deploys_main_with_the_least_permissions():
    workflow = workflows()["pages.yml"]
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    trigger = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert trigger["push"]["branches"] == [config["branch"]]
    assert workflow["permissions"] == {"contents": "read"}
    assert workflow["concurrency"] == {"group": "pages", "cancel-in-progress": False}
    jobs = workflow["jobs"]
    assert "permissions" not in jobs["build"], "the build needs no more than to read the repository"
    assert jobs["deploy"]["permissions"] == {"pages": "write", "id-token": "write"}
    uses = [step["uses"].split("@")[0] for _, step in steps(workflow) if "uses" in step]
    for action in ("actions/configure-pages", "actions/upload-pages-artifact", "actions/deploy-pages"):
        assert action in uses, f"the pages workflow does not use {action}"
    upload = next(step for _, step in steps(workflow) if step.get("uses", "").startswith("actions/upload-pages"))
    assert upload["with"]["path"] == "_build/html"


@pytest.mark.parametrize("event", ["pull_request", "push"])
def test_the_test_workflow_runs_the_readme_test_command(event):
    workflow = workflows()["test.yml"]
    assert event in workflow[True]
    runs = " ".join(step.get("run", "") for _, step in steps(workflow))
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/run" in runs and "apt-get install -y -q chromium" in ci and ci.rstrip().endswith("make test")
    assert "make test" in (ROOT / "README.md").read_text()
