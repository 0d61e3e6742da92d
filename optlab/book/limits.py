"""How far from the limit: every stored training result against the ceilings measured on its machine.

A source is the live results (``results/live``: the chapters' records and the ceilings chapter 15 measures) or one
stored reference machine (``results/reference/<machine>``: its records and the ``ceilings.csv`` its reference run
keeps). Each timed training variant becomes a point with its config and step time; the table keeps the fastest
variant of each workload and model, the roofline figure a workload's stack (its all-together chapter's steps).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from ..core.knobs.config import RunConfig
from ..core.results import store
from ..studies.limits import ceilings, roofline
from ..studies.limits.peaks import DATASHEET_TFLOPS, is_mig
from ..studies.serving.bandwidth import datasheet_peak as datasheet_bandwidth
from .report import LIVE, linked_sources
from .report.roofline import plot_roofline

STACKS = {"cifar": "all_together", "gpt": "gpt_all_together"}  # the variants a workload's roofline shows
NO_CEILINGS = ("no measured ceilings for {source}: chapter 15 measures the live ones, `python -m optlab ceilings "
               "--out results/live` does too, and a reference run keeps its machine's")


def record_points(folder: Path) -> pd.DataFrame:
    """One row per timed training variant of every record in ``folder``: workload, model, technique, variant, the
    effective config, step ms, throughput and the GPU it ran on. Records of another shape (a study's own) are
    skipped."""
    rows = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        record = store.load_record(path)
        configs = record.get("effective_configs") or {}
        for row in record.get("summary") or []:
            config = configs.get(row.get("model"), {}).get(row.get("variant"))
            if row.get("phase") != "train" or config is None or not (row.get("step_ms") or 0) > 0:
                continue
            rows.append({"workload": config.get("workload", "cifar"), "model": row["model"],
                         "technique": record.get("technique", ""), "variant": row["variant"],
                         "config": RunConfig(**config), "step_ms": row["step_ms"],
                         "items_per_s": row.get("items_per_s") or row.get("images_per_s"),
                         "unit": row.get("unit") or "images",
                         "gpu_name": record.get("environment", {}).get("gpu_name") or ""})
    return pd.DataFrame(rows)


def sources() -> dict[str, tuple[pd.DataFrame, pd.DataFrame | None]]:
    """Each source's points and ceilings table (None where none was measured)."""
    found = {LIVE: (record_points(store.LIVE_DIR), ceilings.load())}
    for machine in store.reference_machines():
        folder = store.REFERENCE_DIR / machine
        found[machine] = record_points(folder), ceilings.load(folder)
    return found


def datasheet_roofs(gpu_name: str) -> tuple[dict[str, float], float] | None:
    """The datasheet's TFLOP/s by dtype and TB/s of a GPU optlab's tables know, else None (a MIG slice too: the
    table's rates are the whole GPU's; its measured ceilings are its own)."""
    if not gpu_name or is_mig(gpu_name):
        return None
    bandwidth = datasheet_bandwidth(gpu_name)
    for fragments, _, rates in DATASHEET_TFLOPS:
        if bandwidth and all(f.upper() in gpu_name.upper() for f in fragments):
            return rates, bandwidth.bytes_per_s / 1e12
    return None


def limits_table(found: dict | None = None) -> pd.DataFrame:
    """The fastest training variant of each workload and model per source, against that source's ceilings: achieved
    TFLOP/s, MFU against the measured MAMF and the datasheet, bandwidth by the byte model and MBU, operators times
    the launch overhead, what bounds it and the share of that ceiling it reached (the datasheet's fractions and the
    counts in the page's "all columns" block)."""
    frames = []
    for name, (points, table) in (sources() if found is None else found).items():
        if points.empty or table is None:
            continue
        best = points.loc[points.groupby(["workload", "model"], sort=False)["items_per_s"].idxmax()]
        best = best.assign(source=name, best=best["technique"] + ": " + best["variant"])
        frames.append(roofline.limits_table(best[["source", "workload", "model", "best", "config", "step_ms",
                                                  "gpu_name"]], ceilings.Roofs.from_table(table)))
    if not frames:
        return pd.DataFrame(columns=["source", "workload", "model", "best"])
    return roofline.for_page(pd.concat(frames, ignore_index=True).set_index(["source", "workload", "model"]))


def published_ceilings() -> pd.DataFrame:
    """Others' measured MAMF (:func:`optlab.studies.limits.ceilings.published`) as the page shows them: each source a link,
    the shape and the notes in the collapsed "all columns" block."""
    table = linked_sources(ceilings.published())
    table.attrs.update(keys=["accelerator", "dtype"], details=["best_shape", "notes"])
    return table


def roofline_points(points: pd.DataFrame, roofs: ceilings.Roofs, workload: str) -> pd.DataFrame:
    """A workload's roofline points: its stack's training variants where that chapter ran, else every variant of
    its first model; each with what bounds it."""
    mine = points[points["workload"] == workload] if not points.empty else points
    if mine.empty:
        return pd.DataFrame(columns=["label", "FLOP/byte", "TFLOP/s", "bound", "precision"])
    stack = mine[mine["technique"] == STACKS.get(workload)]
    mine = stack if not stack.empty else mine[mine["model"] == mine["model"].iloc[0]]
    mine = mine.drop_duplicates(["technique", "model", "variant"], keep="last")
    table = roofline.limits_table(mine[["technique", "model", "variant", "config", "step_ms", "gpu_name"]], roofs)
    labels = table["model"] + ", " + table["technique"] + ": " + table["variant"]
    return table.assign(label=labels)


def timed_points(configs: dict[str, RunConfig], roofs: ceilings.Roofs, device: str = "auto") -> pd.DataFrame:
    """Each labelled config's training step timed here (``roofline.time_steps``) against ``roofs``: the limits
    table with a ``label`` column, ready for the roofline figure (a GPU's datasheet peak found by its name, which
    no CPU's name matches)."""
    points = pd.DataFrame([{"label": label, "config": config, "gpu_name": roofs.device,
                            "step_ms": 1e3 * roofline.time_steps(config, device)} for label, config in configs.items()])
    return roofline.limits_table(points, roofs)


def plot_rooflines(found: dict | None = None, workloads: tuple[str, ...] = ("cifar", "gpt")) -> list[Figure]:
    """One roofline per source and workload with points, under that source's ceilings."""
    figures = []
    for name, (points, table) in (sources() if found is None else found).items():
        if table is None:
            print(NO_CEILINGS.format(source=name))
            continue
        roofs = ceilings.Roofs.from_table(table)
        for workload in workloads:
            chosen = roofline_points(points, roofs, workload)
            if chosen.empty:
                continue
            gpu = points["gpu_name"].iloc[0] if not points.empty else ""
            figures.append(plot_roofline(chosen, roofs, f"{workload} on {roofs.device} ({name})", datasheet_roofs(gpu)))
    return figures
