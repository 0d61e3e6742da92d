"""FP8 linear layers: where they pay, which backend runs, and their numerics on a CPU against float32."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optlab.core.errors import OptlabError
from optlab.core.fp8 import FP8Linear, fp8_support, scaled_mm_runs, swap_linears_to_fp8
from optlab.core.transformer import GPT, GPT_SIZES

# Measured here (3 seeds, a 64 -> 256 linear on 8 x 64 rows): relative error of the output 3.6 %, of the input and
# weight gradients 5.8-6.0 % (e5m2 keeps 2 mantissa bits); the bias gradient is exact (no FP8 on that path).
FORWARD_TOLERANCE, GRADIENT_TOLERANCE = 0.06, 0.10
QUANTIZED = 0.005  # below this the layer did not run in FP8 at all

pytestmark = pytest.mark.skipif(scaled_mm_runs("cpu") is not None, reason="torch._scaled_mm does not run here")


def relative_error(value, reference):
    return ((value - reference).norm() / reference.norm()).item()


def test_fp8_support_says_why_not_on_a_cpu_in_one_line():
    reason = fp8_support("cpu")
    assert "compute capability 8.9" in reason and "\n" not in reason


# marked cuda (skipped without CUDA, run by make gpu-check); skipped too on a GPU older than FP8
FP8_GPU = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.is_available() and fp8_support("cuda") is not None,
                                                reason="no GPU of compute capability 8.9 or newer")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=FP8_GPU)])
def test_an_fp8_linear_forward_and_backward_match_float32_within_the_stated_tolerance(device):
    torch.manual_seed(0)
    linear = nn.Linear(64, 256).to(device)
    model = nn.Sequential(copy.deepcopy(linear))
    assert swap_linears_to_fp8(model, backend="torch") == "torch" and isinstance(model[0], FP8Linear)
    x = torch.randn(8, 64, 64, requires_grad=True, device=device)
    x_fp8 = x.detach().clone().requires_grad_()
    reference, out = linear(x), model(x_fp8)
    upstream = torch.randn_like(reference) * 1e-6  # gradients this small underflow e5m2 unless they are scaled
    reference.backward(upstream)
    out.backward(upstream)
    errors = {"output": relative_error(out, reference), "input grad": relative_error(x_fp8.grad, x.grad),
              "weight grad": relative_error(model[0].weight.grad, linear.weight.grad)}
    assert QUANTIZED < errors["output"] < FORWARD_TOLERANCE, errors
    assert QUANTIZED < errors["input grad"] < GRADIENT_TOLERANCE, errors
    assert QUANTIZED < errors["weight grad"] < GRADIENT_TOLERANCE, errors
    torch.testing.assert_close(model[0].bias.grad, linear.bias.grad, rtol=1e-5, atol=0)
    assert out.dtype == torch.float32 and out.shape == reference.shape


def test_the_gpt_swaps_every_linear_but_its_tied_head_and_its_loss_stays_close():
    torch.manual_seed(0)
    model = GPT(GPT_SIZES["gpt_tiny"])
    fp8 = copy.deepcopy(model)
    assert swap_linears_to_fp8(fp8, backend="torch") == "torch"
    linears = [m for m in fp8.modules() if isinstance(m, nn.Linear)]
    assert [type(m) for m in linears].count(FP8Linear) == len(linears) - 1
    assert type(fp8.head) is nn.Linear and fp8.head.weight is fp8.token_embedding.weight
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(0))
    losses = [F.cross_entropy(m(idx).flatten(0, 1), idx.flatten()) for m in (model, fp8)]
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=0.01)
    for loss in losses:
        loss.backward()
    grad, grad_fp8 = model.blocks[0].mlp.fc.weight.grad, fp8.blocks[0].mlp.fc.weight.grad
    assert relative_error(grad_fp8, grad) < GRADIENT_TOLERANCE


def test_auto_refuses_a_device_where_fp8_does_not_pay_and_bad_backends_are_named():
    with pytest.raises(OptlabError, match="compute capability 8.9"):
        swap_linears_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    with pytest.raises(OptlabError, match="unknown FP8 backend 'fast'; choose one of: auto, torchao, torch"):
        swap_linears_to_fp8(nn.Sequential(nn.Linear(16, 16)), backend="fast")
