"""The plan of a reference run: its parts in priority order, breadth first within a set, with their estimates, what
a budget leaves out, and the plan as printed by ``--plan``.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import pandas as pd

from ...core.results import store
from ...core.machine.device import DeviceInfo, resolve_device
from ...core.knobs.profiles import Profile, get_profile
from ...core.techniques.registry import get_experiment
from ...core.techniques.cnn import technique_set
from .costs import TABLE_GPU, TABLE_S, TRAIN_STEP_S, config_assumption, estimate, runs_per_variant
from .parts_list import MANIFEST, Part, read_manifest, recorded, run_key
from .short_plan import describe_short_plan


PRIORITY = ("seed", "beyond", "stack", "compile", "transformer", "serving", "first_step")  # the sets' order; "all": every one


TECHNIQUE_ORDER = {  # within a set, where it differs: the headline comparisons first, compilation last
    "beyond": ("precision", "data_pipeline", "optimizers"),
    "transformer": ("gpt_all_together", "attention", "gpt_precision", "checkpointing", "gpt_optimizers", "gpt_shapes",
                    "gpt_compile", "gpt_compile_max_autotune"),
}


# The extra tables of each set: modules whose ``run_reference(out, device)`` measures and saves them (CUDA only).
EXTRAS = {
    "seed": ("ceilings", "microbench", "autotune"),
    "beyond": ("numerics", "tf32", "optimizer_bench", "cuda_graphs", "pipeline"),
    "stack": ("profiling", "learning"),  # profiling's "after" configuration compiles
    "compile": (),
    "transformer": (),
    "serving": ("serving",),  # serving a GPT: tables only
    "first_step": ("compile_time", "shapes"),  # the first step: tables only, each start a fresh process
}
STUDY_MODULES = {  # the module under optlab.studies of each table's study
    "microbench": "kernels.microbench", "autotune": "kernels.autotune", "numerics": "kernels.numerics",
    "tf32": "kernels.tf32", "cuda_graphs": "kernels.cuda_graphs", "optimizer_bench": "optimizer_bench",
    "pipeline": "pipeline", "profiling": "profiling", "learning": "learning", "serving": "serving.batching",
    "ceilings": "limits.ceilings",
    "compile_time": "first_step.compile_time", "shapes": "first_step.shapes",
}


PART_MARGIN = 0.2  # a part's estimate leaves this share of PART_LIMIT_S free; --plan warns where it does not


PART_LIMIT_S = 300  # no part may need more than 5 minutes: a killed command loses only the part it was in


CHEAP_TABLE_S = 60  # a set's tables this cheap run right after its techniques on the first model


STARTUP_S = 15.0  # from the process start to the first part: imports, the CUDA context, the data sets


PACK_RESERVE_S = 10.0  # kept free before the deadline: the last part's record, the log and the archive


SHARE_FACTOR, SHARE_SLACK_S = 1.5, 10.0  # a part stops at a repeat's end past 1.5 x its estimate + 10 s


OVERRUN_GRACE_S = 60.0  # a technique part is ended where it stands this long past its share: a repeat's end


def part_limit_s(part: Part) -> tuple[float, float]:
    """Seconds from ``part``'s start to its soft deadline (a technique's run stops at the end of a repeat past it) and
    to its hard one (the part is ended where it stands, what it finished kept): :data:`SHARE_FACTOR` x its estimate
    + :data:`SHARE_SLACK_S`, the hard one :data:`OVERRUN_GRACE_S` later for a technique (a study's tables have no
    repeats), neither past :data:`PART_LIMIT_S`. A run's deadline may end either sooner."""
    share = part.estimate_s * SHARE_FACTOR + SHARE_SLACK_S
    return min(share, PART_LIMIT_S), min(share + (OVERRUN_GRACE_S if part.technique else 0.0), PART_LIMIT_S)


RECIPE = ("python3 -m optlab reference --set seed --max-repeats 4 --budget 540 --archive h200.tar.gz",
          "the whole seed set at 4 repeats, the machine's ceilings first: about 8 of the 8.6 minutes --budget 540 leaves "
          "for parts")


def part_assumptions(part: Part, profile: Profile) -> list[str]:
    """The assumptions behind a technique part's table estimate, one line per variant (none for a study's tables)."""
    if not part.technique:
        return []
    configs = get_experiment(part.technique).configs(part.model, profile)
    return [f"  {label}: {config_assumption(config)}" for label, config in configs.items()]


def set_names(set_name: str) -> tuple[str, ...]:
    """The sets ``set_name`` stands for, in priority order (an unknown name is an OptlabError)."""
    technique_set(set_name)
    return PRIORITY if set_name == "all" else (set_name,)


