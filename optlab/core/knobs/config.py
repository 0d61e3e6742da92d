"""The frozen run configuration: one knob per technique, validated on creation."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import OptlabError, choice_error
from ..workload import get_workload

AMP_DTYPES = ("none", "fp16", "bf16")
EVAL_GRAD_MODES = ("grad", "no_grad", "inference_mode")
MODEL_VARIANTS = ("base", "rec")
OPTIMIZERS = ("sgd", "adam", "adamw")
OPTIMIZER_IMPLS = ("default", "for_loop", "foreach", "fused")
COMPILE_MODES = ("none", "default", "max-autotune", "reduce-overhead", "max-autotune-no-cudagraphs")
ATTENTIONS = ("manual", "sdpa", "sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex")
CHECKPOINTINGS = ("none", "full", "selective")
MAX_SEQ_LEN, MAX_VOCAB = 131_072, 1_048_576


@dataclass(frozen=True)
class RunConfig:
    """Every knob of the measured loops. A variant is ``replace(baseline, knob=value)``.

    The defaults are the seed article's base configuration (4 workers, pinned memory, batch 128).
    """

    workload: str = "cifar"  # what is trained (workload.WORKLOADS): its data, models, loss and unit
    model: str = "resnet18"  # one of the workload's model names
    model_variant: str = "base"  # "rec": every conv/linear layer one channel narrower (seed section 3.1)
    width: float = 1.0  # channel multiplier, below 1 for tiny CPU runs
    batch_size: int = 128
    batch_offset: int = 0  # samples added to batch_size (the seed's "rec" runs used 128 + 1)
    num_workers: int = 4
    pin_memory: bool = True
    persistent_workers: bool = False
    prefetch_factor: int | None = None  # None: DataLoader's default (2) when workers > 0
    drop_last: bool = True  # timed loops keep one batch shape
    non_blocking: bool = False
    prefetch_to_device: bool = False  # copy the next batch on a side CUDA stream while this step computes
    amp_dtype: str = "none"
    set_to_none: bool = True
    accumulation_steps: int = 1
    eval_grad_mode: str = "no_grad"
    cudnn_benchmark: bool = False
    channels_last: bool = False
    # beyond the seed
    optimizer: str = "sgd"
    optimizer_impl: str = "default"  # torch picks foreach on CUDA by default; "fused" runs one kernel per step
    compile_mode: str = "none"  # torch.compile mode; "reduce-overhead" adds CUDA graphs
    matmul_tf32: bool = False  # torch's default: fp32 matmuls in full precision
    cudnn_tf32: bool = True  # torch's default: fp32 convolutions may use TF32 on Ampere and newer
    data_on_device: bool = False  # the whole data set resident on the device, augmented there in batches
    fp8: bool = False  # linear layers in FP8 (optlab.core.gpt.fp8) where the GPU supports it
    # a token model's (the gpt workload's model_knobs; other workloads refuse values but the defaults)
    attention: str = "sdpa"  # how causal attention is computed (optlab.core.gpt.transformer.ATTENTIONS)
    checkpointing: str = "none"  # what backward recomputes: nothing, every block ("full"), the pointwise ops
    seq_len: int | None = None  # tokens per sequence; None: the model's block size
    vocab_size: int | None = None  # the embedding's rows; None: the model's own (a padded vocabulary is larger)

    def __post_init__(self) -> None:
        workload = get_workload(self.workload)
        if self.model not in workload.model_names:
            raise choice_error("model", self.model, workload.model_names)
        if self.data_on_device and workload.device_loader is None:
            raise OptlabError(f"data_on_device=True: the {workload.name} workload cannot hold its data on the device; "
                              "leave it False")
        for knob, default in MODEL_KNOB_DEFAULTS.items():
            if getattr(self, knob) != default and knob not in workload.model_knobs:
                raise OptlabError(f"{knob}={getattr(self, knob)!r}: the {workload.name} workload has no {knob} knob "
                                  f"(leave it {default!r}); it is a knob of a token model's workload such as gpt")
        if self.attention not in ATTENTIONS:
            raise choice_error("attention", self.attention, ATTENTIONS)
        if self.checkpointing not in CHECKPOINTINGS:
            raise choice_error("checkpointing", self.checkpointing, CHECKPOINTINGS)
        if self.seq_len is not None:
            _require_int("seq_len", self.seq_len, minimum=1, maximum=MAX_SEQ_LEN)
        if self.vocab_size is not None:
            _require_int("vocab_size", self.vocab_size, minimum=1, maximum=MAX_VOCAB)
        if self.model_variant not in MODEL_VARIANTS:
            raise choice_error("model variant", self.model_variant, MODEL_VARIANTS)
        if self.amp_dtype not in AMP_DTYPES:
            raise choice_error("AMP dtype", self.amp_dtype, AMP_DTYPES)
        if self.optimizer not in OPTIMIZERS:
            raise choice_error("optimizer", self.optimizer, OPTIMIZERS)
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise choice_error("optimizer implementation", self.optimizer_impl, OPTIMIZER_IMPLS)
        if self.compile_mode not in COMPILE_MODES:
            raise choice_error("compile mode", self.compile_mode, COMPILE_MODES)
        if self.eval_grad_mode not in EVAL_GRAD_MODES:
            raise choice_error("eval grad mode", self.eval_grad_mode, EVAL_GRAD_MODES)
        _require_int("batch_size", self.batch_size, minimum=1)
        _require_int("batch_offset", self.batch_offset, minimum=0)
        _require_int("num_workers", self.num_workers, minimum=0)
        _require_int("accumulation_steps", self.accumulation_steps, minimum=1)
        if self.prefetch_factor is not None:
            _require_int("prefetch_factor", self.prefetch_factor, minimum=1)
            if self.num_workers == 0:
                raise OptlabError("prefetch_factor needs num_workers > 0; leave it None with num_workers=0")
        if self.persistent_workers and self.num_workers == 0:
            raise OptlabError("persistent_workers=True needs num_workers > 0")
        if not (isinstance(self.width, (int, float)) and 0 < self.width <= 4):
            raise OptlabError(f"width must be a number in (0, 4], got {self.width!r}")

    @property
    def samples_per_step(self) -> int:
        """Samples in one micro-batch (images, token sequences, ...): the batch size plus any offset."""
        return self.batch_size + self.batch_offset

    def train_window(self, warmup: int, steps: int | None) -> tuple[int, int | None]:
        """The warm-up and timed micro-steps of a training pass, each rounded up to whole optimizer steps: with
        accumulation the timed window must start and end where the optimizer steps, or its mean step would count too
        many or too few optimizer updates (``steps=None``, a whole epoch, stays None)."""
        def whole(count: int) -> int:
            return -(-count // self.accumulation_steps) * self.accumulation_steps
        return whole(warmup), None if steps is None else whole(steps)

    @property
    def images_per_step(self) -> int:
        """:attr:`samples_per_step` under the name the image chapters and their records use."""
        return self.samples_per_step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


KNOB_NAMES = tuple(f.name for f in fields(RunConfig))
MODEL_KNOB_DEFAULTS = {"attention": "sdpa", "checkpointing": "none", "seq_len": None, "vocab_size": None}
TRAIN_ONLY_KNOBS = ("set_to_none", "accumulation_steps", "optimizer", "optimizer_impl", "checkpointing")
EVAL_ONLY_KNOBS = ("eval_grad_mode",)
PHASE_KNOBS = {"train": frozenset(KNOB_NAMES) - set(EVAL_ONLY_KNOBS), "test": frozenset(KNOB_NAMES) - set(TRAIN_ONLY_KNOBS)}


def _require_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum:,}"
        raise OptlabError(f"{name} must be an integer {bounds}, got {value!r}")


def changed_knobs(baseline: RunConfig, other: RunConfig) -> dict[str, tuple[Any, Any]]:
    """The knobs that differ, as ``{knob: (baseline value, other value)}``."""
    a, b = baseline.to_dict(), other.to_dict()
    return {k: (a[k], b[k]) for k in KNOB_NAMES if a[k] != b[k]}


def apply_changes(config: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """``replace`` with a clear error for a knob that does not exist."""
    unknown = sorted(set(changes) - set(KNOB_NAMES))
    if unknown:
        raise OptlabError(f"unknown knob(s) {unknown}; knobs are: {', '.join(KNOB_NAMES)}")
    return replace(config, **changes)
