"""One page, one story: numbers on the same row or in the same sentence do not contradict each other. An interval
shown as "too wide to tell" sits only beside "can't tell yet"; a page's intervals that are too wide to mean anything
read as a disturbed machine, never as a percentage in the hundreds; the tune's recommendation is worded for one kept
step and for several, and its lines to add are only the lines that change; a decoding row's speed-up and tokens/s
come from the same statistic."""
import itertools
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch

from optlab.book import report
from optlab.book.report.text import DISTURBED
from optlab.core.gpt.transformer import GPTConfig
from optlab.core.knobs.config import RunConfig, apply_changes
from optlab.core.measuring.timing import (CLEAR, FASTER, SLOWER, TOO_WIDE, UNCLEAR, interval_text, speed_up,
                                         verdict)
from optlab.core.techniques.cnn import ALL_TOGETHER
from optlab.studies.serving import bandwidth, decoding
from optlab.studies.serving.agreement import TokenAgreement
from optlab.studies.tune import training

# too wide and above 1, too wide and below 1, too wide and holding 1 (down to a float's 0 to infinity), and narrow
INTERVALS = [(1.3, 9.0), (1.05, 40.0), (0.1, 0.7), (0.02, 0.9), (0.2, 3.0), (0.5, 2.5), (1e-4, 3e7), (0.0, math.inf),
             (1.05, 1.15), (0.99, 1.01), (0.9, 1.1)]


def compared() -> list[tuple[float, float, float, str]]:
    """Each interval with its speed-up (its geometric middle, as the paired fit gives) and the verdict it reads."""
    rows = []
    for low, high in INTERVALS:
        ratio = math.sqrt(low * high) if 0 < low and math.isfinite(high) else 1.0
        rows.append((ratio, low, high, verdict(ratio, low, high)))
    return rows


def tune_table() -> pd.DataFrame:
    steps = pd.DataFrame([{"step": f"step {number}", "decision": "not kept", "speedup": ratio, "ci_low": low,
                           "ci_high": high, "verdict": said, "loss_change": 0.0, "loss_tolerance": 0.05,
                           "before_ms": 10.0, "after_ms": 10.0 / ratio, "reason": ""}
                          for number, (ratio, low, high, said) in enumerate(compared())])
    return training.TuneResult(model="m", steps=steps, samples=None, summary=None, kept=[], start=RunConfig(),
                               recommended=RunConfig(), speedup=1.0, ci_low=1.0, ci_high=1.0, verdict=UNCLEAR,
                               code=[]).table()


def recommendation(kept: list[str], ratio: float, low: float, high: float, said: str) -> training.TuneResult:
    return training.TuneResult(model="m", steps=None, samples=None, summary=None, kept=kept, start=RunConfig(),
                               recommended=RunConfig(), speedup=ratio, ci_low=low, ci_high=high, verdict=said, code=[])


def test_too_wide_to_tell_sits_only_beside_can_t_tell_yet_and_an_answer_shows_its_digits():
    verdicts = [said for *_, said in compared()]
    assert {FASTER, SLOWER, UNCLEAR} <= set(verdicts)  # the inputs hold a too-wide interval of each
    table = tune_table()
    for (ratio, low, high, said), cell in zip(compared(), table[report.INTERVAL]):
        shown = {"interval": interval_text(low, high), "interval with its rounds": interval_text(low, high, 3),
                 "speed-up": report.speedup_text(ratio, low, high, 3), "the tune's table": cell,
                 "a recommendation": recommendation(["+ channels_last"], ratio, low, high, said).headline("", "")}
        for where, text in shown.items():
            if said in CLEAR:
                assert "too wide" not in text and re.search(r"\d\.\d", text), (where, said, low, high, text)
            elif math.log(high / low if low else math.inf) > math.log(TOO_WIDE):
                assert "too wide to tell" in text, (where, said, low, high, text)


def test_a_page_s_intervals_too_wide_to_mean_anything_read_as_a_disturbed_machine():
    """The chapter's line on a busy machine: one interval wide beyond a float, one clear, one missing. Half the
    readable ones are too wide: no half-width in the thousands of percent."""
    busy = pd.DataFrame({"verdict": [UNCLEAR, UNCLEAR, FASTER], "noise": [3.0, np.nan, 0.04], "n": [3, 3, 8],
                         "ci_low": [1e-4, np.nan, 1.05], "ci_high": [3e7, np.nan, 1.15]})
    line = report.noise_line(busy)
    assert DISTURBED in line and "±" not in line, line
    rng = np.random.default_rng(5)
    for _ in range(300):  # any page: a reach is said only as far as an interval that means something reaches
        count = int(rng.integers(1, 7))
        middle, spread = np.exp(rng.normal(0, 0.3, count)), np.exp(np.abs(rng.normal(0, 2.0, count)))
        page = pd.DataFrame({"verdict": UNCLEAR, "noise": 0.1, "n": 3, "ci_low": middle / np.sqrt(spread),
                             "ci_high": middle * np.sqrt(spread)})
        page.loc[rng.random(count) < 0.2, ["ci_low", "ci_high"]] = np.nan
        reach = re.search(r"±([\d.]+) %", report.noise_line(page))
        assert reach is None or float(reach.group(1)) <= 100 * (math.sqrt(TOO_WIDE) - 1), report.noise_line(page)
    clean = pd.DataFrame({"verdict": [FASTER, UNCLEAR], "noise": [0.02, 0.03], "n": [8, 8], "ci_low": [1.05, 0.97],
                          "ci_high": [1.12, 1.04]})
    assert "±3.4 %" in report.noise_line(clean)  # between the two half-widths, 3.3 % and 3.5 %


