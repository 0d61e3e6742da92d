"""What the transformer chapters' pages show: published sources as links, each peak's provenance once under an MFU
table, waterfalls whose long labels stay readable, and the code changes of knobs read inside the model."""
import html
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from optlab.book import chapter, report
from optlab.core.techniques import gpt as gpt_techniques
from optlab.core.results import published
from optlab.core.errors import OptlabError
from optlab.core.techniques.registry import get_experiment
from optlab.core.measuring.timing import FASTER
from optlab.studies import learning
from optlab.studies.transformer import token_costs

ROOT = Path(__file__).resolve().parents[1]


def test_published_sources_are_links_and_no_raw_address_is_shown():
    for figures in (published.published_figures(), learning.PUBLISHED_TIME_TO_TARGET):
        table = report.linked_sources(figures)
        page = report.html_table(table)
        for source, url in zip(figures["source"], figures["url"]):
            assert f'<a href="{url}">{html.escape(source)}</a>' in page
        assert "url" not in table and page.count("https://") == page.count('<a href="https://')
    with pytest.raises(OptlabError, match="needs the columns"):
        report.linked_sources(pd.DataFrame({"source": ["a"]}))


def test_an_mfu_table_names_each_peaks_source_once():
    mfu = pd.DataFrame({"model": "m", "variant": ["a", "b", "c", "d"], "MFU %": 1.0,
                        "precision": ["fp32", "fp32", "bf16", "tf32"], "peak TFLOP/s": [67.0, 67.0, 989.0, 494.5],
                        "peak source": ["H200 datasheet, dense"] * 2 + ["H200 datasheet, dense", "measured: x"]})
    line = token_costs.peak_sources(mfu)
    assert line == "peaks: fp32 67 TFLOP/s, bf16 989 TFLOP/s: H200 datasheet, dense; tf32 494.5 TFLOP/s: measured: x"
    summary = pd.DataFrame({"model": "m", "phase": "train", "variant": ["a", "b"], "unit": "tokens",
                            "items_per_s": [1.0, 2.0], "peak_mem_mb": 1.0})
    table = token_costs.stack_throughput(summary, mfu, ["a", "b"])
    assert "peak source" not in table and table["peak TFLOP/s"].tolist() == [67.0, 67.0]


def longest_stack_labels() -> list[str]:
    """The stack whose longest label is the longest any chapter's waterfall draws: the GPT's on a GPU."""
    stacks = [get_experiment("all_together").labels, gpt_techniques.gpt_all_together("gpt2_small").labels,
              gpt_techniques.gpt_all_together("gpt_tiny").labels]
    return list(max(stacks, key=lambda labels: max(map(len, labels))))


def test_a_waterfall_keeps_the_longest_label_readable_and_its_bars_their_height():
    labels = longest_stack_labels()
    assert max(map(len, labels)) >= 60
    steps = pd.DataFrame({"model": "gpt2_small", "phase": "train", "step": labels[1:], "baseline_epoch_s": 10.0,
                          "vs previous": 1.2, "verdict": FASTER})
    figure = report.plot_waterfall(steps, labels)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    ax = figure.axes[0]
    ticks = [label.get_window_extent(renderer) for label in ax.get_xticklabels()]
    assert all(label.get_rotation() == 0 for label in ax.get_xticklabels())
    assert all(left.x1 <= right.x0 for left, right in zip(ticks, ticks[1:])), "step labels overlap"
    assert ax.get_window_extent(renderer).height >= 0.5 * figure.bbox.height, "the bars are squeezed by the labels"
    assert min(tick.x0 for tick in ticks) >= 0 and max(tick.x1 for tick in ticks) <= figure.bbox.width


@pytest.mark.parametrize("experiment, stacked", [("gpt_all_together", True), ("gpt_shapes", False),
                                                 ("attention", False), ("checkpointing", False)])
def test_every_changed_knob_shows_the_lines_that_read_it(experiment, stacked):
    if experiment == "gpt_all_together":
        experiment = gpt_techniques.gpt_all_together("gpt_tiny", skip=("+ torch.compile",))
    text = chapter.code_changes(experiment, model="gpt_tiny", stacked=stacked)
    lines = text.split("\n")
    headers = [i for i, line in enumerate(lines) if line.startswith(("the lines that read", "config."))]
    assert headers, text
    for i in headers:
        assert i + 1 < len(lines) and lines[i + 1].startswith("    optlab/"), f"nothing under {lines[i]!r}:\n{text}"
    if "attention: " in text:
        assert "config.attention is read inside the model: the gpt workload builds the model with it" in text


OUR_GPT_CHAPTERS = ("22_attention", "23_checkpointing", "25_gpt_optimizers", "26_gpt_compile", "27_gpt_shapes",
                    "28_gpt_all_together")


def chapter_cells(stem: str, kind: str) -> list[str]:
    notebook = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == kind]


@pytest.mark.parametrize("stem", OUR_GPT_CHAPTERS)
def test_a_chapter_counts_its_variants_from_the_run_and_names_each_devices_precision(stem):
    prose = "\n".join(chapter_cells(stem, "markdown"))
    typed = re.findall(r"\b(?:two|three|four|five|six|seven|eight)\s+variants\b", prose, flags=re.IGNORECASE)
    assert not typed, f"{stem} types a count of variants: {typed}"
    assert not re.search(r"\b(?:fp32|bf16)\b[^.]{0,12}\bas here\b", prose), f"{stem} says one precision for every device"


def test_chapter_20_reads_the_precision_of_its_kernel_check_from_the_comparison():
    prose, code = "\n".join(chapter_cells("22_attention", "markdown")), "\n".join(chapter_cells("22_attention", "code"))
    assert "fp32 on a CPU, bf16 autocast on a GPU" in prose and "in the comparison's precision (fp32)" not in prose
    assert ".amp_dtype" in code


def test_chapter_24_prints_its_counts_from_the_registry_and_the_record():
    code = "\n".join(chapter_cells("26_gpt_compile", "code"))
    assert "len(labels)" in code and "len(timed)" in code
