"""A chapter as a reader runs it in JupyterLab: Lab started from the project's environment with ``make lab``'s
configuration (tools/lab_config.py) on a free port, the chapter opened in headless Chromium and run through Lab's own
menu (Run > Run All Cells), then saved. No cell shows an error, no stderr box is left (empty, or a stale bar of text),
the progress bars are widgets, every link in the outputs answers 200 from Lab, and the checkout's ``git status`` is
as before. Slow (a minute or more): marked ``lab_browser``, in the full tier only."""
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from site_visits import ARGS, CHROMIUM, why_no_browser

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = os.environ.get("OPTLAB_LAB_CHAPTER", "01_data_loading")
TOKEN = "optlab-test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def lab(smoke_env, tmp_path):
    if reason := why_no_browser():
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    port = free_port()
    env = {k: v for k, v in smoke_env.items() if k != "OPTLAB_BOOK"} | {"PYTHONPATH": str(ROOT)}
    command = [str(Path(sys.executable).parent / "jupyter"), "lab", "--allow-root", "--no-browser",
               "--config", str(ROOT / "tools/lab_config.py"), f"--port={port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={TOKEN}",
               f"--LabApp.workspaces_dir={tmp_path}"]  # a reader's first open: no tabs restored from an earlier Lab
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    try:
        yield url
    finally:
        server.terminate()
        server.wait(30)


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout


@pytest.mark.slow
@pytest.mark.lab_browser
def test_a_chapter_run_all_in_lab_reads_cleanly(lab):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout, sync_playwright

    before = git_status()
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{lab}/lab/tree/notebooks/{CHAPTER}.ipynb?token={TOKEN}")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        try:  # Lab's kernel prompt, where it asks on a first open
            page.locator(".jp-Dialog button", has_text="Select").first.click(timeout=20_000)
        except PlaywrightTimeout:
            pass
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']:visible", timeout=120_000)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()  # Lab's menu bar: Run > Run All Cells
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(  # every code cell has a count: none waits ([*]) or was left unrun
                """() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
                         .every(p => /\\[\\d+\\]/.test(p.textContent))""", timeout=300_000, polling=1000)
        finally:
            page.screenshot(path=str(ROOT / "_build" / f"lab-{CHAPTER}.png"), full_page=True)
        stderr = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']").all_inner_texts()
        bars = page.locator(".jp-OutputArea-output .widget-hprogress").count()
        hrefs = page.locator(".jp-OutputArea-output a[href]").evaluate_all("links => links.map(a => a.href)")
        page.keyboard.press("Control+s")
        page.wait_for_timeout(2000)
        browser.close()
    assert not errors, f"errors in {CHAPTER}: {errors}"
    assert not stderr, f"stderr boxes left in {CHAPTER}: {stderr}"
    assert bars, "no progress bar was drawn as a widget"
    local = [href for href in hrefs if href.startswith(lab)]
    failed = {href: status for href in local
              if (status := urllib.request.urlopen(href.split("#")[0] + f"?token={TOKEN}").status) != 200}
    assert not failed, failed
    assert git_status() == before, f"git status changed:\n{git_status()}"
