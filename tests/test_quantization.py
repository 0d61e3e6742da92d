"""Weight-only quantization of the GPT: the quantizers' axes and ranges, the kernels against their dequantized weights,
every matmul layer replaced, the bytes, the timed comparison's shape, and bad input in one line."""
import pytest
import torch
from torch import nn

from optlab.core.errors import OptlabError
from optlab.core.measuring import memory
from optlab.core.measuring.timing import VERDICTS
from optlab.core.gpt.transformer import GPT, GPT_SIZES
from optlab.studies.serving import quantization as q


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_SIZES["gpt_tiny"]).eval()


def rows_of_different_sizes(out_features: int = 48, in_features: int = 64) -> torch.Tensor:
    """A weight whose rows differ in magnitude by 1000x: a scale on the wrong axis loses the small rows."""
    torch.manual_seed(1)
    return torch.randn(out_features, in_features) * torch.logspace(-3, 0, out_features)[:, None]


def test_int8_scales_are_per_output_row_and_reconstruct_every_row():
    weight = rows_of_different_sizes()
    values, scales = q.int8_weight(weight)
    assert values.dtype == torch.int8 and scales.shape == (weight.shape[0],)
    assert (values.abs().amax(dim=1) == 127).all()  # each row's largest weight at the top of the range
    error = (q.dequantize_int8(values, scales) - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-9).all()
    assert (error.amax(dim=1) / weight.abs().amax(dim=1)).max() < 0.01  # the small rows kept too


