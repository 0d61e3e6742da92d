"""The memory-bandwidth bound of decoding: bytes read per step, the device's peak bandwidth, and MBU.

A decode step reads every weight once (whatever the batch) and each row's cached keys and values. At batch 1 nothing
else is large, so a step cannot take less than those bytes over the peak bandwidth: tokens/s <= peak / bytes per
token. Memory-bandwidth utilisation (MBU, gpt-fast's measure) is the bytes a step reads times steps per second, over
the peak. GPU peaks are NVIDIA's datasheet figures; a device missing from the table (every CPU) gets a measured
ceiling instead: the median rate of a large tensor copy (bytes read plus bytes written), labelled as measured.

MBU is a memory figure only where a step's bytes come from memory: when they fit in the device's last-level cache
(the tiny GPT on a CPU) a step reads them from the cache, and "bytes over the peak" measures nothing. ``mbu_reason``
says why no MBU is given there (and on a GPU without a datasheet peak).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ...core.errors import OptlabError
from ...core.gpt.transformer import GPT, GPTConfig

# (name fragments that must all appear in torch.cuda.get_device_name, table name, TB/s, GB of memory or None where
# the GPU has no MIG): datasheets' HBM bandwidth (H100 SXM and NVL: https://www.nvidia.com/en-us/data-center/h100/,
# "Specifications", GPU memory and GPU memory bandwidth)
DATASHEET_TBS: tuple[tuple[tuple[str, ...], str, float, "int | None"], ...] = (
    (("H200",), "NVIDIA H200", 4.8, 141),
    (("H100", "NVL"), "NVIDIA H100 NVL", 3.9, 94),
    (("H100", "PCIe"), "NVIDIA H100 PCIe", 2.0, 80),
    (("H100",), "NVIDIA H100 SXM", 3.35, 80),
    (("A100", "80GB", "PCIe"), "NVIDIA A100 80GB PCIe", 1.935, 80),
    (("A100", "80GB"), "NVIDIA A100 80GB SXM", 2.039, 80),
    (("A100",), "NVIDIA A100 40GB", 1.555, 40),
    (("V100",), "NVIDIA V100", 0.9, None),
)
MIG_PROFILE = re.compile(r"\bMIG\s+\d+g\.(\d+)gb\b", re.IGNORECASE)  # "... MIG 1g.10gb": the slice's memory, in GB
MEMORY_SLICES = 8  # a MIG GPU's memory comes in eighths, each with an eighth of the bandwidth
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
CPUS = Path("/sys/devices/system/cpu")
COPY_MIB = 256  # the measured copy: large enough to leave every CPU cache
MAX_COPY_MIB = 4096


@dataclass(frozen=True)
class Peak:
    """A peak memory bandwidth in bytes/s, and where it comes from (a datasheet, or a measured copy)."""

    bytes_per_s: float
    name: str
    source: str

    def label(self) -> str:
        return f"{self.bytes_per_s / 1e12:.3g} TB/s ({self.name}, {self.source})"


def datasheet_peak(device_name: str) -> Peak | None:
    """The datasheet bandwidth of the GPU named ``device_name``, None when the table does not know it. A MIG slice
    (``NVIDIA H100 80GB HBM3 MIG 1g.10gb``) gets the share of its memory slices, eighths of the GPU's memory: against
    the whole GPU's its MBU would read several times too low; a slice whose profile is not in its name gets None."""
    for fragments, name, tbs, memory_gb in DATASHEET_TBS:
        if all(fragment.lower() in device_name.lower() for fragment in fragments):
            if "MIG" not in device_name.upper().split():
                return Peak(tbs * 1e12, name, "datasheet")
            profile = MIG_PROFILE.search(device_name)
            if profile is None or memory_gb is None:
                return None
            eighths = min(MEMORY_SLICES, max(1, round(MEMORY_SLICES * int(profile[1]) / memory_gb)))
            return Peak(tbs * 1e12 * eighths / MEMORY_SLICES,
                        f"{name}, MIG {profile[0].split()[-1]}: {eighths}/{MEMORY_SLICES} of its memory", "datasheet")
    return None


def measured_copy_bandwidth(device: torch.device, mib: int = COPY_MIB) -> Peak:
    """The median rate of copying a ``mib`` MiB tensor into another on ``device``: bytes read plus bytes written
    per second, timed by ``torch.utils.benchmark`` (synchronized on a GPU)."""
    from torch.utils import benchmark  # imported here: it imports setuptools, a sixth of a second of every start

    if isinstance(mib, bool) or not isinstance(mib, int) or not 1 <= mib <= MAX_COPY_MIB:
        raise OptlabError(f"mib must be a whole number from 1 to {MAX_COPY_MIB}, got {mib!r}")
    source = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    timer = benchmark.Timer("target.copy_(source)", globals={"target": target, "source": source},
                            num_threads=torch.get_num_threads())
    seconds = timer.blocked_autorange(min_run_time=0.2).median
    return Peak(2 * source.numel() / seconds, f"a {mib} MiB copy on {device.type}", "measured")