def measured_seconds(gpu: str | None, profile: Profile, folders: Iterable[Path]) -> dict[str, tuple[float, str]]:
    """Seconds that earlier runs measured per part on GPU ``gpu`` (None: any H200, the table's GPU) in ``profile``,
    from the ``reference-parts.csv`` of ``folders``: a technique's part scaled to ``profile``'s repeats, a study's
    tables as they were. The latest ok row of each part wins; each value comes with the folder that measured it."""
    frames = [read_manifest(folder).assign(folder=folder.name) for folder in folders if (folder / f"{MANIFEST}.csv").is_file()]
    frames = [frame for frame in frames if {"device_name", "status", "profile", "seconds"} <= set(frame)]
    if not frames:
        return {}
    rows = pd.concat(frames, ignore_index=True)
    machine = rows["device_name"] == gpu if gpu else rows["device_name"].str.contains(TABLE_GPU, case=False, na=False)
    rows = rows[machine & (rows["status"] == "ok") & (rows["profile"] == profile.name)]
    rows = rows.sort_values("finished", kind="stable") if "finished" in rows else rows
    found = {}
    for row in rows.to_dict(orient="records"):
        seconds, then = float(row["seconds"]), pd.to_numeric(row.get("repeats"), errors="coerce")
        if not row["part"].endswith(" tables") and pd.notna(then) and then > 0:
            seconds *= runs_per_variant(profile) / then
        found[row["part"]] = (seconds, row["folder"])
    return found


def reference_folders(out: str | Path | None) -> list[Path]:
    """Where earlier runs' parts lists are looked for: every machine under ``results/reference``, and ``out``."""
    folders = [store.REFERENCE_DIR / name for name in store.reference_machines()]
    if out is not None and Path(out).is_dir() and Path(out).resolve() not in {f.resolve() for f in folders}:
        folders.append(Path(out))
    return folders


MODEL_ORDER = tuple(sorted(TRAIN_STEP_S, key=TRAIN_STEP_S.get))  # the depth of a set, cheapest model first


def _depth(part: Part) -> int:
    """Where a part falls in its set, breadth first: the first model's techniques, the cheap tables, the other models
    from the cheapest, the dear tables."""
    if part.module:
        return 1 if part.estimate_s <= CHEAP_TABLE_S else 2 * len(MODEL_ORDER)
    return 2 * MODEL_ORDER.index(part.model) if part.model in MODEL_ORDER else 2 * len(MODEL_ORDER) - 1


def plan(set_name: str, profile: Profile, measured: dict[str, tuple[float, str]] | None = None) -> list[Part]:
    """Every part of ``set_name`` (``all``: of every set) in priority order, breadth first within a set (every
    technique on ResNet18, the cheap tables, then the other models from the cheapest), with steps and estimates:
    ``measured`` seconds (:func:`measured_seconds`) where a part has them, else the H200 table's."""
    parts = []
    for name in set_names(set_name):
        order = TECHNIQUE_ORDER.get(name, ())
        techniques = sorted(technique_set(name), key=lambda t: order.index(t) if t in order else len(order))
        in_set = []
        for technique in techniques:
            experiment = get_experiment(technique)
            for model in experiment.default_models(profile):
                steps, seconds = estimate(experiment, experiment.configs(model, profile), profile)
                in_set.append(Part(name, f"{technique} {model}", steps, seconds, technique=technique, model=model,
                                   needs_cuda=experiment.needs_cuda))
        in_set += [Part(name, f"{module} tables", 0, TABLE_S[module], module=module, needs_cuda=True)
                   for module in EXTRAS[name]]
        parts += sorted(in_set, key=_depth)
    measured = measured or {}
    return [replace(part, estimate_s=measured[part.name][0], estimate_from=f"measured ({measured[part.name][1]})")
            if part.name in measured else part for part in parts]


def available_s(budget_s: float | None) -> float:
    """Seconds a plan may fill under ``budget_s`` counted from the process start: less the start-up and the
    reserve kept for packing (infinite without a budget)."""
    return math.inf if budget_s is None else budget_s - STARTUP_S - PACK_RESERVE_S


def plan_table(parts: list[Part], done: set[str], budget_s: float | None, cuda: bool) -> pd.DataFrame:
    """The plan as a table: each part's set, steps, estimate, and what this command would do with it. A part that
    does not fit in what is left of the budget is skipped, and the later ones that fit still run."""
    rows, spent, room = [], 0.0, available_s(budget_s)
    for part in parts:
        if part.name in done:
            action = "recorded: skip"
        elif part.needs_cuda and not cuda:
            action = "needs CUDA: skip"
        elif spent + part.estimate_s > room:
            action = "left: over budget"
        else:
            action, spent = "run", spent + part.estimate_s
        rows.append({"set": part.set_name, "part": part.name, "steps": part.steps,
                     "est_s": round(part.estimate_s, 1), "deadline_s": math.floor(min(part_limit_s(part)[1], room)),
                     "estimate from": part.estimate_from, "this run": action})
    return pd.DataFrame(rows)


def _stage(part: Part) -> str:
    return "tables" if part.module else part.model or ""


