"""One training step's memory breakdown: the categories add up to the measured peak, each technique moves the category
it should, the arithmetic agrees with the measurement, and bad input ends in one line."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler._memory_profiler import Category

from optlab.core.errors import OptlabError
from optlab.core.gpt import build_gpt
from optlab.studies.memory import CATEGORIES, SUM_RTOL, saved_activations, step_breakdown
from optlab.studies.tune.inputs import cross_entropy
from optlab.studies.memory import breakdown as breakdown_module
from optlab.studies.memory.breakdown import PROFILER_CATEGORIES


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def batch(rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 64, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


def breakdown(optimizer: str = "sgd", device: str = "cpu", rows: int = 256, **options):
    model = mlp()
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1), "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, foreach=True), "adam-loop": lambda p: torch.optim.Adam(p, foreach=False)}
    return step_breakdown(model, batch(rows), F.cross_entropy, make[optimizer](model.parameters()), device=device,
                          **options)


def test_torch_categories_are_all_named():
    assert set(PROFILER_CATEGORIES) == {category.name for category in Category}
    assert set(PROFILER_CATEGORIES.values()) | {"other"} == set(CATEGORIES)


@pytest.mark.parametrize("optimizer, rows", [("sgd", 256), ("adam", 256), ("adam-loop", 8)])
def test_categories_add_up_to_the_measured_peak(optimizer, rows):
    result = breakdown(optimizer, rows=rows)  # 8 rows: the peak is in Adam's for-loop step, among its temporaries
    assert list(result.categories) == list(CATEGORIES)
    assert result.adds_up(), (result.total, result.peak_bytes)
    assert abs(result.total - result.peak_bytes) <= SUM_RTOL * result.peak_bytes
    assert result.largest() == max(result.categories, key=result.categories.get)
    assert result.peak_phase in ("forward", "backward", "optimizer")


def test_the_arithmetic_agrees_with_the_measurement():
    result = breakdown("adam")
    for name in ("parameter", "optimizer_state", "input"):
        assert result.categories[name] == result.expected[name], name
    forward_end = breakdown("sgd").at_end_of("forward")
    assert forward_end["activation"] == pytest.approx(result.expected["activation"], rel=0.01)
    assert breakdown("momentum").expected["optimizer_state"] == result.expected["gradient"]


def test_saved_activations_layer_by_layer_from_the_shapes():
    layers = saved_activations(mlp(), batch(), F.cross_entropy, None)
    assert list(layers["module"]) == ["1", "3", "(loss)"]  # each ReLU's output (the next Linear's input too)
    assert list(layers["bytes"][:2]) == [256 * 256 * 4] * 2
    tokens = torch.zeros(2, 16, dtype=torch.long)
    gpt = saved_activations(build_gpt("gpt_tiny"), (tokens, tokens), cross_entropy, None).set_index("module")["bytes"]
    assert gpt["blocks.0.attn"] > 0 and gpt["blocks.1.mlp.fc"] == gpt["blocks.0.mlp.fc"] == 2 * 16 * 64 * 4


def test_set_to_none_frees_the_gradients_before_the_next_forward():
    kept, freed = breakdown(set_to_none=False), breakdown(set_to_none=True)
    assert kept.at_end_of("forward")["gradient"] == kept.expected["gradient"]
    assert freed.at_end_of("forward")["gradient"] == 0
    assert freed.categories["gradient"] < kept.categories["gradient"]


def test_an_optimizer_steps_intermediates_are_its_temporaries():
    result = breakdown("adam-loop")
    timeline = result.timeline[result.timeline["phase"] == "optimizer"]
    most = timeline.groupby("category")["bytes"].max()
    assert most["temporary"] > 0 and most["activation"] == 0
    assert most["parameter"] == result.expected["parameter"]


def test_accumulation_cuts_the_activations():
    whole, quarters = breakdown(), breakdown(accumulation=4)
    ratio = quarters.at_end_of("forward")["activation"] / whole.at_end_of("forward")["activation"]
    assert 0.2 < ratio < 0.3
    assert quarters.expected["activation"] < whole.expected["activation"] / 3


def test_bf16_autocast_shrinks_the_saved_activations():
    whole, half = breakdown(), breakdown(autocast_dtype=torch.bfloat16)
    assert half.expected["activation"] < 0.9 * whole.expected["activation"]  # 16-bit activations, plus 16-bit
    # copies of the weights that autocast keeps for the backward


def test_the_timeline_is_tidy_and_saved(tmp_path):
    result = breakdown(steps=1)
    assert list(result.timeline.columns) == ["time", "phase", "category", "bytes"]
    assert set(result.timeline["phase"]) == {"forward", "backward", "optimizer"}
    assert result.timeline["time"].min() == 0 and result.peak_time >= 0
    saved = json.loads(result.save_timeline(tmp_path / "timeline.json").read_text())
    assert saved["peak_bytes"] == result.peak_bytes and len(saved["timeline"]) == len(result.timeline)
    with pytest.raises(OptlabError, match="CUDA allocator"):
        result.save_snapshot(tmp_path / "snapshot.pickle")


@pytest.mark.parametrize("options, message", [
    ({"steps": 0}, "steps must be at least 1"), ({"steps": 100}, "at most 8"),
    ({"accumulation": 1000}, "at most 64"), ({"accumulation": 64, "steps": 1}, None),
    ({"autocast_dtype": torch.float32}, "autocast_dtype must be"),
])
def test_bad_input_ends_in_one_line(options, message):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if message is None:  # 64 micro-batches of a batch of 32: more than it has
        with pytest.raises(OptlabError, match="needs at least as many samples"):
            step_breakdown(model, batch(32), F.cross_entropy, optimizer, device="cpu", **options)
        return
    with pytest.raises(OptlabError, match=message) as error:
        step_breakdown(model, batch(), F.cross_entropy, optimizer, device="cpu", **options)
    assert "\n" not in str(error.value)


def test_at_end_of_names_the_phases():
    with pytest.raises(OptlabError, match="unknown phase"):
        breakdown(steps=1).at_end_of("loading")


@pytest.mark.cuda
def test_on_a_gpu_the_allocator_agrees_and_a_snapshot_is_kept(tmp_path):
    result = breakdown("adam", device="cuda")
    assert result.adds_up(), (result.total, result.peak_bytes)
    assert result.allocator["peak reserved"] >= result.allocator["peak allocated"] > 0
    assert result.save_snapshot(tmp_path / "snapshot.pickle").stat().st_size > 0


def odd_sized() -> nn.Module:
    """Parameters of 120, 12, 60 and 20 bytes: none a multiple of the CUDA allocator's 512-byte block."""
    return nn.Sequential(nn.Linear(10, 3), nn.Linear(3, 5))


