"""A figure's legend covers no title and no data: drawn with Agg, every legend's box (a figure's or an axes') lies
clear of every visible axes' data area and of every title (an axes' title, a figure's suptitle), for each figure of
``optlab.book.report`` that has a legend, at one panel and at several, and for the chapters' own figures, whose
legends ``report.legend_below`` places. Read statically: no chapter places a legend itself, every chapter cell that
makes one calls ``legend_below``, and every function of ``optlab`` that makes or places one is drawn here."""
import ast
import functools
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.legend  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from optlab.book import report  # noqa: E402
from optlab.book.report.roofline import plot_roofline  # noqa: E402
from optlab.studies.limits.ceilings import Roofs  # noqa: E402


def legend_overlaps(figure: Figure) -> list[str]:
    """Each legend that covers an axes' data area or a title, said as what it covers."""
    renderer = FigureCanvasAgg(figure).get_renderer()  # a figure the function closed has no canvas of its own
    figure.draw(renderer)
    legends = list(figure.legends) + [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None]
    assert legends, "the figure has no legend to check"
    covered = []
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for number, ax in enumerate(figure.axes):
            if not ax.get_visible() or not ax.axison:  # an axes turned off holds the legend itself, or nothing
                continue
            if box.overlaps(ax.get_window_extent(renderer)):
                covered.append(f"the data of axes {number} ({ax.get_title()!r})")
            for title in (ax.title, ax._left_title, ax._right_title):
                if title.get_text() and box.overlaps(title.get_window_extent(renderer)):
                    covered.append(f"the title {title.get_text()!r}")
        suptitle = figure._suptitle
        if suptitle is not None and suptitle.get_text() and box.overlaps(suptitle.get_window_extent(renderer)):
            covered.append(f"the figure's title {suptitle.get_text()!r}")
    return covered


def tidy_speedups(models: int) -> pd.DataFrame:
    rows = []
    for number in range(models):
        for variant, ratio, verdict in (("a longer variant name, as a chapter has", 1.4, "faster"),
                                        ("b", 0.8, "slower"), ("c", 1.0, "can't tell yet")):
            rows.append({"model": f"model {number}", "phase": "train", "variant": variant, "source": report.LIVE,
                         "speedup": ratio, "ci_low": ratio * 0.9, "ci_high": ratio * 1.1, "verdict": verdict,
                         "role": "claim"})
            rows.append({"model": f"model {number}", "phase": "train", "variant": variant, "source": report.SEED,
                         "speedup": ratio * 1.1, "role": "claim"})
    return pd.DataFrame(rows)


def batch_sweep(models: int) -> pd.DataFrame:
    return pd.DataFrame([{"model": f"model {number}", "config": config, "batch": batch, "status": "ok",
                          "samples_per_s": gain * min(batch, 4) * 100, "call_ms": 10 * batch / min(batch, 4)}
                         for number in range(models) for config, gain in (("starting point", 1), ("recommended", 2))
                         for batch in (1, 2, 4, 8)])


def sweep_rows() -> pd.DataFrame:
    return pd.DataFrame([{"mode": mode, "execution": execution, "batch_size": batch, "median_s": 0.01 * batch * gain,
                          "per_image_us": 1e4 * gain} for mode in ("training", "inference")
                         for execution, gain in (("eager", 1.0), ("CUDA graph", 0.5)) for batch in (1, 8, 64)])


def learning_curves() -> pd.DataFrame:
    return pd.DataFrame([{"variant": variant, "step": step, "train_loss": 3.5 - 0.1 * step, "test_loss": 3.4 - 0.1 * step,
                          "test_accuracy": 0.1 * step} for variant in ("fp32 baseline", "bf16 autocast")
                         for step in range(1, 6)])


def breakdown_rows() -> pd.DataFrame:
    return pd.DataFrame([{"config": config, "data_wait_ms": 2.0, "launch_ms": 1.0, "sync_ms": 0.5, "cpu_other_ms": 4.0,
                          "device_busy_share": float("nan"), "data_wait_share": 0.2}
                         for config in ("before", "after")])


def numerics_rows() -> pd.DataFrame:
    return pd.DataFrame([{"model": model, "variant": variant, "output": 1e-3, "gradient": 1e-2}
                         for model in ("resnet18", "mobilenet_v2") for variant in ("bf16", "fp16", "tf32")])


