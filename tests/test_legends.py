"""A figure's legend covers no title and no data: drawn with Agg, every legend's box (a figure's or an axes') lies
clear of every visible axes' data area and of every title (an axes' title, a figure's suptitle), for each figure of
``optlab.book.report`` that has a legend, at one panel and at several."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
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
