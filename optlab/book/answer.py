"""The summary page's first screen: per workload (CNN training, CNN inference, GPT training, serving), which techniques
were faster, the same or slower here, or can't tell yet, beside the seed's V100 figure and every stored GPU reference.

A technique is one line per workload: its verdicts over the models (or batch sizes, or request rates) it ran on are
summarised ("faster on 2 of 2 models, 1.30–1.80x"), and a line whose models disagree reads "mixed" with each part.
The CNN and GPT lines come from the chapters' records (``summary_page.sources``); the serving lines from the tables the
serving chapters keep (``results/live/pages/``) and the same tables in each stored GPU reference folder. Everything is
read from those files: a workload with no record says so in one line.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..core.measuring.timing import FASTER, SAME, SLOWER
from ..core.results import store
from ..core.results.seed import seed_speedups
from ..core.stats.summary import CONTROL
from ..core.techniques.cnn import SEED_TECHNIQUES
from ..core.techniques.no_effect import is_no_effect
from ..core.techniques.registry import REGISTRY
from .downloads import PAGE_RUNS
from .report import LIVE, VERDICT_COLOURS, ratio

WORKLOADS = ("CNN training", "CNN inference", "GPT training", "serving")
BY_PHASE = {("cifar", "train"): "CNN training", ("cifar", "test"): "CNN inference", ("gpt", "train"): "GPT training"}
# the groups, in the order the page lists them; a line's verdicts on its models give its group
GROUPS = ("faster", "the same", "slower", "mixed", "can't tell yet", "no effect here", "not run here")
KIND = {FASTER: "faster", SAME: "the same", SLOWER: "slower"}
NO_RECORD = "no record yet"
NOT_COMPARED = ("baseline", "reference")  # a variant against itself: no answer


@dataclass(frozen=True)
class ServingTable:
    """A table a serving chapter keeps, read as lines of the answer: which columns hold what."""

    names: tuple[str, ...]  # the file's name under results/live/pages, then under a reference folder
    technique: str
    label: str | None  # the column naming each variant; None: the whole table is one line, named ``technique``
    setting: str | None  # the column of the setting a line is summarised over (batch, rate); None: one setting
    noun: str  # what the setting is, for "on 2 of 3 batch sizes"
    speedup: str
    low: str
    high: str
    verdict: str = "verdict"


SERVING_TABLES = (
    ServingTable(("kv-cache-and-compiled-decoding-timings",), "KV cache", "variant", None, "setting",
                 "decode speed-up", "low", "high"),
    ServingTable(("weight-only-quantization-decode-timings",), "quantization", "variant", "batch", "batch size",
                 "speed-up", "low", "high"),
    ServingTable(("speculative-decoding-timings",), "speculative decoding", "variant", None, "setting",
                 "speedup", "ci_low", "ci_high"),
    ServingTable(("decode-sweep", "serving-decode-sweep"), "batching (throughput against batch 1)", None,
                 "batch", "batch size", "throughput x", "low", "high"),
    ServingTable(("serving-verdicts",), "continuous batching (latency against static)", None, "rate",
                 "request rate", "speed-up", "low", "high"),
)
TIDY = ["workload", "source", "line", "technique", "variant", "phase", "setting", "noun", "speedup", "verdict"]


def kind(verdict: object) -> str:
    """The group a single verdict belongs to: faster, the same, slower, no effect here, or can't tell yet."""
    if is_no_effect(verdict):
        return "no effect here"
    return KIND.get(verdict, "can't tell yet")


