"""The roofline figure: each variant's achieved FLOP/s at its arithmetic intensity, under the machine's measured roofs
(solid: the best matmul rate of each dtype, and the best copy or read bandwidth) and the datasheet's (dotted)."""
from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ...studies.limits.ceilings import Roofs

WIDTH_IN = 7.0  # the article's width
BOUND_MARKERS = {"compute": "o", "memory": "s", "launch": "X"}
DTYPE_COLOURS = {"fp32": "#0173b2", "tf32": "#56b4e9", "bf16": "#de8f05", "fp16": "#cc78bc", "fp8": "#029e73"}
KEY_WIDTH = 100  # characters per line of the key under the plot (9 points: the article's width)


def plot_roofline(points: pd.DataFrame, roofs: Roofs, title: str = "",
                  datasheet: "tuple[dict[str, float], float] | None" = None) -> Figure:
    """``points`` (columns ``label``, ``FLOP/byte``, ``TFLOP/s``, ``bound``, ``precision``): one numbered point each,
    its marker by what bounds it; ``roofs`` the measured ceilings; ``datasheet`` (TFLOP/s by dtype, TB/s) dotted."""
    key = [textwrap.fill(f"{number}. {label}", KEY_WIDTH, subsequent_indent="    ")
           for number, label in enumerate(points["label"], start=1)]
    key_lines = sum(entry.count("\n") + 1 for entry in key)
    legend_lines = (len(roofs.flops_per_s) * (2 if datasheet else 1) + len(BOUND_MARKERS) + 2) // 2 + 1
    figure, (ax, legend_ax, key_ax) = plt.subplots(
        3, 1, figsize=(WIDTH_IN, 4.2 + 0.2 * (key_lines + legend_lines)), layout="constrained",
        height_ratios=(4.2, 0.2 * legend_lines, 0.05 + 0.2 * key_lines))
    low = min(points["FLOP/byte"].min() / 4, 0.5) if not points.empty else 0.5
    high = max(points["FLOP/byte"].max() * 4, 1e3) if not points.empty else 1e3
    intensity = np.geomspace(low, high, 200)
    bandwidth = roofs.bytes_per_s
    for dtype, rate in roofs.flops_per_s.items():
        ax.plot(intensity, np.minimum(intensity * bandwidth, rate) / 1e12, color=DTYPE_COLOURS.get(dtype, "black"),
                lw=2, label=f"measured {dtype}: MAMF {rate / 1e12:.3g} TFLOP/s, {bandwidth / 1e9:.3g} GB/s")
    for dtype, tflops in (datasheet[0] if datasheet else {}).items():
        if dtype in roofs.flops_per_s:
            ax.plot(intensity, np.minimum(intensity * datasheet[1] * 1e12, tflops * 1e12) / 1e12, ls=":", lw=1.5,
                    color=DTYPE_COLOURS.get(dtype, "black"),
                    label=f"datasheet {dtype}: {tflops:g} TFLOP/s, {datasheet[1]:g} TB/s")
    for number, point in enumerate(points.to_dict("records"), start=1):
        x, y = point["FLOP/byte"], point["TFLOP/s"]
        ax.scatter([x], [y], marker=BOUND_MARKERS.get(point["bound"], "o"), s=70, edgecolor="black", zorder=3,
                   color=DTYPE_COLOURS.get(point["precision"], "black"))
        ax.annotate(str(number), (x, y), xytext=(5, 4), textcoords="offset points", fontsize=10)
        if point.get("operators x launch ms", 0) > 0:  # the rate its launches alone allow: FLOPs / launch time
            ax.scatter([x], [y * point["step ms"] / point["operators x launch ms"]], marker="_", s=300, color="grey")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per byte, by the stated byte model)",
           ylabel="TFLOP/s", title=title)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], marker="_", ms=14, ls="", color="grey",
                          label="launch roof of a point: FLOPs / (operators x launch overhead)"))
    handles += [Line2D([], [], marker=marker, ls="", color="grey", markeredgecolor="black", label=f"{bound}-bound")
                for bound, marker in BOUND_MARKERS.items()]
    legend_ax.axis("off")
    legend_ax.legend(handles=handles, fontsize=9, loc="upper left", ncol=2, frameon=False)
    key_ax.axis("off")
    key_ax.text(0, 1, "\n".join(key), fontsize=9, va="top", ha="left", transform=key_ax.transAxes)
    plt.close(figure)  # shown by the caller, once
    return figure
