"""Studies' numbers on inputs where a slip gives another number: FP8 rows that are not a multiple of 16 and a weight in
another dtype than its input, a KV cache row loaded without a reset, and AdamW's amsgrad moment in the state count."""
import pytest
import torch
from torch import nn

from optlab.core.gpt import fp8
from optlab.core.gpt.transformer import GPT, GPTConfig
from optlab.studies.memory.breakdown import optimizer_state_bytes
from optlab.studies.serving import generation as g


@pytest.mark.parametrize("rows", [1, 5, 17, 31, 33])
def test_fp8_pads_any_row_count_up_to_the_next_multiple_of_16_and_returns_the_rows_asked(rows, monkeypatch):
    seen = []
    apply = fp8.FP8Matmul.apply

    def recording(x, weight, out_dtype):
        seen.append(x.shape[0])
        return apply(x, weight, out_dtype)

    monkeypatch.setattr(fp8.FP8Matmul, "apply", recording)
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    x = torch.randn(rows, 32)
    out = fp8.FP8Linear.from_linear(linear)(x)
    assert seen == [-(-rows // fp8.ALIGN) * fp8.ALIGN] and out.shape == (rows, 16)
    assert torch.allclose(out, linear(x), rtol=0.15, atol=0.15)


def test_fp8_returns_each_gradient_in_its_own_tensors_dtype_with_its_precision():
    """A bf16 input into a float32 weight (no autocast): the input's gradient is bf16 and the weight's float32, computed
    in float32 (autograd would cast a bf16 one up silently, and every value would then be a bf16 number)."""
    torch.manual_seed(0)
    linear = fp8.FP8Linear.from_linear(nn.Linear(64, 32))
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    out = linear(x)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    weight_grad = linear.weight.grad
    assert x.grad.dtype == torch.bfloat16 and weight_grad.dtype == torch.float32
    assert (weight_grad.to(torch.bfloat16).float() != weight_grad).float().mean() > 0.5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()


def test_loading_a_row_updates_the_longest_length_at_once(model):
    """``longest`` bounds every row's length, and a step reads it without a sync: a row loaded longer than the rest
    raises it at once, and one loaded shorter over the longest lowers it."""
    source = g.StaticKVCache(model, 2, 20)
    source.lengths[:] = torch.tensor([7, 3])
    cache = g.StaticKVCache(model, 3, 20)
    cache.load_row(1, source, 0)
    assert cache.longest == 7 and cache.lengths.tolist() == [0, 7, 0]
    cache.load_row(2, source, 1)
    assert cache.longest == 7 and cache.lengths.tolist() == [0, 7, 3]
    cache.load_row(1, source, 1)
    assert cache.longest == 3 and cache.lengths.tolist() == [0, 3, 3]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t))


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, amsgrad=True), lambda p: torch.optim.AdamW(p), lambda p: torch.optim.Adam(p),
    lambda p: torch.optim.Adam(p, amsgrad=True), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.SGD(p, lr=0.1),
], ids=["AdamW amsgrad", "AdamW", "Adam", "Adam amsgrad", "SGD momentum", "SGD"])
def test_the_optimizer_state_count_is_the_bytes_the_optimizer_keeps_after_a_step(make):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = make(net.parameters())
    net(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    params = list(net.parameters())
    assert optimizer_state_bytes(optimizer, params, torch.device("cpu")) == state_bytes(optimizer)