def cut_lines(parts: list[Part], table: pd.DataFrame) -> list[str]:
    """What each cut would lose: for each stage of the run order (a model's parts, a set's tables), the minutes
    by which it ends, and what a budget that ends before it leaves out."""
    todo = table["this run"].isin(["run", "left: over budget"]).tolist()
    stages: list[tuple[str, str, float]] = []  # (set, stage, seconds at its end)
    elapsed = 0.0
    for part, listed in zip(parts, todo):
        if not listed:
            continue
        elapsed += part.estimate_s
        if stages and stages[-1][:2] == (part.set_name, _stage(part)):
            stages[-1] = (part.set_name, _stage(part), elapsed)
        else:
            stages.append((part.set_name, _stage(part), elapsed))
    lines = []
    for index, (set_name, stage, end) in enumerate(stages):
        lost = ", ".join(f"{s} {g}" for s, g, _ in stages[index:])
        lines.append(f"cut: --budget {math.ceil(end + STARTUP_S + PACK_RESERVE_S)} s runs set {set_name} through "
                     f"{stage}; less loses parts of: {lost}")
    return lines


def reference_profile(profile: str | Profile | None, cuda: bool, repeats: int | None = None,
                      max_repeats: int | None = None, time_budget_s: float | None = None) -> Profile:
    """The run's profile (``auto``: quick on CUDA), with the minimum and cap of repeats and the time budget given."""
    return get_profile(profile, cuda).with_sizes(repeats=repeats, max_repeats=max_repeats, time_budget_s=time_budget_s)


def target_gpu(info: DeviceInfo) -> str | None:
    """The GPU whose measured seconds a plan uses: this one on CUDA; elsewhere None (any H200, the table's GPU)."""
    return info.name if info.is_cuda else None


def describe_plan(set_name: str = "all", profile: str | Profile | None = None, device: str = "auto",
                  out: str | Path | None = None, budget_s: float | None = None, repeats: int | None = None) -> str:
    """The plan of ``set_name`` as printed text: every part with where its estimate came from, each set's total in
    minutes, what each cut would lose, and the recipe that fits one 10-minute command."""
    info = resolve_device(device)
    prof = reference_profile(profile, True, repeats)  # the reference's profile on a GPU: quick, unless one is named
    gpu = target_gpu(info)
    parts = plan(set_name, prof, measured_seconds(gpu, prof, reference_folders(out)))
    done = recorded(parts, Path(out), run_key(info), prof) if out is not None and Path(out).is_dir() else set()
    table = plan_table(parts, done, budget_s, info.is_cuda)
    totals = table.groupby("set", sort=False)["est_s"].agg(["count", "sum"])
    lines = [f"reference plan, profile {prof.name} ({prof.describe_repeats()}): estimated seconds on "
             f"{gpu or f'one {TABLE_GPU}'}, measured by an earlier run on it where a "
             f"results/reference/<machine>/{MANIFEST}.csv has the part, else from the {TABLE_GPU} step-time table "
             "(optlab/commands/reference/costs.py)", table.to_string(index=False), ""]
    lines += [f"set {name}: {int(row['count'])} parts, {row['sum'] / 60:.1f} min" for name, row in totals.iterrows()]
    measured = sum(part.estimate_from != "table" for part in parts)
    lines.append(f"estimates: {measured} part(s) measured, {len(parts) - measured} from the table")
    runs = table["this run"] == "run"
    lines.append(f"all listed: {table['est_s'].sum() / 60:.1f} min; the command would run "
                 f"{table['est_s'][runs].sum() / 60:.1f} min of it"
                 + (f" within --budget {budget_s:g} s (a deadline from the process start: {STARTUP_S:g} s of start-up "
                    f"and {PACK_RESERVE_S:g} s to pack are kept out, {available_s(budget_s) / 60:.1f} min for parts)"
                    if budget_s is not None else ""))
    over = int((table["this run"] == "left: over budget").sum())
    if over:
        lines.append(f"left for a later run: {over} part(s); each part that does not fit is skipped and the later "
                     "ones that fit still run")
    lines += cut_lines(parts, table)
    lines.append(f"recipe for one 10-minute command on an {TABLE_GPU}: {RECIPE[0]} ({RECIPE[1]}); a part that runs "
                 f"past {SHARE_FACTOR:g} x its estimate + {SHARE_SLACK_S:g} s stops at the end of a repeat, every "
                 f"part is ended at its deadline_s (a study's tables there, a technique {OVERRUN_GRACE_S:g} s later; "
                 f"never past {PART_LIMIT_S} s or the budget) and the run goes on, one that would end past the "
                 "deadline is skipped, and the archive is packed after every part: run the same command again to add "
                 "what was left")
    lines += [f"warning: {part.name} may need more than {PART_LIMIT_S} s" for part in parts
              if part.estimate_s > PART_LIMIT_S]
    lines += [f"warning: {part.name} ({part.estimate_s:.0f} s) leaves less than {PART_MARGIN:.0%} of its "
              f"{PART_LIMIT_S} s part free" for part in parts
              if (1 - PART_MARGIN) * PART_LIMIT_S < part.estimate_s <= PART_LIMIT_S]
    lines.append(f"assumptions per part (the {TABLE_GPU} table's, where a part's estimate is from the table):")
    for part in parts:
        if part.estimate_from == "table" and part.technique:
            lines += [f"{part.name}:", *part_assumptions(part, prof)]
    lines += ["", "the plan for a short GPU job (book/using/gpu.md shows the same):", describe_short_plan()]
    return "\n".join(lines)
