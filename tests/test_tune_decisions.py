"""What ``tune --inference`` keeps, and where a kept step goes: only a "faster" verdict keeps a step, whatever its
outputs; a kept step is the configuration the next step is timed against, and it is in the recommendation, its
record and its lines of code; a tune whose measured steps all failed recommends nothing. The verdicts are set here,
not measured (a timing outcome is noise, not a test)."""
import pandas as pd
import pytest
from torch import nn

import optlab
from optlab.core.knobs.config import RunConfig
from optlab.core.measuring.timing import FASTER, SAME, SLOWER, UNCLEAR
from optlab.studies import tune_inference as inference
from optlab.studies.tune.recommendation import NothingRecommended, Recommendation, check_something_measured
from optlab.studies.tune_inference import CHANNELS_LAST, FINAL, INFERENCE_MODE, START, decide
from tests.helpers import TINY

TOLERANCE = 1e-4


@pytest.mark.parametrize("verdict", [SLOWER, SAME, UNCLEAR, "baseline", ""])
def test_only_a_faster_verdict_keeps_a_step_with_unchanged_outputs(verdict):
    assert decide(verdict, 0.0, 1.0, TOLERANCE) == ("not kept", "")
    assert decide(verdict, 0.0, None, TOLERANCE) == ("not kept", "")  # not a classifier: no top-1


def test_a_faster_step_is_kept_only_with_unchanged_outputs_and_no_failure():
    assert decide(FASTER, 0.0, 1.0, TOLERANCE) == ("kept", "")
    assert decide(FASTER, 0.0, None, TOLERANCE) == ("kept", "")
    assert decide(FASTER, 10 * TOLERANCE, 1.0, TOLERANCE)[0] == "not kept: outputs changed"
    assert decide(FASTER, 0.0, 0.5, TOLERANCE)[0] == "not kept: outputs changed"
    assert decide(FASTER, 0.0, 1.0, TOLERANCE, after_failed="out of memory") == ("failed", "out of memory")
    assert decide(FASTER, 0.0, 1.0, TOLERANCE, before_failed="out of memory")[0] == "not decided"


class SmallCNN(nn.Module):
    """A convnet on 3x8x8 images, so that both inference_mode and channels_last apply on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(8, 4))

    def forward(self, x):
        return self.body(x)


def tune_with_verdicts(monkeypatch, verdicts: dict[str, str]):
    """``tune --inference`` on SmallCNN with each step's verdict against the configuration before it set to
    ``verdicts[step]`` (the comparison of the recommendation, measured afresh, keeps its own)."""
    measured = inference.summarize_runs

    def summarize_runs(samples, baseline, *args, **kwargs):
        summary = measured(samples, baseline, *args, **kwargs)
        for step, verdict in verdicts.items():
            summary.loc[summary["variant"] == step, "verdict"] = verdict
        return summary

    monkeypatch.setattr(inference, "summarize_runs", summarize_runs)
    return optlab.tune(SmallCNN, inference=True, input_shape=(3, 8, 8), techniques=[INFERENCE_MODE, CHANNELS_LAST],
                       max_batch=2, profile=TINY, device="cpu", progress=False)


def compared_with(result, step: str) -> set[str]:
    """The configurations timed in ``step``'s comparison."""
    return set(result.samples.loc[result.samples["comparison"] == step, "variant"])


@pytest.mark.parametrize("verdicts, kept", [
    ({INFERENCE_MODE: SLOWER, CHANNELS_LAST: FASTER}, [CHANNELS_LAST]),
    ({INFERENCE_MODE: FASTER, CHANNELS_LAST: UNCLEAR}, [INFERENCE_MODE]),
    ({INFERENCE_MODE: FASTER, CHANNELS_LAST: FASTER}, [INFERENCE_MODE, CHANNELS_LAST]),
    ({INFERENCE_MODE: SAME, CHANNELS_LAST: SLOWER}, []),
], ids=["second-only", "first-only", "both", "neither"])
def test_the_verdict_decides_and_a_kept_step_is_carried_into_the_recommendation(monkeypatch, verdicts, kept):
    result = tune_with_verdicts(monkeypatch, verdicts)
    steps = result.steps.set_index("step")
    assert dict(steps.loc[list(verdicts), "verdict"]) == verdicts
    assert dict(steps.loc[list(verdicts), "decision"]) == {step: "kept" if step in kept else "not kept"
                                                          for step in verdicts}
    assert result.kept == kept
    before_channels_last = INFERENCE_MODE if INFERENCE_MODE in kept else START
    assert compared_with(result, CHANNELS_LAST) == {before_channels_last, CHANNELS_LAST}
    expected = {"eval_grad_mode": "inference_mode" if INFERENCE_MODE in kept else "grad",
                "channels_last": CHANNELS_LAST in kept}
    assert {knob: getattr(result.recommended, knob) for knob in expected} == expected
    assert {knob: result.record["recommended"][knob] for knob in expected} == expected
    assert ("with torch.inference_mode():" in result.code) == (INFERENCE_MODE in kept)
    assert ("model = model.to(memory_format=torch.channels_last)" in result.code) == (CHANNELS_LAST in kept)
    assert compared_with(result, FINAL) == ({START, FINAL} if kept else set())


def recommendation(decisions: dict[str, str], failures: dict[str, str]):
    """A tune's result with these step ``decisions`` and these configurations' ``failures`` in its samples."""
    samples = pd.DataFrame([{"variant": label, "status": status} for label, status in failures.items()] +
                           [{"variant": "ran", "status": "ok"}])
    steps = pd.DataFrame({"step": list(decisions), "decision": list(decisions.values())})
    return Recommendation(model="m", steps=steps, samples=samples, summary=pd.DataFrame(), kept=[], start=RunConfig(),
                          recommended=RunConfig(), speedup=1.0, ci_low=1.0, ci_high=1.0, verdict="baseline", code=[])


@pytest.mark.parametrize("decisions", [
    {"a": "skipped", "b": "skipped"},  # nothing measured: nothing failed
    {"a": "failed", "b": "not kept"},  # one step decided
    {"a": "not decided", "b": "kept"},
    {"a": "failed", "b": "not kept: loss changed"},
])
def test_a_tune_with_a_decided_step_or_none_measured_recommends(decisions):
    check_something_measured(recommendation(decisions, {"a": "out of memory"}), 8)


def test_a_tune_whose_measured_steps_all_failed_names_each_failure_once():
    result = recommendation({"a": "failed", "b": "not decided", "c": "skipped"},
                            {START: "out of memory", "a": "out of memory", "b": "failed: RuntimeError: no"})
    with pytest.raises(NothingRecommended) as ended:
        check_something_measured(result, 64)
    assert str(ended.value) == ("every step tried failed, so nothing is recommended (starting point, a: out of memory; "
                                "b: failed: RuntimeError: no); batch 64 does not fit: pass a smaller batch size "
                                "(--batch-size)")
    assert ended.value.result is result
    with pytest.raises(NothingRecommended, match=r"\(b: failed: RuntimeError: no\)$"):
        check_something_measured(recommendation({"b": "failed"}, {"b": "failed: RuntimeError: no"}), 64)
