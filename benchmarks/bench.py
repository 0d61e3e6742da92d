"""`make bench`: four figures, each measured live on this machine, each from paired repeats with its interval.

1. Harness overhead: optlab's measured training loop against a plain hand-written loop, same model and batches,
   timed in mirrored rounds (target: at most 1.03).
2. Stand-in data cost: the stand-in's per-image loading against torchvision's own CIFAR10 ``__getitem__`` over
   identical arrays, in mirrored rounds (target: between 0.8 and 1.25).
3. A/A false verdicts: the same configuration timed against itself (five copies, or ``--copies N``), through the
   registry's API and its sequential rule (smoke profile; ResNet18 and MobileNetV2, train and test, or with
   ``--workload gpt`` the tiny GPT, train and test). The unit is a *run*: its
   comparisons share one baseline and one stopping decision, so they are not independent; the line counts the runs
   with any "faster" or "slower" (target: at most the page bound of a run's comparisons, ``timing.page_bound``),
   with the one-sided 95 % upper bound of that rate (a rate above the target is called over it only where its
   one-sided 95 % lower bound is above it too), whether the variant in the second slot of a round tends to be
   faster, and the median round-level noise of this reference workload (what the rule has to tell 2 % through).
4. Live power: a small real difference (a batch of 16 + 3 images against 16, per image, ResNet18 training), its
   long-run effect from many repeats, and how often the profile's own sequential run calls it "faster".
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torchvision.datasets import CIFAR10
from tqdm import tqdm

from optlab.core.cifar import data
from optlab.core.process import quiet
from optlab.core.knobs.config import RunConfig
from optlab.core.machine.device import resolve_device
from optlab.core.run.experiments import run_experiment
from optlab.core.stats.sequential import visit_order
from optlab.core.techniques.registry import Experiment
from optlab.core.measuring.loops import make_optimizer, make_scaler, prepare_model, train_phase
from optlab.core.cifar.models import build_model
from optlab.core.knobs.profiles import get_profile
from optlab.core.measuring.timing import FASTER, INTERVAL, SLOWER, VERDICTS, page_bound, percent, speed_up
from optlab.core.workload import WORKLOADS

ROUNDS = 20  # mirrored rounds for the two ratios
A_A_RUNS = 27  # runs of 2 models x 2 phases x 4 comparisons (16 a run, read together): the unit is the run
POWER_RUNS = 10
A_A_COPIES = 5
MAX_COPIES = 8  # a page's largest comparison: a baseline and seven variants
EXTRA_IMAGES = Experiment("extra_images", "16 + 3 images per batch against 16", "", phases=("train",),
                          variants=(("batch 16", {}), ("batch 16 + 3", {"batch_offset": 3})))


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


def mirrored(first: Callable[[], float], second: Callable[[], float], rounds: int = ROUNDS) -> tuple[list, list, list]:
    """Both measurements in mirrored rounds (A B, B A, ...): their values and the second's slot shift per round."""
    a, b, shifts = [], [], []
    for index in range(rounds):
        order = visit_order(["a", "b"], index)
        values = {label: (first if label == "a" else second)() for label in order}
        a.append(values["a"])
        b.append(values["b"])
        shifts.append(order.index("b") - order.index("a"))
    return a, b, shifts


def report_ratio(numerator: list, denominator: list, shifts: list, low: float, high: float) -> None:
    """``numerator / denominator`` with its interval, and whether the whole interval is within [low, high]."""
    result = speed_up(numerator, denominator, shifts)  # speed_up(a, b) is a / b
    inside = low <= result.low and result.high <= high
    outside = result.high < low or result.low > high
    status = "within target" if inside else "OUTSIDE TARGET" if outside else "interval reaches past the target"
    print(f"  ratio {result.ratio:.3f} ({INTERVAL} {result.low:.3f}-{result.high:.3f}, {len(numerator)} pairs)  "
          f"{status}")


def harness_overhead(steps: int = 12, warmup: int = 2) -> None:
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

    def ours() -> float:
        result = train_phase(ours_model, batches, ours_optimizer, scaler, config, info.device, steps, warmup)
        return statistics.fmean(result.step_times_s)

    def plain() -> float:
        plain_loop(plain_model, batches[:warmup], plain_optimizer, info.device)
        return plain_loop(plain_model, batches[warmup:], plain_optimizer, info.device)

    a, b, shifts = mirrored(ours, plain)
    print(f"  optlab loop  {1e3 * statistics.median(a):8.2f} ms/step   (median of {ROUNDS})")
    print(f"  plain loop   {1e3 * statistics.median(b):8.2f} ms/step")
    report_ratio(a, b, shifts, 0.0, 1.03)