@pytest.mark.parametrize("said", [FASTER, UNCLEAR])
def test_the_recommendation_is_worded_for_one_kept_step_and_for_several(said):
    one = recommendation(["+ bf16 autocast"], 1.3, 1.1, 1.5, said).headline("", "")
    two = recommendation(["+ bf16 autocast", "+ channels_last"], 1.3, 1.1, 1.5, said).headline("", "")
    assert "each" not in one and "all together" not in one, one
    assert "all together" in two, two
    if said != FASTER:
        assert "+ bf16 autocast looked faster than the configuration before it" in one, one
        assert "each looked faster than the step before" in two, two


def test_the_lines_to_add_are_only_those_that_change():
    """Every set of kept steps, from the tune's starting point (the seed's, set_to_none=False): the zero_grad line
    appears only where set_to_none was kept, and the starting point's own lines never."""
    start = apply_changes(RunConfig(num_workers=0), ALL_TOGETHER.variants[0][1])
    assert start.set_to_none is False
    steps = training.stack_steps()
    for count in range(1, len(steps) + 1):
        for kept in itertools.combinations(steps, count):
            recommended = start
            for _, changes in kept:
                recommended = apply_changes(recommended, changes)
            code = "\n".join(training.code_lines(start, recommended, torch.device("cuda")))
            assert "set_to_none=False" not in code, code
            assert ("zero_grad" in code) == any("set_to_none" in changes for _, changes in kept), code
            assert "loss.backward()" not in code, code  # the starting point's line, unchanged by every step


def decode_study(tpot_s: dict[str, list[float]], step_s: dict[str, list[float]]) -> decoding.DecodeStudy:
    study = decoding.DecodeStudy("cpu", 1, 16, 8, bandwidth.Peak(1e11, "cpu", "measured"), 1_000_000, 4,
                                 GPTConfig(), None)
    for label in tpot_s:
        study.tpot_s[label], study.step_s[label] = tpot_s[label], step_s[label]
        study.ttft_s[label] = [0.01] * len(tpot_s[label])
        study.slot_shifts[label] = [0.0] * len(tpot_s[label])
        study.peak_mb[label], study.cache_bytes[label] = 1.0, 0
        study.agreements[label] = TokenAgreement(8, 0, 0.0, 1e-3)
    return study


def test_a_decoding_row_s_speed_up_and_tokens_per_second_tell_one_story():
    """The compiled static cache has the shortest median step but some slow steps, so the longer mean step (the
    TPOT): ranked by the median step it would be the fastest, by tokens/s (the TPOT's) slower than the plain one."""
    rounds = 6
    jitter = np.linspace(0.99, 1.01, rounds)
    tpot = {"no cache": list(10e-3 * jitter), "static cache": list(4e-3 * jitter),
            "static cache, compiled": list(5e-3 * jitter)}
    median = {"no cache": list(10e-3 * jitter), "static cache": list(4e-3 * jitter),
              "static cache, compiled": list(2e-3 * jitter)}
    table = decode_study(tpot, median).table()
    cached = table.drop(index="no cache")
    by_speedup = list(cached.sort_values("decode speed-up").index)
    by_rate = list(cached.sort_values("tokens/s").index)
    assert by_speedup == by_rate == ["static cache, compiled", "static cache"], table
    for label, row in cached.iterrows():  # the speed-up is the rate's ratio to no cache's, up to the pairing
        assert row["decode speed-up"] == pytest.approx(row["tokens/s"] / table.loc["no cache", "tokens/s"], rel=0.02)


def test_a_decoding_row_ranks_by_speed_up_as_by_tokens_per_second_where_pairing_and_medians_disagree():
    """Five rounds where the paired estimate and the ratio of medians rank two variants the other way round: the
    steady variant's TPOT is 5 ms every round; the uneven one's median round is shorter (4.9 ms) but two of its rounds
    are long, so its paired speed-up is the smaller. The table's speed-up is the ratio of the tokens/s (the uneven one
    first), and its interval and verdict are the paired estimate's."""
    baseline = [10e-3, 10.1e-3, 9.9e-3, 10.05e-3, 9.95e-3]
    tpot = {"no cache": baseline, "dynamic cache": [5e-3] * 5,
            "static cache": [3e-3, 4.9e-3, 4.9e-3, 9e-3, 9e-3]}
    paired = {label: speed_up(baseline, tpot[label], [0.0] * 5) for label in ("dynamic cache", "static cache")}
    assert paired["dynamic cache"].ratio > paired["static cache"].ratio  # the pairing ranks the steady one first
    table = decode_study(tpot, tpot).table()
    cached = table.drop(index="no cache")
    assert list(cached.sort_values("decode speed-up").index) == list(cached.sort_values("tokens/s").index) == [
        "dynamic cache", "static cache"], table
    for label, row in cached.iterrows():
        assert row["decode speed-up"] == pytest.approx(row["tokens/s"] / table.loc["no cache", "tokens/s"])
        assert (row["low"], row["high"]) == pytest.approx((paired[label].low, paired[label].high)), label
        assert row["verdict"] == paired[label].verdict, label