@pytest.mark.parametrize("implementation", ["for_loop", "foreach", "fused"])
def test_the_optimizer_state_is_counted_where_torch_keeps_it(implementation):
    """On a CPU every state tensor is in the count; on a GPU the for-loop and foreach AdamW keep their step counts on
    the CPU and the fused one beside the parameters, and every tensor takes whole 512-byte blocks."""
    model = odd_sized()
    flags = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[implementation]
    optimizer = torch.optim.AdamW(model.parameters(), **flags)
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    trainable = list(model.parameters())
    held = sum(t.untyped_storage().nbytes() for state in optimizer.state.values() for t in state.values())
    assert breakdown_module.optimizer_state_bytes(optimizer, trainable, torch.device("cpu")) == held == 2 * 212 + 4 * 4
    on_gpu = breakdown_module.optimizer_state_bytes(optimizer, trainable, torch.device("cuda"))
    assert on_gpu == 2 * 4 * 512 + (4 * 512 if implementation == "fused" else 0)


@pytest.mark.cuda
@pytest.mark.parametrize("implementation", ["for_loop", "foreach", "fused"])
def test_on_a_gpu_the_state_count_is_what_the_allocator_holds(implementation):
    model = odd_sized().cuda()
    flags = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[implementation]
    optimizer = torch.optim.AdamW(model.parameters(), **flags)
    model(torch.randn(4, 10, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    optimizer.step()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert breakdown_module.optimizer_state_bytes(optimizer, list(model.parameters()), torch.device("cuda")) == grown


def test_the_allocator_history_keeps_python_stacks_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *args, **kwargs: calls.append(kwargs))
    breakdown_module.record_history(True)
    breakdown_module.record_history(False)
    assert calls[0]["stacks"] == "python" and calls[0]["clear_history"] and len(calls) == 2


def test_the_counted_column_says_when_its_count_holds():
    table = breakdown("adam", steps=1, warmup_steps=1).table().set_index("category")
    assert "expected MiB" not in table and table.loc["optimizer_state", "counted when"] == "after the first step"
    assert table.loc["gradient", "counted when"] == "after each backward" and table.loc["other", "counted when"] == ""
    assert table.loc["activation", "counted when"] == "at the forward's end"