def per_image_seconds(dataset, count: int) -> float:
    torch.manual_seed(0)
    start = time.perf_counter()
    for index in range(count):
        dataset[index]
    return (time.perf_counter() - start) / count


def standin_cost(count: int = 1000) -> None:
    standin = data.StandInCIFAR10(True, data.train_transform())
    reference = CIFAR10.__new__(CIFAR10)  # torchvision's class over the same arrays, without files on disk
    reference.data, reference.targets = standin.data, standin.targets
    reference.transform, reference.target_transform = data.train_transform(), None
    a, b, shifts = mirrored(lambda: per_image_seconds(standin, count), lambda: per_image_seconds(reference, count))
    print(f"  stand-in            {1e6 * statistics.median(a):8.1f} us/image   (median of {ROUNDS})")
    print(f"  torchvision CIFAR10 {1e6 * statistics.median(b):8.1f} us/image")
    report_ratio(a, b, shifts, 0.8, 1.25)


def binomial_mass(total: int, p: float, counts: range) -> float:
    """The probability that ``total`` draws at rate ``p`` give a count in ``counts``."""
    return sum(math.comb(total, k) * p ** k * (1 - p) ** (total - k) for k in counts)


def upper_bound(false: int, total: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson upper bound of a rate seen ``false`` times in ``total``: the rate at which
    seeing at most ``false`` has probability 1 - ``confidence``."""
    def at_most(p: float) -> float:
        return binomial_mass(total, p, range(false + 1))
    low, high = false / total, 1.0
    for _ in range(60):  # bisection: at_most falls as p rises
        middle = (low + high) / 2
        low, high = (middle, high) if at_most(middle) > 1 - confidence else (low, middle)
    return high


def lower_bound(false: int, total: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson lower bound of a rate seen ``false`` times in ``total``: the rate at which
    seeing at least ``false`` has probability 1 - ``confidence`` (0 when ``false`` is 0)."""
    if false == 0:
        return 0.0
    def at_least(p: float) -> float:
        return binomial_mass(total, p, range(false, total + 1))
    low, high = 0.0, false / total
    for _ in range(60):  # bisection: at_least rises with p
        middle = (low + high) / 2
        low, high = (middle, high) if at_least(middle) < 1 - confidence else (low, middle)
    return low


def rate_status(false: int, total: int, target: float) -> str:
    """"within target" when the rate seen is at most ``target``; "OVER TARGET" when even its one-sided 95 % lower
    bound is above it; otherwise the seen rate is above the target by an amount these runs cannot tell from chance."""
    if false <= target * total:
        return "within target"
    bound = lower_bound(false, total)
    if bound > target:
        return "OVER TARGET"
    return f"above target by no more than chance explains (one-sided 95 % lower bound {100 * bound:.1f} %)"


def quiet_run(experiment: Experiment, seed: int, profile="smoke", models=None):
    with contextlib.redirect_stdout(io.StringIO()):
        return run_experiment(experiment, profile=profile, models=models, device="cpu", seed=seed, progress=False)


def a_a_experiment(copies: int, workload: str = "cifar") -> Experiment:
    """``copies`` copies of one configuration of ``workload``: every variant the baseline again."""
    return Experiment("a_a", f"the same configuration {copies} times", "", workload=workload,
                      variants=tuple((f"A, copy {i}", {}) for i in range(1, copies + 1)))


def a_a_false_verdicts(runs: int = A_A_RUNS, copies: int = A_A_COPIES, workload: str = "cifar") -> dict:
    """Of ``runs`` experiments with ``copies`` copies of one configuration: how many runs had any false verdict, how many
    comparisons a run holds, the share of rounds whose second slot was faster than the first, the mean repeats a
    model took and the median round-level noise of the comparisons."""
    false_runs, per_run, second_faster, pairs, repeats, noise = 0, 0, 0, 0, [], []
    for seed in tqdm(range(runs), desc="A/A runs", file=sys.stderr, leave=False):
        result = quiet_run(a_a_experiment(copies, workload), seed)
        compared = result.summary[result.summary["verdict"] != "baseline"]
        false_runs += int(compared["verdict"].isin([FASTER, SLOWER]).any())
        per_run = max(per_run, len(compared))
        noise += compared["noise"].dropna().tolist()
        repeats += [r["repeats"] for r in result.record["rounds"].values()]
        for _, group in result.samples.groupby(["model", "phase", "repeat"]):
            times = group.sort_values("slot")["epoch_equiv_s"].to_numpy()
            second_faster += int(times[1] < times[0])
            pairs += 1
    return {"false_runs": false_runs, "per_run": per_run, "second_faster": second_faster / pairs,
            "mean_repeats": statistics.fmean(repeats), "median_noise": statistics.median(noise) if noise else math.nan}


def live_power(runs: int = POWER_RUNS) -> None:
    prof = get_profile("smoke")
    long_run = quiet_run(EXTRA_IMAGES, 1000, prof.with_sizes(repeats=24, max_repeats=24), ["resnet18"])
    row = long_run.summary.set_index("variant").loc["batch 16 + 3"]
    print(f"  long run ({int(row['n'])} pairs): {row['speedup']:.3f} ({INTERVAL} {row['ci_low']:.3f}-"
          f"{row['ci_high']:.3f})")
    verdicts, repeats = [], []
    for seed in tqdm(range(runs), desc="power runs", file=sys.stderr, leave=False):
        result = quiet_run(EXTRA_IMAGES, seed, models=["resnet18"])
        verdicts.append(result.summary.set_index("variant").loc["batch 16 + 3", "verdict"])
        repeats.append(result.record["rounds"]["resnet18"]["repeats"])
    counts = ", ".join(f"{v} {verdicts.count(v)}" for v in VERDICTS if verdicts.count(v))
    print(f"  the smoke profile's own run, {runs} times: {counts}; repeats: mean {statistics.fmean(repeats):.1f}")


PARTS = ("overhead", "standin", "a-a", "power")
MAX_RUNS = 200


def arguments(argv: "list[str] | None" = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="make bench: the harness's own figures, measured live")
    parser.add_argument("--only", choices=PARTS, action="append", help="run only these parts (repeatable)")
    parser.add_argument("--a-a-runs", type=int, default=A_A_RUNS, help=f"A/A runs (default {A_A_RUNS})")
    parser.add_argument("--power-runs", type=int, default=POWER_RUNS, help=f"live power runs (default {POWER_RUNS})")
    parser.add_argument("--copies", type=int, default=A_A_COPIES,
                        help=f"copies of one configuration in an A/A run (default {A_A_COPIES})")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cifar",
                        help="the A/A run's workload: cifar (ResNet18 and MobileNetV2) or gpt (the tiny GPT)")
    args = parser.parse_args(argv)
    if not 2 <= args.copies <= MAX_COPIES:
        parser.error(f"--copies must be from 2 to {MAX_COPIES} (a baseline and up to {MAX_COPIES - 1} variants), "
                     f"got {args.copies}")
    for name in ("a_a_runs", "power_runs"):
        if not 1 <= getattr(args, name) <= MAX_RUNS:
            parser.error(f"--{name.replace('_', '-')} must be from 1 to {MAX_RUNS}, got {getattr(args, name)}")
    return args


