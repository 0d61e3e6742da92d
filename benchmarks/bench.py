"""`make bench`: two ratios, each measured side by side in one run on this machine.

1. Harness overhead: optlab's measured training loop against a plain hand-written loop, same model and batches
   (target: at most 1.03).
2. Stand-in data cost: the stand-in's per-image loading against torchvision's own CIFAR10 ``__getitem__`` over
   identical arrays (target: between 0.8 and 1.25).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torchvision.datasets import CIFAR10

from optlab.core import data
from optlab.core.config import RunConfig
from optlab.core.device import resolve_device
from optlab.core.loops import make_optimizer, make_scaler, prepare_model, train_phase
from optlab.core.models import build_model

ROUNDS = 5


def plain_loop(model, batches, optimizer, device) -> float:
    """What a reader would write by hand; returns seconds per step."""
    model.train()
    start = time.perf_counter()
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / len(batches)


def harness_overhead(steps: int = 12, warmup: int = 2) -> float:
    info = resolve_device("auto")
    config = RunConfig(batch_size=16, width=0.125, num_workers=0, pin_memory=False)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator))
               for _ in range(steps + warmup)]
    torch.manual_seed(0)
    ours_model = prepare_model(build_model("resnet18", width=0.125), config, info.device)
    torch.manual_seed(0)
    plain_model = prepare_model(build_model("resnet18", width=0.125), config, info.device)
    ours_optimizer, plain_optimizer = make_optimizer(ours_model, config), make_optimizer(plain_model, config)
    scaler = make_scaler(config, info.device)
    ours, plain = [], []
    for _ in range(ROUNDS):  # interleaved: A B A B
        result = train_phase(ours_model, batches, ours_optimizer, scaler, config, info.device, steps, warmup)
        ours.append(statistics.fmean(result.step_times_s))
        plain_loop(plain_model, batches[:warmup], plain_optimizer, info.device)
        plain.append(plain_loop(plain_model, batches[warmup:], plain_optimizer, info.device))
    print(f"  optlab loop  {1e3 * statistics.median(ours):8.2f} ms/step   (median of {ROUNDS})")
    print(f"  plain loop   {1e3 * statistics.median(plain):8.2f} ms/step")
    return statistics.median(ours) / statistics.median(plain)


def per_image_seconds(dataset, count: int) -> float:
    start = time.perf_counter()
    for index in range(count):
        dataset[index]
    return (time.perf_counter() - start) / count


def standin_cost(count: int = 2000) -> float:
    standin = data.StandInCIFAR10(True, data.train_transform())
    reference = CIFAR10.__new__(CIFAR10)  # torchvision's class over the same arrays, without files on disk
    reference.data, reference.targets = standin.data, standin.targets
    reference.transform, reference.target_transform = data.train_transform(), None
    ours, theirs = [], []
    for _ in range(ROUNDS):
        torch.manual_seed(0)
        ours.append(per_image_seconds(standin, count))
        torch.manual_seed(0)
        theirs.append(per_image_seconds(reference, count))
    print(f"  stand-in            {1e6 * statistics.median(ours):8.1f} us/image   (median of {ROUNDS})")
    print(f"  torchvision CIFAR10 {1e6 * statistics.median(theirs):8.1f} us/image")
    return statistics.median(ours) / statistics.median(theirs)


def main() -> None:
    print(f"device: {resolve_device('auto').describe()}; torch threads: {torch.get_num_threads()}")
    print("harness overhead (optlab loop / plain loop), target <= 1.03:")
    overhead = harness_overhead()
    print(f"  ratio {overhead:.3f}  {'within target' if overhead <= 1.03 else 'OVER TARGET'}")
    print("stand-in data cost (stand-in / torchvision CIFAR10 per image), target 0.8-1.25:")
    cost = standin_cost()
    print(f"  ratio {cost:.3f}  {'within target' if 0.8 <= cost <= 1.25 else 'OUTSIDE TARGET'}")


if __name__ == "__main__":
    main()
