"""Compile cost arithmetic on hand-made samples, the C++ compiler check, and compiled runs on a fast backend."""
import functools
import json
import math

import pandas as pd
import pytest
import torch

from optlab.studies.kernels import compile_cost
from optlab.core.machine import compiler
from optlab.core.results import store
from optlab.core.machine.device import resolve_device
from optlab.core.errors import OptlabError
from optlab.core.techniques.registry import get_experiment
from optlab.core.run.experiments import run_experiment
from tests.helpers import TINY


def _row(variant, repeat, first, steps, phase="train", warmup_losses=(2.0,), graphs=0):
    return {"model": "resnet18", "phase": phase, "variant": variant, "repeat": repeat, "status": "ok",
            "images_per_step": 100, "epoch_images": 50_000, "first_step_s": first, "warmup_times_s": [first],
            "step_times_s": steps, "warmup_losses": list(warmup_losses), "graphs_compiled": graphs}


def _record(rows, warmup_repeats=0, amp="none"):
    variants = {row["variant"] for row in rows}
    return {"samples": rows, "baseline": "eager", "profile": {"warmup_repeats": warmup_repeats},
            "summary": [{"model": "resnet18", "phase": "train", "variant": v, "verdict": f"v-{v}"} for v in variants],
            "effective_configs": {"resnet18": {v: {"amp_dtype": amp} for v in variants}}}


RECORD = _record([
    _row("eager", 0, 0.5, [0.10, 0.10, 0.12]),
    _row("eager", 1, 0.1, [0.08, 0.10, 0.10]),
    _row("fast", 0, 30.06, [0.06, 0.05, 0.06], warmup_losses=(2.001,), graphs=1),
    _row("fast", 1, 0.06, [0.06, 0.07, 0.06]),
    _row("slow", 0, 10.2, [0.20, 0.20, 0.20], warmup_losses=(2.5,), graphs=1),
    _row("slow", 1, 0.2, [0.20, 0.20, 0.20]),
])


def test_compile_time_saving_and_payoff():
    costs = compile_cost.compile_costs(RECORD).set_index("variant")
    eager, fast, slow = costs.loc["eager"], costs.loc["fast"], costs.loc["slow"]
    assert fast["compile_s"] == pytest.approx(30.06 - 0.06)  # repeat 0's first step minus the pooled median step
    assert fast["eager_step_ms"] == pytest.approx(100.0) and fast["saving_ms"] == pytest.approx(40.0)
    assert fast["payoff_steps"] == pytest.approx(30.0 / 0.04)
    assert fast["payoff_epochs"] == pytest.approx(30.0 / 0.04 / 500)  # 500 steps of 100 images per epoch
    assert math.isinf(slow["payoff_steps"]) and slow["saving_ms"] == pytest.approx(-100.0)
    assert eager["compile_s"] == pytest.approx(0.4) and math.isnan(eager["payoff_steps"])
    assert (fast["graphs_compiled"], eager["graphs_compiled"]) == (1, 0) and fast["verdict"] == "v-fast"


def test_cost_table_says_never():
    table = compile_cost.cost_table(compile_cost.compile_costs(RECORD)).set_index("variant")
    assert table.loc["slow", "pays off after steps"] == "never" and table.loc["fast", "pays off after steps"] == "750"
    assert table.loc["eager", "pays off after steps"] == ""


def test_compile_costs_refuse_runs_that_discarded_the_compiling_repeat():
    with pytest.raises(OptlabError, match="discarded its first 1 repeat"):
        compile_cost.compile_costs(_record(RECORD["samples"], warmup_repeats=1))
    without_warmup = [{**row, "first_step_s": None} for row in RECORD["samples"]]
    with pytest.raises(OptlabError, match="at least one warm-up step"):
        compile_cost.compile_costs(_record(without_warmup))


def test_loss_agreement_compares_the_first_step_against_the_baseline():
    agreement = compile_cost.loss_agreement(RECORD).set_index("variant")
    assert agreement.loc["fast", "rel_diff"] == pytest.approx(0.0005)
    assert agreement.loc["slow", "rel_diff"] == pytest.approx(0.25)
    assert (agreement["tolerance"] == compile_cost.LOSS_RTOL["none"]).all()
    bf16 = compile_cost.loss_agreement(_record(RECORD["samples"], amp="bf16"))
    assert (bf16["tolerance"] == compile_cost.LOSS_RTOL["bf16"]).all()


