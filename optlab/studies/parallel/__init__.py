"""Past data parallel: tensor, sequence and pipeline parallelism and their compositions on the book's GPT, run on
CPU processes joined by gloo and held against the formulas that plan them for GPUs.

``formulas`` holds the arithmetic (what a rank holds, what it sends, a pipeline's bubble), ``planner`` applies it to
large models and clusters; ``tensor`` splits the GPT with DTensor, ``collectives`` counts what DTensor and FSDP2
send, ``held`` what a rank keeps; ``tensor_study`` runs chapter 19's job; ``pipeline`` cuts the GPT into stages and
times each rank's chunks, ``pipeline_study`` runs chapter 20's job; ``compose_study`` chapter 21's (FSDP2 over TP on
a 2 x 2 mesh); ``ranks`` starts and joins the CPU processes, ``commands`` holds the rank commands torchrun starts.
Imports the core and the distributed study's launcher and state count.
"""
from .compose_study import ComposeStudy, compose_study, two_d
from .formulas import (
    activation_bytes, block_activation_bytes, block_parameters, bubble_fraction, fsdp_collectives, model_parameters,
    ring_bytes_sent, tensor_parallel_collectives,
)
from .pipeline import SCHEDULES, Stage, Timeline, replayed_idle, stage_modules
from .pipeline_study import BUBBLE_TOLERANCE, PipelineStudy, pipeline_study
from .planner import MODELS, Layout, fit_table, parallel_plan
from .tensor import block_plan, group_heads, tensor_parallel, ungroup_heads
from .tensor_study import CONFIG, PARITY_TOLERANCE, TensorStudy, tensor_study

__all__ = [
    "BUBBLE_TOLERANCE", "CONFIG", "ComposeStudy", "Layout", "MODELS", "PARITY_TOLERANCE", "PipelineStudy",
    "SCHEDULES", "Stage", "TensorStudy", "Timeline", "activation_bytes", "block_activation_bytes", "block_parameters",
    "block_plan", "bubble_fraction", "compose_study", "fit_table", "fsdp_collectives", "group_heads",
    "model_parameters", "parallel_plan", "pipeline_study", "replayed_idle", "ring_bytes_sent", "stage_modules",
    "tensor_parallel", "tensor_parallel_collectives", "tensor_study", "two_d", "ungroup_heads",
]