def test_int4_groups_reconstruct_within_half_a_step():
    weight = rows_of_different_sizes()
    values, scales_and_zeros = q.int4_weight(weight, 32)
    assert scales_and_zeros.shape == (2, 48, 2) and int(values.min()) >= 0 and int(values.max()) <= 15
    error = (q.dequantize_int4(values, scales_and_zeros, 32) - weight).abs().reshape(48, 2, 32)
    assert (error <= scales_and_zeros[..., 0].T[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("make", [lambda linear: q.Int8Linear(linear, q.INT8_PACKED),
                                  lambda linear: q.Int8Linear(linear, q.INT8_DEQUANTIZED),
                                  lambda linear: q.Int4Linear(linear, 32)],
                         ids=["int8 packed", "int8 F.linear", "int4"])
def test_kernels_multiply_by_their_dequantized_weights(make):
    torch.manual_seed(2)
    linear = nn.Linear(64, 40)  # 40 outputs: int4 pads to 48 and drops the padding's outputs
    layer = make(linear)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        y, exact = layer(x), linear(x)
    assert y.shape == exact.shape
    relative = ((y - exact).norm() / exact.norm()).item()
    assert relative < (0.1 if isinstance(layer, q.Int4Linear) else 0.01), relative


def test_quantize_replaces_every_linear_and_leaves_the_original(gpt):
    linears = q.layer_counts(gpt)["linear"]
    assert linears == 4 * gpt.config.n_layer + 1  # qkv, proj, fc, proj per block, and the head
    for scheme in q.SCHEMES:
        quantized = q.quantize(gpt, scheme)
        assert q.layer_counts(quantized) == {"linear": 0, "int8": 0, "int4": 0} | {scheme: linears}
        assert isinstance(quantized, GPT) and q.layer_counts(gpt)["linear"] == linears
    assert isinstance(gpt.head, nn.Linear) and gpt.head.weight is gpt.token_embedding.weight


def test_int8_bytes_are_a_quarter_plus_the_scales(gpt):
    quantized = q.quantize(gpt, "int8")
    layers = [m for m in gpt.modules() if isinstance(m, nn.Linear)]
    weights = sum(m.weight.numel() for m in layers)
    rows, biases = sum(m.out_features for m in layers), sum(m.bias.numel() for m in layers if m.bias is not None)
    assert q.matmul_weight_bytes(gpt) == 4 * (weights + biases)
    assert q.matmul_weight_bytes(quantized) == weights + 4 * (rows + biases)


def test_quantized_gpt_stays_close_to_fp32(gpt):
    tokens = torch.randint(gpt.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = gpt(tokens)
        for scheme, bound in (("int8", 0.02), ("int4", 0.2)):
            relative = ((q.quantize(gpt, scheme)(tokens) - exact).norm() / exact.norm()).item()
            assert relative < bound, (scheme, relative)


def test_variants_tables_and_kernels(gpt):
    models, skipped = q.variants(gpt)
    assert list(models) == ["fp32 weights", "int8 weight-only", "int4 weight-only (group 64)"] and skipped == []
    table = q.layers_table(models)
    assert table.loc["int8 weight-only", "kernel"] == q.INT8_PACKED
    assert table.loc["int4 weight-only (group 64)", "kernel"] == q.INT4_CPU
    assert table.loc["fp32 weights", "kernel"] == "F.linear"
    assert q.int8_kernel("cpu", torch.float32) == q.INT8_PACKED and q.int4_support("cpu", torch.float32) is None
    assert table["largest error (steps)"].iloc[0] == 0 and (table["largest error (steps)"] <= 0.501).all()


def test_on_cuda_int8_multiplies_as_gpt_fast_does_even_where_the_packed_kernel_runs(monkeypatch):
    """torch's CUDA ``_weight_int8pack_mm`` runs (its probe succeeds) but reads the weights once per row: on CUDA the
    choice is the dequantizing ``F.linear`` that Inductor fuses, decided without a GPU (the probe faked to succeed
    everywhere); on a CPU the packed kernel stays."""
    probed = []

    def runs_everywhere(scheme, device, dtype):
        probed.append(device)
        return None

    monkeypatch.setattr(q, "_tried", runs_everywhere)
    assert q.int8_kernel("cuda", torch.bfloat16) == q.int8_kernel(torch.device("cuda:0"), torch.float16) \
        == q.INT8_DEQUANTIZED
    assert q.int8_kernel("cpu", torch.bfloat16) == q.INT8_PACKED and probed == ["cpu"]
    layer = q._replacer("int8", torch.device("cuda"), torch.bfloat16, 64)(nn.Linear(64, 32))  # what quantize builds
    assert isinstance(layer, q.Int8Linear) and layer.kernel == q.INT8_DEQUANTIZED


def test_decode_times_give_a_verdict_per_variant(gpt):
    models, _ = q.variants(gpt)
    times = q.decode_times(models, batch=2, prompt_len=4, new_tokens=3, rounds=2)
    table = times.table()
    assert list(table.index) == list(models) and (table["rounds"] == 2).all() and (table["peak MiB"] > 0).all()
    assert set(table["verdict"].iloc[1:]) <= set(VERDICTS) and table["verdict"].iloc[0] == "reference"
    assert list(times.speedups()["variant"]) == list(models)[1:]


def test_quality_table_compares_with_the_first_model(gpt):
    models, _ = q.variants(gpt)
    windows = torch.randint(gpt.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    table = q.quality_table(models, windows, windows[:, :4], 4, loss=lambda model: 1.0)
    assert table.loc["fp32 weights", "next-token agreement"] == 1.0
    assert table.loc["fp32 weights", "greedy tokens equal"] == 1.0
    assert (table["loss change"] == 0).all() and table["next-token agreement"].between(0, 1).all()


@pytest.mark.parametrize("call, words", [
    (lambda model: q.quantize(model, "int3"), "unknown quantization scheme 'int3'; choose one of: int8, int4"),
    (lambda model: q.quantize(model, "int4", group_size=16), "group_size must be one of 32, 64, 128, 256"),
    (lambda model: q.quantize(model, "int4", group_size=128), "allowed here: 32, 64"),
    (lambda model: q.decode_times({"fp32": model}, batch=0), "batch must be at least 1"),
    (lambda model: q.decode_times({"fp32": model}, batch=1, rounds=1), "rounds must be at least 2"),
])
def test_bad_input_is_one_line(gpt, call, words):
    with pytest.raises(OptlabError, match=words) as error:
        call(gpt)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_multiply_by_weights_within_the_rounding_bound(gpt, dtype):
    model = GPT(gpt.config).eval()
    model.load_state_dict(gpt.state_dict())
    model = model.to(dtype)
    for scheme in q.SCHEMES:
        error = q.largest_error_in_steps(model, q.quantize(model, scheme))
        assert q.ROUNDING_STEPS - 0.01 < error <= q.error_bound(dtype), (scheme, dtype, error)


def test_decode_times_read_the_speed_up_the_right_way_round(gpt, monkeypatch):
    """Fed step times where the second variant takes twice as long, the table says 0.5 and slower."""
    models = {"fp32 weights": gpt, "twice as slow": q.quantize(gpt, "int8")}
    calls = iter(range(1000))

    def generate(model, prompt, new_tokens, **options):
        jitter = 1 + 0.01 * (next(calls) % 3)  # rounds differ a little, so the interval has a width
        step = 0.001 * jitter * (2 if model is models["twice as slow"] else 1)
        return q.generation.Generation(prompt, prompt.size(1), step, [step] * (new_tokens - 1))

    monkeypatch.setattr(q.generation, "generate", generate)
    times = q.decode_times(models, batch=4, prompt_len=2, new_tokens=3, rounds=8)
    row = times.table().loc["twice as slow"]
    assert abs(row["speed-up"] - 0.5) < 0.02 and row["verdict"] == "slower", row
    assert abs(times.table().loc["fp32 weights", "tokens/s"] - 4 / 0.00101) < 50


def test_decode_times_reuse_one_cache_per_variant(gpt, monkeypatch):
    """Every timed run fills the variant's one static cache again, emptied first: a new cache each run would move
    the storage, and on a GPU each run would record its CUDA graphs inside the timed steps."""
    models, _ = q.variants(gpt)
    pointers: dict[int, set] = {}
    real = q.generation.generate

    def generate(model, prompt, new_tokens, **options):
        cache = options.get("reuse")
        assert cache is not None and options["cache"] == "static", "a run without a reused static cache"
        pointers.setdefault(id(model), set()).add(cache.data_pointers())
        result = real(model, prompt, new_tokens, **options)
        assert int(cache.lengths.max()) == prompt.size(1) + new_tokens - 1  # filled from empty, not appended to
        return result

    monkeypatch.setattr(q.generation, "generate", generate)
    q.decode_times(models, batch=2, prompt_len=4, new_tokens=3, rounds=3)
    assert len(pointers) == len(models) and all(len(seen) == 1 for seen in pointers.values())


def test_generate_into_a_reused_cache_gives_the_same_tokens(gpt):
    prompt = torch.randint(gpt.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    cache = q.generation.StaticKVCache(gpt, 2, 12)
    fresh = q.generation.generate(gpt, prompt, 6).tokens
    for _ in range(2):  # the second run starts from a cache the first one filled
        assert torch.equal(q.generation.generate(gpt, prompt, 6, reuse=cache).tokens, fresh)
    with pytest.raises(OptlabError, match="reuse needs"):
        q.generation.generate(gpt, prompt, 9, reuse=cache)


def test_a_compiled_variants_peak_counts_its_own_graph_pool_on_a_gpu(monkeypatch):
    """Other variants' graphs already hold 500 MiB of private pools on a (fake) GPU: a compiled variant's peak adds
    the 48 MiB its own run recorded there, neither the device's total nor nothing; an eager run adds none."""
    pools = {"mb": 500.0}
    monkeypatch.setattr(memory, "graph_pool_mb", lambda device: pools["mb"])
    monkeypatch.setattr(q, "phase_start", lambda device: 0)
    monkeypatch.setattr(q, "phase_peak_mb", lambda device, start, resident, increase: resident + 10.0)
    monkeypatch.setattr(q, "resident_mb", lambda owners, device: 100.0)

    def record() -> None:
        pools["mb"] += 48.0

    cuda = torch.device("cuda")
    assert q._peak_mib(nn.Linear(2, 2), record, cuda, graphs=True) == pytest.approx(158.0)
    assert q._peak_mib(nn.Linear(2, 2), lambda: None, cuda, graphs=True) == pytest.approx(110.0)  # replays only
    assert q._peak_mib(nn.Linear(2, 2), record, cuda, graphs=False) == pytest.approx(110.0)
