"""A chapter as a reader runs it in JupyterLab: Lab started from the project's environment with ``make lab``'s
configuration (tools/lab_config.py) on a free port, the chapter opened in headless Chromium and run through Lab's own
menu (Run > Run All Cells), then saved. No cell shows an error; no stderr box is left (empty, or a stale bar of text),
nor any output box that shows nothing;
the progress bars are widgets, each with its total from its first drawing to the end, and each bar left on the page
full; every link on the page (the markdown's and the outputs') answers 200 from Lab where Lab serves it, and the
published book's links are well-formed (there is no network here to ask); the checkout's ``git status`` is as before.

One Lab start and one chapter: chapter 37 by default, the one with the most bars (two ``tune`` runs, ``tune
--inference`` and its batch sizes) beside its records to download; ``$OPTLAB_LAB_CHAPTER`` names another. Slow (a
minute or more): marked ``lab_browser``, in the full tier only."""
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

from site_visits import ARGS, CHROMIUM, why_no_browser

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = os.environ.get("OPTLAB_LAB_CHAPTER", "37_your_model")
TOKEN = "optlab-test"
# Every progress bar drawn in an output, from its first drawing on: the totals its text said, in order (null where it
# had none: tqdm's "12it [...]"), and its last text. A MutationObserver sees each change Lab makes to the page.
WATCH_BARS = """() => {
    window.optlabBars = [];
    window.optlabBoxes = [];
    const seen = new WeakMap();
    const scan = () => {
        for (const progress of document.querySelectorAll(".jp-OutputArea-output .widget-hprogress")) {
            const box = progress.parentElement, texts = box.querySelectorAll(".widget-html");
            const text = texts.length ? texts[texts.length - 1].textContent.replace(/\\s+/g, " ").trim() : "";
            let bar = seen.get(box);
            if (!bar) {
                bar = {name: "", totals: [], last: ""};
                seen.set(box, bar);
                window.optlabBars.push(bar);
                window.optlabBoxes.push(box);
            }
            bar.name = bar.name || (texts.length > 1 ? texts[0].textContent.replace(/\\s+/g, " ").trim() : "");
            if (!text) continue;
            const counts = text.match(/^(\\d+)\\/(\\d+) /);
            const total = counts ? Number(counts[2]) : null;
            if (bar.totals.length === 0 || bar.totals[bar.totals.length - 1] !== total) bar.totals.push(total);
            bar.last = text;
        }
    };
    new MutationObserver(scan).observe(document.body, {subtree: true, childList: true, characterData: true});
    scan();
}"""
OUTPUT = ".jp-OutputArea-output"
# The output boxes that show nothing: no text, no image (a stderr line a bar wiped); Lab hides a closed widget's.
EMPTY = f"""() => [...document.querySelectorAll("{OUTPUT}:not(.lm-mod-hidden)")]
    .filter(box => !box.textContent.trim() && !box.querySelector("img, svg, canvas"))
    .map(box => box.getAttribute("data-mime-type") || box.className)"""
# The bars seen, each with whether it is still on the page.
BARS = "() => window.optlabBars.map((bar, i) => ({...bar, shown: window.optlabBoxes[i].isConnected}))"
# Every link in the notebook's cells as Lab rendered it (its own heading anchors aside): the href attribute Lab wrote
# (empty where it could not resolve a path) and the URL the browser resolves it to.
LINKS = """() => [...document.querySelectorAll(".jp-Notebook a")]
    .filter(a => !a.classList.contains("jp-InternalAnchorLink"))
    .map(a => ({text: a.textContent.trim(), attribute: a.getAttribute("href") || "", url: a.href}))"""


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


def bar_faults(bars: list[dict]) -> list[str]:
    """What is wrong with the bars a run drew: none drawn, a bar without a total, a total that changed after its
    first drawing, a bar left on the page short of its total (a stale bar)."""
    if not bars:
        return ["no progress bar was drawn as a widget"]
    faults = []
    for bar in bars:
        if not bar["totals"]:
            faults.append(f"{bar['name']!r} never showed its count")
        elif None in bar["totals"]:
            faults.append(f"{bar['name']!r} has no total: {bar['last']!r}")
        elif len(bar["totals"]) > 1:
            faults.append(f"{bar['name']!r} changed its total: {bar['totals']}")
        elif bar["shown"] and not bar["last"].startswith(f"{bar['totals'][0]}/{bar['totals'][0]} "):
            faults.append(f"{bar['name']!r} was left short of its total: {bar['last']!r}")
    return faults


def link_faults(links: list[dict], lab: str, status: Callable[[str], int]) -> tuple[list[str], list[str]]:
    """The links that fail, and the external ones only checked for their form: a link Lab could not resolve (its href
    emptied), one on Lab's server that answers other than 200 (``status(url)``), one elsewhere that is not a
    well-formed https URL."""
    faults, external = [], []
    for link in links:
        url = urllib.parse.urlsplit(link["url"])
        if not link["attribute"]:
            faults.append(f"{link['text']!r}: Lab could not resolve its path")
        elif link["url"].startswith(lab):
            if (answer := status(link["url"])) != 200:
                faults.append(f"{link['text']!r} -> {link['url']}: {answer}")
        elif url.scheme == "https" and "." in url.netloc and " " not in link["url"]:
            external.append(link["url"])
        else:
            faults.append(f"{link['text']!r} -> {link['url']}: neither on Lab's server nor a well-formed https URL")
    return faults, external


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
        page.evaluate(WATCH_BARS)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()  # Lab's menu bar: Run > Run All Cells
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(  # every code cell has a count: none waits ([*]) or was left unrun
                """() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
                         .every(p => /\\[\\d+\\]/.test(p.textContent))""", timeout=300_000, polling=1000)
        finally:
            page.screenshot(path=str(ROOT / "_build" / f"lab-{CHAPTER}.png"), full_page=True)
        page.wait_for_timeout(1000)  # the last messages' widgets drawn
        stderr = page.locator(f"{OUTPUT}[data-mime-type='application/vnd.jupyter.stderr']").all_text_contents()
        errors = page.locator(f"{OUTPUT}[data-mime-type='application/vnd.jupyter.error']").all_text_contents()
        empty = page.evaluate(EMPTY)
        bars = page.evaluate(BARS)
        links = page.evaluate(LINKS)
        links_failed, external = link_faults(links, lab, lambda url: page.request.get(url).status)
        page.keyboard.press("Control+s")
        page.wait_for_timeout(2000)
        browser.close()
    print(*(f"bar {bar['name']!r}: totals {bar['totals']}, last {bar['last']!r}" for bar in bars), sep="\n")
    print(f"{CHAPTER}: {len(bars)} bars, {len(links)} links ({len(external)} external, only their form checked: "
          f"no network here)")
    faults = ([f"an error: {text}" for text in errors] + [f"a stderr box left: {text!r}" for text in stderr]
              + [f"an empty output box ({kind})" for kind in empty] + bar_faults(bars) + links_failed)
    assert not faults, f"{CHAPTER} in Lab:\n" + "\n".join(faults)
    assert git_status() == before, f"git status changed:\n{git_status()}"