def test_loss_agreement_of_a_test_phase_run_reads_the_first_evaluation_loss():
    test_only = _record([{**row, "phase": "test"} for row in RECORD["samples"]])
    agreement = compile_cost.loss_agreement(test_only).set_index("variant")
    assert agreement.loc["fast", "rel_diff"] == pytest.approx(0.0005)
    assert agreement.loc["slow", "rel_diff"] == pytest.approx(0.25)
    both = _record(RECORD["samples"] + [{**row, "phase": "test", "warmup_losses": [9.0]} for row in RECORD["samples"]])
    assert compile_cost.loss_agreement(both).set_index("variant").loc["slow", "rel_diff"] == pytest.approx(0.25)
    no_losses = _record([{**row, "phase": "test", "warmup_losses": []} for row in RECORD["samples"]])
    with pytest.raises(OptlabError, match="train or test phase"):
        compile_cost.loss_agreement(no_losses)


def test_an_evaluation_pass_keeps_its_warm_up_losses_on_the_same_weights():
    from optlab.core.measuring import loops
    from optlab.core.knobs.config import RunConfig
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    batches = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(3)]
    result = loops.eval_phase(model, batches, RunConfig(), torch.device("cpu"), steps=2, warmup=1)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(batches[0][0]), batches[0][1]).item()
    assert result.warmup_losses == [pytest.approx(expected, rel=1e-6)]


def test_step_trace_orders_warmup_then_timed_steps_of_repeat_0():
    trace = compile_cost.step_trace(pd.DataFrame(RECORD["samples"]))
    fast = trace[trace["variant"] == "fast"]
    assert fast["seconds"].tolist() == [30.06, 0.06, 0.05, 0.06] and fast["warm_up"].tolist() == [True] + [False] * 3
    assert len(trace) == 12  # three variants, repeat 0 only


def test_missing_cpp_compiler_is_reported_before_any_work(monkeypatch):
    monkeypatch.setattr(compiler.shutil, "which", lambda name: None)
    monkeypatch.setattr("optlab.core.run.experiments.cached_datasets", lambda *a: pytest.fail("work started"))
    with pytest.raises(OptlabError, match=r"needs a C\+\+ compiler.*g\+\+.*compile_mode 'none'"):
        run_experiment("compile", profile=TINY, device="cpu", progress=False)
    eager_only = get_experiment("compile").with_variants(("a", {}), ("b", {}))
    compiler.require_compiler(eager_only.configs("resnet18", TINY).values(), resolve_device("cpu"))  # nothing to build


def test_the_compiler_inductor_uses_is_found_here():
    found = compiler.find_cxx()
    assert found is not None and any(found.endswith(name) for name in compiler.inductor_cxx_candidates())


@pytest.fixture
def fast_compile(monkeypatch):
    """torch.compile with Dynamo's ``eager`` backend: the same graph capture and guards, no Inductor code generation."""
    reset = torch._dynamo.reset  # the real one, also where a test replaces it
    reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    yield
    reset()


@pytest.mark.filterwarnings("ignore:.*ignoring extra kwargs")
def test_compiled_variants_compile_once_per_phase_and_match_eager(fast_compile, monkeypatch):
    """One graph per phase in repeat 0 (fixed shapes: no recompiles), and Dynamo's caches dropped after the model.

    ResNet18, 50 and 101 share ResNet.forward; with two compiled variants and two phases each, the three models
    would need 12 cache entries there, beyond Dynamo's recompile limit of 8, and the last model would run eager.
    """
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    experiment = get_experiment("compile").with_variants(("eager", {"compile_mode": "none"}),
                                                         ("compiled", {"compile_mode": "default"}))
    result = run_experiment(experiment, profile=TINY, device="cpu", progress=False, overrides={"amp_dtype": "none"})
    graphs = result.samples.set_index(["variant", "phase", "repeat"])["graphs_compiled"]
    assert graphs.loc["compiled"].tolist() == [1, 1, 0, 0, 0, 0]  # train and eval graphs, in repeat 0 only
    assert (graphs.loc["eager"] == 0).all()
    agreement = compile_cost.loss_agreement(result.record)
    assert (agreement["rel_diff"] <= agreement["tolerance"]).all()
    costs = compile_cost.compile_costs(result.record).set_index(["phase", "variant"])
    assert (costs.loc[(slice(None), "compiled"), "compile_s"] > 0).all()
    assert resets == [1]


def test_reference_costs_read_every_stored_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path)
    assert compile_cost.reference_costs() is None
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "compile.json").write_text(json.dumps({**RECORD, "schema_version": store.SCHEMA_VERSION}))
    costs = compile_cost.reference_costs()
    assert set(costs["machine"]) == {"h200"} and len(costs) == 3