def step_trace_samples() -> pd.DataFrame:
    return pd.DataFrame([{"model": "resnet18", "phase": phase, "variant": variant, "repeat": 0, "status": "ok",
                          "warmup_times_s": [2.0, 0.2], "step_times_s": [0.1, 0.1, 0.1]} for phase in ("train", "test")
                         for variant in ("eager", "compiled")])


def two_panels_of_lines() -> Figure:  # chapter 32's: the same labels on both panels, one more on the right
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained")
    for drafter in ("a drafter with a long name", "another drafter"):
        left.plot([1, 2, 4], [0.9, 0.8, 0.6], marker="o", label=drafter)
        right.plot([1, 2, 4], [30, 40, 35], marker="o", label=drafter)
    right.axhline(25, color="0.3", ls="--", label="no drafter")
    left.set_title("acceptance")
    report.legend_below(figure)
    return figure


def four_titled_panels() -> Figure:  # chapter 33's: lines in three of four titled panels
    figure, axes = plt.subplots(2, 2, figsize=(7, 6), layout="constrained")
    for ax, title in zip(axes.flat, ("decode batch sweep", "E2E", "TTFT", "served")):
        ax.set_title(title)
    axes[0, 0].plot([1, 2], [3, 4], "o-")
    for name in ("fcfs", "chunked"):
        for ax in (axes[0, 1], axes[1, 0]):
            for q, style in (("p50", "-"), ("p99", ":")):
                ax.plot([1, 2, 4], [10, 20, 80], style, marker="o", label=f"{name} {q}")
        axes[1, 1].plot([1, 2, 4], [1, 2, 3], marker="o", label=name)
    axes[1, 1].plot([1, 2, 4], [1, 2, 4], color="grey", label="offered")
    report.legend_below(figure, columns=4)
    return figure


def seaborn_hue_bars() -> Figure:  # chapters 3 and 25: an axes-level plot's hue legend, which seaborn puts inside
    frame = pd.DataFrame({"n": [1000, 1000, 1024, 1024], "tflops": [1.0, 1.2, 1.4, 1.5],
                          "multiple_of_8": [False, False, True, True]})
    _, ax = plt.subplots()  # its own figure: an axes-level plot draws on whatever figure is current
    sns.barplot(data=frame, x="n", y="tflops", hue="multiple_of_8", ax=ax)
    ax.set(title="square matmul")
    report.legend_below(ax)
    return ax.figure


def pandas_bars() -> Figure:  # chapters 19-21: pandas' bar legend, inside by default
    ax = pd.DataFrame({"all-reduce": [4.0, 2.0], "all-gather": [1.0, 3.0]}, index=["DP", "TP"]).plot.barh(
        stacked=True, figsize=(7, 2.6))
    ax.plot([1, 2], [0, 1], "k|", label=None)  # unlabelled marks stay out of the legend
    report.legend_below(ax)
    return ax.figure


def labelled_scatter() -> Figure:  # chapter 30's: bars unlabelled, one labelled mark
    figure, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(["no cache", "static cache"], [10, 40])
    ax.scatter([100, 100], ["no cache", "static cache"], marker="|", s=400, color="black", label="bandwidth bound")
    report.legend_below(ax)
    return figure


FIGURES = {
    "speed-ups, one panel": lambda: report.plot_speedups(tidy_speedups(1), rows=("variant",), col="model"),
    "speed-ups, two panels": lambda: report.plot_speedups(tidy_speedups(2), rows=("variant",), col="model"),
    "speed-ups, three panels wrapped": lambda: report.plot_speedups(tidy_speedups(3), rows=("variant",), col="model",
                                                                     col_wrap=2),
    "waterfall": lambda: report.plot_waterfall(pd.DataFrame({
        "model": "m", "phase": "train", "step": ["b", "c"], "vs previous": [2.0, 0.8],
        "verdict": ["faster", "slower"], "baseline_epoch_s": 10.0}), ["a", "b", "c"]),
    "learning": lambda: report.plot_learning(learning_curves()),
    "breakdown": lambda: report.plot_breakdown(breakdown_rows(), title="a step, split"),
    "numerics": lambda: report.plot_numerics(numerics_rows(), ["output", "gradient"], title="errors").figure,
    "step trace": lambda: report.plot_step_trace(step_trace_samples()).figure,
    "sweep": lambda: report.plot_sweep(sweep_rows(), title="a sweep").figure,
    "batch sizes, one model": lambda: report.plot_batch_sizes(batch_sweep(1)).figure,
    "batch sizes, two models": lambda: report.plot_batch_sizes(batch_sweep(2)).figure,
    "roofline": lambda: plot_roofline(
        pd.DataFrame({"label": ["a step"], "FLOP/byte": [10.0], "TFLOP/s": [1.0], "bound": ["memory"],
                      "precision": ["fp32"]}),
        Roofs(flops_per_s={"fp32": 2e12}, bytes_per_s=1e11, launch_s=5e-6, device="cpu"), title="a roofline"),
    "a chapter's two panels of lines": two_panels_of_lines,
    "a chapter's four titled panels": four_titled_panels,
    "a chapter's seaborn hue bars": seaborn_hue_bars,
    "a chapter's pandas bars": pandas_bars,
    "a chapter's labelled scatter": labelled_scatter,
}