def technique_rows(found: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every source's compared variants of the registry's techniques as tidy rows (``TIDY``), by workload: baselines,
    A/A controls and phases outside the four workloads (the GPT's inference) left out. A line is "technique: variant",
    or the technique alone where that variant is the only one it compares with its baseline."""
    frames = []
    for source, rows in found.items():
        if rows.empty or "technique" not in rows:
            continue
        rows = rows[rows["technique"].isin(list(REGISTRY)) & ~rows["verdict"].isin(NOT_COMPARED)]
        if "role" in rows:
            rows = rows[rows["role"] != CONTROL]
        workload = [BY_PHASE.get((REGISTRY[t].workload, p)) for t, p in zip(rows["technique"], rows["phase"])]
        line = [t if REGISTRY[t].labels[1:] == [v] else f"{t}: {v}" for t, v in zip(rows["technique"], rows["variant"])]
        rows = rows.assign(workload=workload, source=source, setting=rows["model"], noun="model", line=line)
        frames.append(rows[rows["workload"].notna()].drop_duplicates(["line", "phase", "setting"], keep="last"))
    return pd.concat(frames, ignore_index=True).reindex(columns=TIDY) if frames else pd.DataFrame(columns=TIDY)


def _kept(table: ServingTable, folder: Path) -> pd.DataFrame | None:
    path = next((folder / f"{name}.csv" for name in table.names if (folder / f"{name}.csv").exists()), None)
    return None if path is None else pd.read_csv(path)


def serving_rows() -> pd.DataFrame:
    """The serving chapters' kept tables (live, and each stored GPU reference's) as tidy rows (``TIDY``); a table
    without the columns its ``ServingTable`` names is an error that names them."""
    folders = {LIVE: store.LIVE_DIR / PAGE_RUNS}
    folders.update({machine: store.REFERENCE_DIR / machine for machine in store.reference_machines()})
    frames = []
    for source, folder in folders.items():
        for table in SERVING_TABLES:
            kept = _kept(table, folder)
            if kept is None:
                continue
            needed = [c for c in (table.label, table.setting, table.speedup, table.verdict) if c]
            if missing := [column for column in needed if column not in kept]:
                raise ValueError(f"{folder / table.names[0]}.csv has no column {', '.join(map(repr, missing))}; "
                                 f"its columns: {', '.join(map(str, kept.columns))}")
            kept = kept[~kept[table.verdict].isin(NOT_COMPARED)]
            label = kept[table.label] if table.label else table.technique
            setting = kept[table.setting].map(lambda v: f"{table.setting} {v:g}" if isinstance(v, float)
                                              else f"{table.setting} {v}") if table.setting else ""
            frames.append(pd.DataFrame({
                "workload": "serving", "source": source, "technique": table.technique, "variant": label,
                "line": (table.technique + ": " + kept[table.label]) if table.label else table.technique,
                "phase": "decode", "setting": setting, "noun": table.noun, "speedup": kept[table.speedup],
                "verdict": kept[table.verdict]}, index=kept.index))
    return pd.concat(frames, ignore_index=True).reindex(columns=TIDY) if frames else pd.DataFrame(columns=TIDY)


def span(values: "pd.Series | list[float]") -> str:
    """"1.10x", or "1.10–1.30x" from the smallest to the largest of ``values`` (NaN left out); "" without any."""
    values = pd.Series(values, dtype=float).dropna()
    if values.empty:
        return ""
    low, high = ratio(values.min()), ratio(values.max())
    return f"{low}x" if low == high else f"{low}–{high}x"


def summarise(rows: pd.DataFrame, every: "set[str] | None" = None) -> tuple[str, str]:
    """One source's verdicts of one line over its settings: its group and its text: "1.10x (resnet18)", "on 2 of 2
    models, 1.30–1.80x", or for a mixed line "of 3 models: faster on 2 (1.20–1.30x), can't tell yet 0.980x";
    where the line ran on ``every`` setting of its workload (named once for all), the settings are left out
    ("1.30–1.80x")."""
    kinds = rows["verdict"].map(kind)
    count, noun, settings = len(rows), rows["noun"].iloc[0], set(rows["setting"])
    named = settings != every
    if kinds.nunique() == 1:
        group, times = kinds.iloc[0], span(rows["speedup"])
        if not named:
            return group, times
        if count > 1:
            return group, f"on {count} of {count} {noun}s" + (f", {times}" if times else "")
        setting = rows["setting"].iloc[0]
        return group, " ".join(filter(None, (times, f"({setting})" if times and setting else setting)))
    parts = []
    for group in (g for g in GROUPS if g in set(kinds)):
        part = rows[kinds == group]
        times = span(part["speedup"])
        parts.append(" ".join(filter(None, (group, f"on {len(part)}" if len(part) > 1 else "",
                                            f"({times})" if times and len(part) > 1 else times))))
    return "mixed", (f"of {count} {noun}s: " if named else "") + ", ".join(parts)


def seed_figures() -> pd.Series:
    """The seed's V100 speed-up of every compared variant, by technique, variant, model and phase."""
    frames = []
    for name in SEED_TECHNIQUES:
        rows = seed_speedups(name)
        frames.append(rows[rows["variant"] != REGISTRY[name].baseline_label])
    return pd.concat(frames, ignore_index=True).set_index(["technique", "variant", "model", "phase"])["speedup"]


def _seed(seed: pd.Series, rows: pd.DataFrame) -> list[float]:
    """The seed's figures on the models ours ran the line on, where the seed measured them."""
    keys = {(t, v, m, p) for t, v, m, p in zip(rows["technique"], rows["variant"], rows["setting"], rows["phase"])}
    return [float(seed[key]) for key in sorted(keys) if key in seed.index]


FIGURES = ["workload", "on", "group", "technique", "line", "here", "seed V100", "low", "high", "seed low", "seed high"]
ENDS = ("low", "high")  # each reference's smallest and largest speed-up, in the columns "<machine> low" and "high"


def answer_frame(found: dict[str, pd.DataFrame], serving: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per workload and line: its group (from the live run; "not run here" where only a stored reference has
    it), the live text, the seed's V100 figure (where the seed measured the same), the smallest and largest speed-up
    of each, and per stored GPU reference its group and range (and ``ENDS``); ``on``: the models the workload's live
    lines ran on, named there once (a line that ran on all of them does not name them). A workload without any line
    is one row reading ``NO_RECORD``."""
    tidy = pd.concat([technique_rows(found), serving_rows() if serving is None else serving], ignore_index=True)
    machines = sorted((set(tidy["source"]) | set(found)) - {LIVE})
    seed = seed_figures()
    rows = []
    for workload in WORKLOADS:
        ours = tidy[tidy["workload"] == workload]
        if ours.empty:
            rows.append(dict.fromkeys(FIGURES, "") | {"workload": workload, "group": NO_RECORD}
                        | dict.fromkeys(machines, "") | {f"{m} {end}": float("nan") for m in machines for end in ENDS})
            continue
        live_rows = ours[ours["source"] == LIVE]
        every = set(live_rows["setting"]) if set(live_rows["noun"]) == {"model"} else None  # named once, above
        on = ", ".join(sorted(every)) if every else ""
        for line, mine in ours.groupby("line", sort=False):
            live = mine[mine["source"] == LIVE]
            group, here = summarise(live, every) if not live.empty else ("not run here", "")
            figures = _seed(seed, mine)
            row = {"workload": workload, "on": on, "group": group, "technique": mine["technique"].iloc[0],
                   "line": line, "here": here, "seed V100": span(figures), "low": live["speedup"].min(),
                   "high": live["speedup"].max(), "seed low": min(figures, default=float("nan")),
                   "seed high": max(figures, default=float("nan"))}
            for machine in machines:
                theirs = mine[mine["source"] == machine]
                group = summarise(theirs)[0] if len(theirs) else ""
                row[machine] = " ".join(filter(None, (group, span(theirs["speedup"]))))
                row[f"{machine} low"], row[f"{machine} high"] = theirs["speedup"].min(), theirs["speedup"].max()
            rows.append(row)
    frame = pd.DataFrame(rows)
    order = {name: i for i, name in enumerate((*GROUPS, NO_RECORD))}
    frame = frame.assign(_workload=frame["workload"].map(WORKLOADS.index), _group=frame["group"].map(order))
    return frame.sort_values(["_workload", "_group"], kind="stable").drop(columns=["_workload", "_group"])


BRIEF = ("mixed", "can't tell yet", "no effect here")  # groups with no one answer: a technique named, its variants counted
MANY = 2  # a technique with this many variants in one group shows them as a count and a range
GROUP_COLOURS = {"faster": VERDICT_COLOURS[FASTER], "the same": VERDICT_COLOURS[SAME],
                 "slower": VERDICT_COLOURS[SLOWER]}


@dataclass(frozen=True)
class Answer:
    """The per-workload answer as the page shows it: a compact table, one row per workload, a line per group in it
    (its name coloured as the figures colour the verdict), the groups with no one answer (``BRIEF``) sharing one line.
    A technique's one variant in a group is given by its figure, its variants counted with the range of their
    speed-ups where there are ``MANY``; in a ``BRIEF`` group only the technique is named, its variants counted."""

    frame: pd.DataFrame

    @property
    def machines(self) -> list[str]:
        return [c for c in self.frame.columns if c not in FIGURES and not c.endswith(tuple(f" {e}" for e in ENDS))]

    def _beside(self, seed: str, theirs: dict[str, str]) -> str:
        beside = [f"V100 {seed}"] if seed else []
        beside += [f"{machine}: {text}" for machine, text in theirs.items() if text]
        return f" <span class='optlab-beside'>[{html.escape('; '.join(beside))}]</span>" if beside else ""

    def _item(self, group: str, technique: str, part: pd.DataFrame) -> str:
        name = f"<b>{html.escape(technique)}</b>"
        beside = self._beside(span([part["seed low"].min(), part["seed high"].max()]),
                            {m: span([part[f"{m} low"].min(), part[f"{m} high"].max()]) for m in self.machines})
        if group in BRIEF:  # no one answer: the technique's name, its variants counted; the tables give the rest
            return name + (f" ({len(part)})" if len(part) > 1 else "") + beside
        if len(part) >= MANY:
            times = span([part["low"].min(), part["high"].max()])
            return f"{name} ({len(part)} variants{', ' + times if times else ''}){beside}"
        return f"{name} {html.escape(part['here'].iloc[0])}{beside}"  # one variant: its figure (the tables name it)

    def _cell(self, rows: pd.DataFrame) -> str:
        answered, brief = [], []
        for group, part in rows.groupby("group", sort=False):
            if group == NO_RECORD:
                return html.escape(NO_RECORD)
            colour = GROUP_COLOURS.get(group)
            word = f"<b style='color: {colour}'>{group}</b>" if colour else f"<i>{html.escape(group)}</i>"
            items = " · ".join(self._item(group, t, p) for t, p in part.groupby("technique", sort=False))
            (brief if group in BRIEF else answered).append(f"{word}: {items}")
        return "".join(f"<div>{line}</div>" for line in [*answered, "; ".join(brief)] if line)

    def _repr_html_(self) -> str:
        body = []
        for workload, rows in self.frame.groupby("workload", sort=False):
            on = rows["on"].iloc[0]
            where = f"<div class='optlab-answer-on'>on {html.escape(on)}</div>" if on else ""
            body.append(f"<tr><th>{html.escape(workload)}{where}</th><td>{self._cell(rows)}</td></tr>")
        refs = ", ".join(self.machines) if self.machines else "none stored yet"
        key = f"In brackets: the seed's V100 figure on the same models, and each stored GPU reference ({refs})."
        return (f"<div class='optlab-answer' id='summary-answer'><table class='optlab-table'>"
                f"<tbody>{''.join(body)}</tbody></table><p class='optlab-answer-key'>{html.escape(key)}</p></div>")

    def __repr__(self) -> str:
        lines = []
        for _, row in self.frame.iterrows():
            beside = "; ".join([f"seed V100 {row['seed V100']}"] * bool(row["seed V100"])
                               + [f"{m}: {row[m]}" for m in self.machines if row[m]])
            where = f" (on {row['on']})" if row["on"] else ""
            what = f": {row['line']} {row['here']}" if row["line"] else ""
            lines.append(f"{row['workload']}{where}: {row['group']}{what}" + (f" [{beside}]" if beside else ""))
        return "\n".join(lines)


def answer(found: dict[str, pd.DataFrame]) -> Answer:
    """:func:`answer_frame` of ``found`` (``summary_page.sources()``) and the serving chapters' kept tables, shown as
    one compact table."""
    return Answer(answer_frame(found))
