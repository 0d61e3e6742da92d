"""`make bench`: three figures, each measured live on this machine.

1. Harness overhead: optlab's measured training loop against a plain hand-written loop, same model and batches
   (target: at most 1.03).
2. Stand-in data cost: the stand-in's per-image loading against torchvision's own CIFAR10 ``__getitem__`` over
   identical arrays (target: between 0.8 and 1.25).
3. A/A false verdicts: the same configuration timed against itself through the registry's API (smoke profile,
   ResNet18 and MobileNetV2, train and test), ``A_A_RUNS`` times; how many of those comparisons got a verdict other
   than "no clear difference" (target: at most 1 %), and whether the variant in the second slot of a repeat tends to
   be faster (the order effect that rotating the order cancels).
"""
from __future__ import annotations

import contextlib
import io
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torchvision.datasets import CIFAR10
from tqdm import tqdm

from optlab.core import data
from optlab.core.config import RunConfig
from optlab.core.device import resolve_device
from optlab.core.experiments import run_experiment
from optlab.core.sequential import visit_order
from optlab.core.registry import Experiment
from optlab.core.loops import make_optimizer, make_scaler, prepare_model, train_phase
from optlab.core.models import build_model

ROUNDS = 5
A_A_RUNS = 30  # x 2 models x 2 phases = 120 comparisons, about 2-4 minutes on 2 cores
A_A = Experiment("a_a", "the same configuration twice", "", variants=(("A", {}), ("A again", {})))


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


def a_a_false_verdicts(runs: int = A_A_RUNS) -> tuple[int, int, float]:
    """False verdicts among ``runs`` A/A experiments' comparisons, and the share of repeats whose second slot was faster."""
    false, total, second_faster, pairs = 0, 0, 0, 0
    for seed in tqdm(range(runs), desc="A/A runs", file=sys.stderr, leave=False):
        with contextlib.redirect_stdout(io.StringIO()):
            result = run_experiment(A_A, profile="smoke", device="cpu", seed=seed, progress=False)
        compared = result.summary[result.summary["variant"] == "A again"]
        false += int((compared["verdict"] != "no clear difference").sum())
        total += len(compared)
        for _, group in result.samples.groupby(["model", "phase", "repeat"]):
            first, second = visit_order(A_A.labels, int(group["repeat"].iloc[0]))
            times = group.set_index("variant")["epoch_equiv_s"]
            second_faster += int(times[second] < times[first])
            pairs += 1
    return false, total, second_faster / pairs


def main() -> None:
    print(f"device: {resolve_device('auto').describe()}; torch threads: {torch.get_num_threads()}")
    print("harness overhead (optlab loop / plain loop), target <= 1.03:")
    overhead = harness_overhead()
    print(f"  ratio {overhead:.3f}  {'within target' if overhead <= 1.03 else 'OVER TARGET'}")
    print("stand-in data cost (stand-in / torchvision CIFAR10 per image), target 0.8-1.25:")
    cost = standin_cost()
    print(f"  ratio {cost:.3f}  {'within target' if 0.8 <= cost <= 1.25 else 'OUTSIDE TARGET'}")
    print(f"A/A comparisons ({A_A_RUNS} runs of the same configuration against itself, smoke profile), target <= 1 %:")
    false, total, second_faster = a_a_false_verdicts()
    print(f"  second slot faster in {100 * second_faster:.0f} % of repeats (50 %: no order effect)")
    print(f"A/A false verdicts: {false}/{total} ({100 * false / total:.1f} %)  "
          f"{'within target' if false <= 0.01 * total else 'OVER TARGET'}")


if __name__ == "__main__":
    main()
