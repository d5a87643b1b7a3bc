"""What the GPU can do: its dense bf16/fp16 tensor-core peak, for model FLOPs utilisation; and
how much of its memory this process may use (`perf.memory_cap_gib`)."""

from __future__ import annotations

import torch

from recipe.distributed import log
from recipe.errors import ConfigError

GiB = 2**30

# Dense (no 2:4 sparsity) bf16/fp16 tensor-core peaks from the vendors' datasheets, TFLOP/s.
# Matched as substrings of torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS = (
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("RTX 4090", 165.2),
    ("V100", 125.0),
)


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """The device's peak in FLOP/s: the override if given, else the table; None on a CPU or an
    unlisted GPU (MFU is then not reported; set perf.peak_tflops)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def cap_memory(device: torch.device, cap_gib: float | None) -> None:
    """Lets this process allocate at most `cap_gib` GiB of the GPU, as a card of that size would
    (the caching allocator raises OutOfMemoryError above it): memory results for smaller cards,
    measured on a big one. Called before anything is allocated. A CPU has no such cap: the
    setting is recorded with the run and does nothing."""
    if cap_gib is None:
        return
    if device.type != "cuda":
        log(f"[perf] memory_cap_gib={cap_gib}: recorded, no effect on a {device.type} run")
        return
    total = torch.cuda.get_device_properties(device).total_memory / GiB
    if cap_gib > total:
        raise ConfigError(
            f"perf.memory_cap_gib={cap_gib} exceeds this GPU's {total:.1f} GiB: lower it, or set "
            "it to null to use the whole GPU"
        )
    torch.cuda.set_per_process_memory_fraction(cap_gib / total, device)
    log(f"[perf] memory capped at {cap_gib} GiB of the GPU's {total:.1f}")