def main(argv: "list[str] | None" = None) -> None:
    args = arguments(argv)
    parts = set(args.only or PARTS)
    info = resolve_device("auto")
    print(f"device: {info.describe()}; torch threads: {quiet.fix_threads(info.is_cuda)} (every part below)")
    if "overhead" in parts:
        print("harness overhead (optlab loop / plain loop), target <= 1.03:")
        harness_overhead()
    if "standin" in parts:
        print("stand-in data cost (stand-in / torchvision CIFAR10 per image), target 0.8-1.25:")
        standin_cost()
    if "a-a" in parts:
        a_a_lines(args.a_a_runs, args.copies, args.workload)
    if "power" in parts:
        print("live power: a batch of 16 + 3 images against 16 (ResNet18 training, per image):")
        live_power(args.power_runs)


def a_a_lines(runs: int, copies: int = A_A_COPIES, workload: str = "cifar") -> None:
    experiment = a_a_experiment(copies, workload)
    models = ", ".join(experiment.default_models(get_profile("smoke")))
    phases = " and ".join(experiment.phases)
    print(f"A/A runs ({runs} runs of {copies} copies of one configuration: {models}, {phases}, smoke profile, "
          "sequential rule; unit: a run, whose comparisons share one baseline and one stopping decision):")
    found = a_a_false_verdicts(runs, copies, workload)
    target = page_bound(found["per_run"])
    print(f"  second slot faster in {100 * found['second_faster']:.0f} % of rounds (50 %: no order effect); "
          f"mean repeats per model {found['mean_repeats']:.1f}")
    print(f"  median round noise of this workload: {100 * found['median_noise']:.1f} % (standard deviation of a "
          "round's log speed-up)")
    bound = upper_bound(found["false_runs"], runs)
    print(f"A/A runs with a false verdict: {found['false_runs']}/{runs} runs ({found['per_run']} comparisons "
          f"each; one-sided 95 % upper bound {100 * bound:.1f} %; target at most {percent(target)}, the page bound)  "
          f"{rate_status(found['false_runs'], runs, target)}")


if __name__ == "__main__":
    main()