@pytest.mark.parametrize("name", FIGURES)
def test_no_legend_covers_a_title_or_data(name):
    figure = FIGURES[name]()
    try:
        assert legend_overlaps(figure) == [], name
    finally:
        plt.close(figure)


def test_the_check_sees_a_legend_on_a_title_and_on_data():
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(4, 4))
    top.plot([1, 2], [1, 2], label="a line")
    bottom.set_title("the second panel's title")
    top.legend(loc="upper left", bbox_to_anchor=(0.3, -0.05))  # below the first panel: on the second's title
    figure.legend(loc="center")  # in the middle of the figure: on data
    covered = legend_overlaps(figure)
    plt.close(figure)
    assert "the title \"the second panel's title\"" in covered and any("the data of axes" in c for c in covered)


def test_legend_below_gathers_every_panel_s_entries_once_with_the_title_of_a_legend_it_replaces():
    figure = four_titled_panels()
    [legend] = figure.legends
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels == ["fcfs p50", "fcfs p99", "chunked p50", "chunked p99", "fcfs", "chunked", "offered"]
    assert all(ax.get_legend() is None for ax in figure.axes)
    plt.close(figure)
    figure = seaborn_hue_bars()
    assert [figure.legends[0].get_title().get_text()] == ["multiple_of_8"]  # True and False say nothing alone
    assert figure.axes[0].get_legend() is None  # seaborn's own, inside the axes, is gone
    plt.close(figure)


def test_legend_below_refuses_a_figure_with_nothing_labelled():
    figure, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    with pytest.raises(ValueError, match="nothing labelled"):
        report.legend_below(figure)
    plt.close(figure)


ROOT = Path(__file__).resolve().parent.parent
PLACES = {"legend", "move_legend"}  # calls that place a legend where they say
LABELLED = {"plot", "scatter", "bar", "barh", "stackplot", "axhline", "axvline", "fill_between", "errorbar", "step",
            "hist", "stem", "loglog", "semilogx", "semilogy"}  # matplotlib calls whose label= makes a legend entry


def _name(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


def makes_a_legend(call: ast.Call) -> bool:
    """Whether a call places a legend, or makes one where its library puts it (a seaborn ``hue=``, a pandas
    ``.plot.<kind>()``, a labelled matplotlib artist), unless told ``legend=False``."""
    if _name(call) in PLACES:
        return True
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    if isinstance(keywords.get("legend"), ast.Constant) and keywords["legend"].value is False:
        return False
    labelled = any(isinstance(keywords.get(arg), ast.expr) and not (
        isinstance(keywords[arg], ast.Constant) and keywords[arg].value is None) for arg in ("label", "labels"))
    pandas = isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Attribute) and (
        call.func.value.attr == "plot")
    return "hue" in keywords or pandas or (labelled and _name(call) in LABELLED)


