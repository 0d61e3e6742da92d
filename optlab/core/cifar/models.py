"""CIFAR variants of torchvision's ResNet and MobileNetV2, plus the seed's one-channel-narrower "rec" variant."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from ..errors import OptlabError, choice_error

NUM_CLASSES = 10

# kuangliu/pytorch-cifar strides: the second stage keeps stride 1 so that 32x32 inputs end at 4x4.
_MOBILENET_V2_CIFAR = [[1, 16, 1, 1], [6, 24, 2, 1], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]


# torchvision is imported where a model is built: importing it costs a second (it pulls in torch._dynamo), which
# every process that imports optlab but builds no CNN (the GPT's, the command line's, each parallel rank) would pay.
def _cifar_resnet(bottleneck: bool, layers: list[int]) -> nn.Module:
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    model = ResNet(Bottleneck if bottleneck else BasicBlock, layers, num_classes=NUM_CLASSES)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)  # 3x3 stem for 32x32 images
    model.maxpool = nn.Identity()
    return model


def _cifar_mobilenet_v2() -> nn.Module:
    from torchvision.models import MobileNetV2  # late import: see _cifar_resnet

    model = MobileNetV2(num_classes=NUM_CLASSES, inverted_residual_setting=_MOBILENET_V2_CIFAR)
    model.features[0][0].stride = (1, 1)  # stem keeps 32x32
    return model


_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: _cifar_resnet(False, [2, 2, 2, 2]),
    "resnet50": lambda: _cifar_resnet(True, [3, 4, 6, 3]),
    "resnet101": lambda: _cifar_resnet(True, [3, 4, 23, 3]),
    "mobilenet_v2": _cifar_mobilenet_v2,
}
MODEL_NAMES = tuple(_BUILDERS)


def validate_names(models: Iterable[str]) -> tuple[str, ...]:
    """``models`` as a tuple, each checked against :data:`MODEL_NAMES`; at least one."""
    models = tuple(models)
    for model in models:
        if model not in MODEL_NAMES:
            raise choice_error("model", model, MODEL_NAMES)
    if not models:
        raise OptlabError("no models given; choose from: " + ", ".join(MODEL_NAMES))
    return models


def build_model(name: str, variant: str = "base", width: float = 1.0) -> nn.Module:
    """Build a CIFAR model by name. ``variant="rec"`` makes every conv/linear one channel narrower;
    ``width`` scales every channel count (for tiny CPU runs)."""
    if name not in _BUILDERS:
        raise choice_error("model", name, MODEL_NAMES)
    if variant not in ("base", "rec"):
        raise choice_error("model variant", variant, ("base", "rec"))
    model = _BUILDERS[name]()
    if width != 1.0:
        resize_channels(model, lambda c: max(1, round(c * width)))
    if variant == "rec":
        resize_channels(model, lambda c: c - 1)
    return model


def resize_channels(model: nn.Module, new_count: Callable[[int], int]) -> nn.Module:
    """Rebuild every Conv2d, BatchNorm2d and Linear with each channel count ``c`` mapped to ``new_count(c)``.

    The mapping is a function of the count alone, so every residual sum and depthwise group stays consistent.
    The image's 3 input channels and the classifier's outputs are kept. Weights are freshly initialised.
    """
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    convs = [child for _, _, child in layers if isinstance(child, nn.Conv2d)]
    linears = [child for _, _, child in layers if isinstance(child, nn.Linear)]
    stem, head = convs[0], linears[-1]
    for parent, name, child in layers:
        if isinstance(child, nn.Conv2d):
            in_c = child.in_channels if child is stem else new_count(child.in_channels)
            out_c = new_count(child.out_channels)
            depthwise = child.groups > 1
            if depthwise and not child.groups == child.in_channels == child.out_channels:
                raise ValueError(f"cannot resize grouped convolution {child}")
            replacement: nn.Module = nn.Conv2d(
                in_c, out_c, child.kernel_size, child.stride, child.padding, child.dilation,
                groups=in_c if depthwise else 1, bias=child.bias is not None,
            )
            nn.init.kaiming_normal_(replacement.weight, mode="fan_out", nonlinearity="relu")  # torchvision's init
        elif isinstance(child, nn.BatchNorm2d):
            replacement = nn.BatchNorm2d(new_count(child.num_features), child.eps, child.momentum)
        elif isinstance(child, nn.Linear):
            out_f = child.out_features if child is head else new_count(child.out_features)
            replacement = nn.Linear(new_count(child.in_features), out_f, bias=child.bias is not None)
        else:
            continue
        setattr(parent, name, replacement)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def conv_and_linear_widths(model: nn.Module) -> list[int]:
    """Output channel counts of every conv and linear layer, in order (used to check the variants)."""
    return [
        m.out_channels if isinstance(m, nn.Conv2d) else m.out_features
        for m in model.modules()
        if isinstance(m, (nn.Conv2d, nn.Linear))
    ]


def example_input(batch_size: int = 2) -> torch.Tensor:
    return torch.randn(batch_size, 3, 32, 32)