@lru_cache(maxsize=None)
def peak_bandwidth(device: str) -> Peak:
    """The peak bandwidth of ``device`` ("cpu", "cuda", "cuda:1"): the datasheet's for a known GPU, else a measured
    copy (once per process)."""
    device = torch.device(device)
    if device.type == "cuda":
        known = datasheet_peak(torch.cuda.get_device_name(device))
        if known is not None:
            return known
    return measured_copy_bandwidth(device)


def weight_bytes(model: GPT) -> int:
    """Bytes of the weights a decode step reads: every distinct parameter (the tied head once), except the position
    table, of which a step reads one row per token."""
    skip = model.position_embedding.weight
    distinct = {id(p): p for p in model.parameters() if p is not skip}.values()
    return sum(p.numel() * p.element_size() for p in distinct)


def kv_bytes(config: GPTConfig, batch: int, positions: float, element_size: int) -> float:
    """Bytes of keys and values for ``batch`` rows of ``positions`` each (a mean may be fractional): 2 x layers x
    width x positions x batch x bytes (width = heads x head_dim). The one formula the book uses."""
    return 2 * config.n_layer * config.n_embd * positions * batch * element_size


def step_bytes(model: GPT, batch: int, attended: int) -> int:
    """Bytes one decode step reads: the weights once, and the keys and values of ``attended`` positions per row
    (a static cache attends to all of its ``max_len`` slots, masked or not)."""
    element_size = model.token_embedding.weight.element_size()
    return weight_bytes(model) + kv_bytes(model.config, batch, attended, element_size)


def _cache_size(text: str) -> int | None:
    """A sysfs cache size (``32768K``, ``1M``) in bytes, None where it is not one."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1:].upper() in units and text[:-1].isdigit() else None


def _cpu_cache_bytes(folder: Path) -> int | None:
    """The largest cache of the highest level listed under ``folder`` (sysfs), None where none is listed."""
    levels = []
    for index in sorted(folder.glob("index*")):
        try:
            level, size = int((index / "level").read_text()), _cache_size((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if size is not None:
            levels.append((level, size))
    return max(levels)[1] if levels else None


def all_last_level_caches_bytes(device: "str | torch.device", cpus: Path = CPUS) -> int | None:
    """Bytes of every last-level cache ``device`` has, summed: a GPU's L2; on a CPU each distinct cache of the highest
    level under ``cpus`` once (one per socket or chiplet: cpu0's alone would miss the others); None when the machine
    does not say."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size) or None
    if device.type != "cpu":
        return None
    caches: dict[tuple[int, str], int] = {}  # (level, the CPUs sharing it) -> bytes
    for index in cpus.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level, shared = int((index / "level").read_text()), (index / "shared_cpu_list").read_text().strip()
            size = _cache_size((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if size is not None:
            caches[(level, shared)] = size
    top = max((level for level, _ in caches), default=None)
    return sum(size for (level, _), size in caches.items() if level == top) if top is not None else None


def last_level_cache_bytes(device: "str | torch.device", folder: Path = CPU_CACHES) -> int | None:
    """Bytes of ``device``'s last-level cache: a GPU's L2, a CPU's highest cache level (from sysfs); None when the
    machine does not say."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size) or None
    return _cpu_cache_bytes(folder) if device.type == "cpu" else None


def mbu_reason(bytes_per_step: float, cache_bytes: "int | None", peak: Peak, cuda: bool) -> str | None:
    """None where MBU is a memory-bandwidth figure: a step's bytes exceed the last-level cache (``cache_bytes``)
    and, on a GPU, the peak is the datasheet's. Otherwise the reason no MBU is given."""
    if cache_bytes is None:
        return "no MBU: the device's last-level cache size is unknown, so a step's bytes may not come from memory"
    if bytes_per_step <= cache_bytes:
        return (f"no MBU: a step's {bytes_per_step / 1e6:.3g} MB fit in the {cache_bytes / 2**20:.3g} MiB last-level "
                "cache, so a step does not read them from memory")
    if cuda and peak.source != "datasheet":
        return "no MBU: no datasheet bandwidth is known for this GPU"
    return None


def bound_tokens_per_s(bytes_per_step: int, batch: int, peak: Peak) -> float:
    """The most tokens/s a decode that reads ``bytes_per_step`` per step of ``batch`` tokens can reach at ``peak``."""
    return batch * peak.bytes_per_s / bytes_per_step


def mbu(bytes_per_step: int, step_s: float, peak: Peak) -> float:
    """Memory-bandwidth utilisation: ``bytes_per_step`` per ``step_s`` seconds, as a fraction of ``peak``."""
    return bytes_per_step / step_s / peak.bytes_per_s