def _calls(node: ast.AST, into_functions: bool):
    """The calls under ``node``, with or without those in the bodies of the functions it defines."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not into_functions:
            continue
        if isinstance(child, ast.Call):
            yield child
        yield from _calls(child, into_functions)


def _code(cell: dict) -> ast.Module:
    lines = "".join(cell["source"]).splitlines()
    return ast.parse("\n".join(re.sub(r"^(\s*)[%!].*", r"\1pass", line) for line in lines))  # magics as no-ops


def chapter_legend_problems(cells: "list[dict]", name: str) -> list[str]:
    """Each code cell that places a legend itself, or makes one (directly or through a function the chapter
    defines) without ``report.legend_below``."""
    trees = [(number, _code(cell)) for number, cell in enumerate(cells) if cell["cell_type"] == "code"]
    makers = {function.name for _, tree in trees for function in ast.walk(tree) if isinstance(function, ast.FunctionDef)
              and any(makes_a_legend(call) for call in _calls(function, True))}
    problems = []
    for number, tree in trees:
        calls = list(_calls(tree, True))
        placed = [call for call in calls if _name(call) in PLACES]
        if placed:
            problems.append(f"{name}, cell {number}: places a legend itself ({ast.unparse(placed[0])[:60]})")
        made = [call for call in _calls(tree, False) if makes_a_legend(call) or _name(call) in makers]
        if made and not any(_name(call) == "legend_below" for call in calls):
            problems.append(f"{name}, cell {number}: makes a legend without report.legend_below "
                            f"({ast.unparse(made[0])[:60]})")
    return problems


@pytest.mark.parametrize("source, problem", [
    ("ax.plot([1], [2], label='a')\nax.legend()", "places a legend itself"),
    ("sns.barplot(data=d, x='a', y='b', hue='c')", "without report.legend_below"),
    ("d.plot.barh(stacked=True)", "without report.legend_below"),
    ("def draw(ax):\n    ax.stackplot(x, y, labels=names)\n", None),  # its caller is the one to place it
    ("draw(ax)", "without report.legend_below"),
])
def test_the_static_check_sees_a_legend_a_chapter_places_or_leaves_inside(source, problem):
    cells = [{"cell_type": "code", "source": "def draw(ax):\n    ax.stackplot(x, y, labels=names)\n"},
             {"cell_type": "code", "source": source}]
    found = chapter_legend_problems(cells, "a chapter")
    if problem is None:
        assert found == []
    else:
        assert any(problem in line and "cell 1" in line for line in found), found


def test_a_cell_that_puts_its_legend_below_or_asks_for_none_passes():
    cells = [{"cell_type": "code", "source": "ax = d.plot.barh()\nreport.legend_below(ax)"},
             {"cell_type": "code", "source": "sns.lineplot(data=d, x='a', y='b', hue='c', legend=False)"},
             {"cell_type": "code", "source": "%pip install x\nax.plot([1], [2], label=None)"}]
    assert chapter_legend_problems(cells, "a chapter") == []


def test_no_chapter_places_a_legend_inside_its_axes():
    problems = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        problems += chapter_legend_problems(json.loads(path.read_text())["cells"], path.name)
    assert not problems, "put these legends under the panels with report.legend_below:\n" + "\n".join(problems)


def package_legend_functions() -> set[str]:
    """Every function of ``optlab`` (``module:qualified name``) whose own body makes or places a legend."""
    found = set()
    for path in sorted((ROOT / "optlab").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        stack = [(node, node.name) for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        while stack:
            node, qualified = stack.pop()
            if isinstance(node, ast.FunctionDef) and any(makes_a_legend(call) for call in _calls(node, False)):
                found.add(f"{module}:{qualified}")
            stack += [(child, f"{qualified}.{child.name}") for child in ast.iter_child_nodes(node)
                      if isinstance(child, (ast.FunctionDef, ast.ClassDef))]
    return found


def test_every_package_function_that_makes_a_legend_is_drawn_here(monkeypatch):
    """Each function of ``optlab`` that makes or places a legend is on the stack when one of ``FIGURES`` makes its
    legend, so that the overlap test above checks where it puts it."""
    drawn = set()
    made = matplotlib.legend.Legend.__init__

    @functools.wraps(made)  # seaborn reads the signature
    def recording(self, *args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None:
            path = Path(frame.f_code.co_filename).resolve()
            if path.is_relative_to(ROOT / "optlab"):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                drawn.add(f"{module}:{frame.f_code.co_qualname}")
            frame = frame.f_back
        made(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.legend.Legend, "__init__", recording)
    for draw in FIGURES.values():
        figure = draw()
        plt.close(figure)
    expected = package_legend_functions()
    assert expected, "the static check found no legend in optlab"
    assert expected <= drawn, f"draw these in FIGURES: {sorted(expected - drawn)}"
