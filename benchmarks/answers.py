"""How often the book's live comparisons answer: per chapter's record, the timed comparisons, how many end in a verdict
("faster", "slower", "same within 2 %") rather than "can't tell yet", and the median round-level noise.

Run it after a ``make book`` (or any chapter runs) on the records they wrote:
``PYTHONPATH=. python benchmarks/answers.py [results/live]``. A/A controls and variants not timed on this device are
left out of the count: only claims can answer.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from optlab.core.results import store
from optlab.core.measuring.timing import FASTER, SAME, SLOWER, UNCLEAR

ANSWERS = (FASTER, SLOWER, SAME)


def answer_table(folder: Path) -> pd.DataFrame:
    """One row per record in ``folder`` (a chapter's technique): timed claims, answered, the share answered and the
    median noise of a round (as a fraction), plus a row for all of them together."""
    rows = []
    for path in sorted(Path(folder).glob("*.json")):
        record = store.load_record(path)
        summary = pd.DataFrame(record.get("summary", []))
        if summary.empty or "verdict" not in summary:
            continue
        timed = summary[summary["verdict"].isin((*ANSWERS, UNCLEAR))]
        if "role" in timed:
            timed = timed[timed["role"].fillna("claim") == "claim"]
        rows.append({"record": path.stem, "timed": len(timed), "answered": int(timed["verdict"].isin(ANSWERS).sum()),
                     "median noise": timed["noise"].median() if "noise" in timed else float("nan")})
    table = pd.DataFrame(rows, columns=["record", "timed", "answered", "median noise"])
    if table.empty:
        return table
    total = {"record": "all", "timed": table["timed"].sum(), "answered": table["answered"].sum(),
             "median noise": table["median noise"].median()}
    table = pd.concat([table, pd.DataFrame([total])], ignore_index=True)
    table.insert(3, "share answered", table["answered"] / table["timed"].where(table["timed"] > 0))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=store.LIVE_DIR, help="records (default results/live)")
    args = parser.parse_args(argv)
    table = answer_table(args.folder)
    if table.empty:
        print(f"no records with a summary under {args.folder}", file=sys.stderr)
        return 1
    print(table.to_string(index=False, formatters={"share answered": "{:.0%}".format,
                                                   "median noise": "{:.1%}".format}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
