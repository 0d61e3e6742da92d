"""What a chapter's parameter cell changes on its page: the models it may run, its own defaults on this device, and
the parameters that have no effect there (and why). :func:`apply` checks the reader's values against the page and
returns the :class:`Setup` every run below reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ..core.errors import OptlabError
from ..core.knobs.profiles import Profile, choice, choose, chosen_sizes, get_profile
from ..core.machine.device import DeviceInfo, resolve_device
from ..core.workload import get_workload

_STUDY = "is a study of its own, not a timed comparison of the profile's"  # why a budget has no effect on a page


@dataclass(frozen=True)
class Page:
    """One chapter's meaning of its parameter cell.

    ``workload``: the page's runs are the profile's comparisons of this workload ("cifar", "gpt"): any of its models
    and the profile's batch size reach the runs' configs. ``None``: a study with models of its own.
    ``models``: by key (``"cpu"``, ``"cuda"``, a profile's name, or ``"cuda-smoke"``: a device with a profile), the
    models the page runs when the reader names none; for a study the only ones it can run.
    ``profile``: the profile a page always runs (the reader's has no effect there); ``device``: the device it runs on.
    ``most``: the page runs at most this many models. ``batch``: a study's own batch size, by the same keys;
    ``budget``: a page's own time budget a model (the profile's where none is given).
    ``unused``: a parameter that has no effect on the page, and why."""

    workload: str | None = None
    models: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    profile: str | None = None
    most: int | None = None
    batch: Mapping[str, int] = field(default_factory=dict)
    budget: Mapping[str, float] = field(default_factory=dict)
    unused: Mapping[str, str] = field(default_factory=dict)
    device: str = "auto"

    def own(self, table: Mapping, cuda: bool, profile: str) -> "tuple[str, ...] | int | float | None":
        """The entry of ``table`` for this device and profile: the device with the profile's, the device's, the
        profile's, else None."""
        device = "cuda" if cuda else "cpu"
        return next((table[key] for key in (f"{device}-{profile}", device, profile) if key in table), None)


def _cnn(cpu: str | None = None, smoke_budget: float | None = None, **unused: str) -> Page:
    return Page("cifar", {"cpu": (cpu,)} if cpu else {}, budget={"smoke": smoke_budget} if smoke_budget else {},
                unused=unused)


def _gpt(model: bool = False, most: int | None = None, smoke_budget: float | None = None) -> Page:
    return Page("gpt", {"cpu": ("gpt_tiny",), "cuda": ("gpt2_small",)} if model else {}, most=most,
                budget={"smoke": smoke_budget} if smoke_budget else {})


def _study(models: "tuple[str, ...] | Mapping[str, tuple[str, ...]]", batch: "int | Mapping[str, int] | None" = None,
           gloo: bool = False, **unused: str) -> Page:
    models = {"cpu": models, "cuda": models} if isinstance(models, tuple) else models
    batch = {"cpu": batch, "cuda": batch} if isinstance(batch, int) else batch or {}
    unused = {"time_budget_s": f"the page {_STUDY}"} | ({"profile": _GLOO} if gloo else {}) | unused
    return Page(None, models, "smoke" if gloo else None, batch=batch, unused=unused, device="cpu" if gloo else "auto")


_SERVED = {"cpu": ("gpt_tiny",), "cuda": ("gpt2_small",)}  # the trained GPT the serving chapters decode with
_GLOO = "its runs are CPU processes joined by gloo at the smoke profile's sizes, whatever the device"
# A page whose CPU run has time to spare within its minute gives a model more seconds of rounds in the smoke profile
# than its 12 (a budget the reader sets wins): an effect of a few percent, or one model where the profile has two.
PAGES: dict[str, Page] = {
    "01_data_loading": _cnn("resnet18"), "02_non_blocking": _cnn(), "03_multiple_of_8": _cnn(smoke_budget=16),
    "04_mixed_precision": _cnn("resnet18", 20), "05_set_to_none": _cnn(smoke_budget=16),
    "06_gradient_accumulation": _cnn(smoke_budget=14), "07_inference": _cnn(), "08_cudnn_benchmark": _cnn("resnet18"),
    "09_channels_last": _cnn("resnet18", 20), "10_torch_compile": _cnn("resnet18"),
    "11_cuda_graphs": _cnn(batch_size="the sweep times batch sizes of its own; only a GPU's comparison uses this one"),
    "12_precision": _cnn("mobilenet_v2", 20), "13_optimizers": _cnn("resnet18", 26),
    "14_data_pipeline": _cnn("resnet18"),
    "15_profiling": Page("cifar", {"cpu": ("resnet18",), "cuda": ("resnet18",)}, most=1,
                         unused={"time_budget_s": "the page profiles a fixed number of steps of each "
                                                  "configuration, in no rounds"}),
    "16_all_together": _cnn("resnet18"),
    "17_distributed": Page("cifar", {"cpu": ("resnet18",), "cuda": ("resnet18",)}, "smoke", 1,
                           unused={"profile": _GLOO}, device="cpu"),
    "18_sharding": _study(("toy_transformer",), 4, gloo=True),
    "19_tensor_parallel": _study(("toy_gpt",), gloo=True, batch_size="every rank trains the same fixed batches, "
                                 "whose collectives and bytes the page checks against their formulas"),
    "20_pipeline_parallel": _study(("pipeline_gpt",), gloo=True, batch_size="a step's 8 sequences are split into "
                                   "4 and 8 micro-batches, whose bubbles the page checks against their formulas"),
    "21_composing_parallelism": _study(("toy_gpt",), gloo=True, batch_size="each row of the mesh trains its "
                                       "fixed batches, whose collectives the page checks against their formulas"),
    "22_attention": _gpt(smoke_budget=24), "23_checkpointing": _gpt(), "24_gpt_precision": _gpt(),
    "25_gpt_optimizers": _gpt(smoke_budget=24), "26_gpt_compile": _gpt(most=1), "27_gpt_shapes": _gpt(True, 1, 24),
    "28_gpt_all_together": _gpt(True, 1, 20),
    "29_memory": _study({"smoke": ("gpt_tiny", "resnet18"), "quick": ("gpt2_small", "resnet18"),
                         "full": ("gpt2_small", "resnet18")}),
    "30_kv_cache": _study(_SERVED, profile=f"the page {_STUDY}", batch_size="it decodes one prompt (batch 1): a "
                          "cache saves the same share of work for each sequence"),
    "31_quantization": _study(_SERVED, profile=f"the page {_STUDY}", batch_size="it decodes at two batch sizes of "
                              "its own, one bandwidth-bound (1) and one not (16 on a CPU, 64 on a GPU)"),
    "32_speculative_decoding": _study({"cpu": ("gpt_deep", "gpt_draft"), "cuda": ("gpt2_small", "gpt2_draft")},
                                      profile=f"the page {_STUDY}", batch_size="it decodes one prompt at a time: "
                                      "speculation pays where a step is bound by reading the weights"),
    "33_serving": _study(_SERVED, profile=f"the page {_STUDY}", batch_size="the server's batches grow and shrink "
                         "as requests arrive and finish"),
    "34_compile_time": _study(("gpt",), batch_size="each start compiles and times one batch of the plan's size"),
    "35_graph_breaks": _study(("token_model",), {"cpu": 8, "cuda": 16}, profile=f"the page {_STUDY}"),
    "36_changing_shapes": _study(("gpt",), batch_size="the stream's batches change size (2 to its largest) on "
                                 "purpose: changing shapes is what the page measures"),
    "37_your_model": Page(None, {"cpu": ("ViT (small)", "ConvNeXt (small)"),
                                 "cuda-smoke": ("ViT (small)", "ConvNeXt (small)"),
                                 "cuda": ("ViT-B/16", "ConvNeXt-T")}, batch={"cpu": 16, "cuda-smoke": 16, "cuda": 64},
                          budget={"cpu": 3.0, "cuda-smoke": 3.0}),  # 3 s a comparison: the page within a minute
}


@dataclass(frozen=True)
class Setup:
    """What a chapter runs, from its parameter cell and its page: the profile, models, batch size (``None``: a study
    whose parts each use their own) and time budget, on ``device``; ``ignored``: a line for each value the reader set
    that has no effect on the page."""

    page: str | None
    profile: Profile
    models: tuple[str, ...]
    batch_size: int | None
    time_budget_s: float | None
    device: DeviceInfo
    line: str
    ignored: tuple[str, ...] = ()

    @property
    def model(self) -> str:
        """The first model: the one a page that runs one model runs."""
        return self.models[0]

    def __str__(self) -> str:
        return "\n".join((self.line, *self.ignored, f"device: {self.device.describe()}"))


def workload_line(profile: Profile, workload: str) -> str:
    """The profile's line with the models and sizes ``workload`` runs under it, the reader's choice applied."""
    spec = get_workload(workload)
    models = tuple(m for m in profile.models if m in spec.model_names) or spec.profile_models.get(profile.name)
    return profile.describe(models, {**spec.profile_knobs.get(profile.name, {}), **chosen_sizes()})


def _checked_models(name: str | None, page: Page, given: "tuple[str, ...] | None",
                   own: "tuple[str, ...] | None") -> None:
    if given is None:
        return
    if not given:
        raise OptlabError(f"chapter {name}: models is empty; name at least one, or set None")
    if page.workload is None:
        if sorted(given) != sorted(own or ()):
            raise OptlabError(f"chapter {name} runs its own models {list(own or ())} on this device, no others: "
                              f"set models to {list(own or ())} or None")
        return
    allowed = get_workload(page.workload).model_names
    wrong = [m for m in given if m not in allowed]
    if wrong:
        raise OptlabError(f"chapter {name} cannot run {', '.join(map(repr, wrong))}: it runs the {page.workload} "
                          f"models {', '.join(allowed)}")
    if page.most is not None and len(given) > page.most:
        raise OptlabError(f"chapter {name} runs {'one model' if page.most == 1 else f'at most {page.most} models'}, "
                          f"got {list(given)}")


def apply(name: str | None, models: "Iterable[str] | None", profile: str | None, batch_size: int | None,
          time_budget_s: float | None, device: str = "auto") -> Setup:
    """Check the reader's values against chapter ``name``'s page (a notebook's stem in :data:`PAGES`) on ``device``
    (``auto``: the page's), make them the process's choice (:func:`~optlab.core.knobs.profiles.choose`) and return
    what the chapter runs. ``name`` ``None``: a page of the profile's CNN comparisons."""
    if name is not None and name not in PAGES:
        raise OptlabError(f"unknown chapter {name!r}; choose one of: {', '.join(PAGES)}")
    page, typed, before = PAGES.get(name, Page("cifar")), profile, choice()
    info = resolve_device(page.device if device == "auto" else device)
    choose(profile, models, batch_size, time_budget_s)  # the checks of a typed choice, before the page's own
    given = choice().models
    profile = page.profile or (None if "profile" in page.unused else profile)  # a page's own profile wins
    choose(profile, None, batch_size, time_budget_s)
    chosen = get_profile(None, info.is_cuda)
    own = page.own(page.models, info.is_cuda, chosen.name)
    try:
        _checked_models(name, page, given, own)
    except OptlabError:  # a refused choice leaves the one before it in force
        choose(before.profile, before.models, before.batch_size, before.time_budget_s)
        raise
    if page.workload is not None:  # the runs read the profile: the page's own default goes where the reader's would
        choose(profile, given or own, batch_size, time_budget_s or page.own(page.budget, info.is_cuda, chosen.name))
        chosen = get_profile(None, info.is_cuda)
        spec = get_workload(page.workload)
        used = tuple(m for m in chosen.models if m in spec.model_names) or spec.profile_models.get(chosen.name, ())
        sizes = {**spec.profile_knobs.get(chosen.name, {}), **chosen_sizes()}
        batch, line = sizes.get("batch_size", chosen.batch_size), workload_line(chosen, page.workload)
    else:  # a study reads the setup: the profile keeps its own models
        used = given or own
        batch = None if "batch_size" in page.unused else batch_size or page.own(page.batch, info.is_cuda, chosen.name)
        line = (f"profile {chosen.name}: models {', '.join(used)}; "
                + (f"batch {batch}" if batch is not None else "batch: the page's own"))
        if "time_budget_s" not in page.unused:
            budget = time_budget_s or page.own(page.budget, info.is_cuda, chosen.name) or chosen.time_budget_s
            line += f"; at most {budget:g} s a comparison"
    set_values = {"models": models, "profile": typed, "batch_size": batch_size, "time_budget_s": time_budget_s}
    ignored = tuple(f"{parameter} = {set_values[parameter]!r} has no effect on this page: {why}"
                    for parameter, why in page.unused.items() if set_values[parameter] is not None)
    budget = None if "time_budget_s" in page.unused else (
        time_budget_s or page.own(page.budget, info.is_cuda, chosen.name) or chosen.time_budget_s)
    return Setup(name, chosen, tuple(used), batch, budget, info, line, ignored)
