import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from optlab.book import report, summary_page  # noqa: E402
from optlab.core.knobs.config import RunConfig  # noqa: E402
from optlab.core.machine.device import effective_config, resolve_device  # noqa: E402
from optlab.core.run.experiments import run_experiment  # noqa: E402
from optlab.core.techniques.no_effect import NO_EFFECT, is_no_effect, no_effect_variants  # noqa: E402
from optlab.core.techniques.registry import Experiment, get_experiment  # noqa: E402
from optlab.core.stats.summary import CONTROL  # noqa: E402
from tests.helpers import TINY  # noqa: E402

CPU = resolve_device("cpu")


def untimed(experiment: str | Experiment) -> dict[str, str]:
    experiment = get_experiment(experiment)
    requested = experiment.configs("resnet18", TINY)
    effective = {label: effective_config(config, CPU) for label, config in requested.items()}
    return no_effect_variants(requested, effective, experiment.comparisons)


def test_knobs_that_fall_back_on_a_cpu_are_named_with_the_reason():
    found = untimed("non_blocking")
    assert set(found) == {"w non_blocking", "w non_blocking, prefetched on a side stream"}
    assert found["w non_blocking"] == f"{NO_EFFECT} (non_blocking: a copy from cpu to cpu is a no-op)"
    assert "prefetch_to_device: no copy to overlap" in found["w non_blocking, prefetched on a side stream"]
    assert set(untimed("cudnn_benchmark")) == {"w cudnn.benchmark"}
    assert "TF32 is a tensor-core format" in untimed("precision")["fp32 with TF32"]
    assert untimed("mixed_precision") == {} and untimed("data_loading") == {}  # these run with a CPU meaning


def test_an_a_a_control_meant_as_one_is_timed():
    copies = Experiment("a_a", "", "", variants=(("A", {}), ("A again", {})))
    assert untimed(copies) == {}


def test_a_variant_that_a_timed_one_is_compared_with_is_timed_too():
    chain = Experiment("chain", "", "", variants=(("A", {}), ("pinned", {"non_blocking": True}),
                                                  ("pinned, bf16", {"non_blocking": True, "amp_dtype": "bf16"})),
                       references={"pinned, bf16": "pinned"})
    assert untimed(chain) == {}
    requested = {"A": RunConfig(), "B": RunConfig(non_blocking=True)}
    effective = {label: (RunConfig(), []) for label in requested}  # the same config, and no note names the knob
    assert no_effect_variants(requested, effective, {"B": "A"})["B"].endswith("run as the reference's on this device)")


NO_EFFECT_RUN = Experiment("no_effect", "", "", variants=(
    ("A", {}), ("A again", {}), ("non_blocking", {"non_blocking": True}), ("bf16", {"amp_dtype": "bf16"})),
    phases=("train", "test"))


@pytest.fixture(scope="module")
def result():
    return run_experiment(NO_EFFECT_RUN, profile=TINY.with_sizes(repeats=2, max_repeats=2), device="cpu", progress=False)


def test_a_no_effect_variant_takes_no_time_and_the_controls_stay(result, capsys):
    samples = result.samples
    timed = set(samples.loc[samples["status"] == "ok", "variant"])
    assert timed == {"A", "A again", "bf16"}
    skipped = samples[samples["variant"] == "non_blocking"]
    assert len(skipped) == 2 and skipped["status"].map(is_no_effect).all()  # one row per phase, no samples
    summary = result.summary.set_index(["phase", "variant"])
    assert is_no_effect(summary.loc[("train", "non_blocking"), "verdict"])
    assert summary.loc[("train", "non_blocking"), "n"] == 0 and pd.isna(summary.loc[("train", "non_blocking"), "speedup"])
    assert summary.loc[("train", "A again"), "n"] == 2  # the A/A control ran


def test_no_effect_shows_in_the_table_the_figure_and_the_summary_page(result):
    table = report.comparison_table(result.summary, NO_EFFECT_RUN.labels)
    rows = table[table["variant"] == "non_blocking"]
    assert all(v == "no effect on this device (non_blocking: a copy from cpu to cpu is a no-op)" for v in rows["verdict"])
    status = rows["verdict"].iloc[0]
    assert report.verdict_text(status, CONTROL) == status, "an untimed variant is no A/A control"
    figure = report.plot_speedups(report.speedups(NO_EFFECT_RUN, result.summary, stored=False))
    texts = [t.get_text() for ax in figure.axes for t in ax.texts]
    assert sum(NO_EFFECT in text for text in texts) == 2  # train and test panels
    labels = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    assert any("non_blocking" in label for label in labels)
    live = result.summary.assign(technique="no_effect", machine="here", profile="tiny")
    texts, verdicts = summary_page._measured(live.assign(source=report.LIVE),
                                             pd.MultiIndex.from_tuples([("no_effect", "non_blocking", "resnet18",
                                                                         "train")], names=summary_page.KEYS))
    assert is_no_effect(verdicts[0]) and texts == [summary_page.NOT_RUN]
