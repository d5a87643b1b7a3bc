"""What the GPU can do: its dense peak in the run's matmul format, MFU's denominator, and the
measured ceiling of a large bfloat16 matmul beside it; and how much of its memory this process
may use (`perf.memory_cap_gib`)."""

from __future__ import annotations

import re
import time

import torch

from base.distributed import log
from base.errors import ConfigError

GiB = 2**30

# The matmul formats of a run: bf16 and fp16 on tensor cores (with float32 accumulation), tf32 on
# tensor cores (float32 weights, +opt=tf32), fp32 on the CUDA cores.
FORMATS = ("bf16", "fp16", "tf32", "fp32")
# Dense TFLOP/s per format: the datasheets print the 2:4-sparse figure (twice these) with an
# asterisk, and a sparse peak read as dense halves MFU. None: no tensor cores for that format.
# Matched as whole words of torch.cuda.get_device_name(), in this order: the more specific first
# ("H100 PCIe" before "H100"; "L4" does not match "L40S", nor "A10" "A100" or "A10G").
PEAKS: tuple[tuple[str, float | None, float | None, float | None, float], ...] = (
    # name           bf16    fp16    tf32    fp32  source
    ("B200",         2250.0, 2250.0, 1125.0, 75.0),  # NVIDIA HGX B200 datasheet, per GPU
    ("GH200",        989.4,  989.4,  494.7,  67.0),  # NVIDIA GH200 Grace Hopper datasheet
    ("H200 NVL",     835.5,  835.5,  417.5,  60.0),  # NVIDIA H200 datasheet, H200 NVL
    ("H200",         989.4,  989.4,  494.7,  67.0),  # NVIDIA H200 datasheet, H200 SXM
    ("H100 NVL",     835.5,  835.5,  417.5,  60.0),  # NVIDIA H100 datasheet, H100 NVL
    ("H100 PCIe",    756.5,  756.5,  378.0,  51.2),  # NVIDIA H100 datasheet, H100 PCIe
    ("H100",         989.4,  989.4,  494.7,  66.9),  # NVIDIA H100 datasheet, H100 SXM
    ("A100",         312.0,  312.0,  156.0,  19.5),  # NVIDIA A100 datasheet, SXM and PCIe alike
    ("A10G",         125.0,  125.0,  62.5,   31.2),  # AWS's; no datasheet: the A10's
    ("A10",          125.0,  125.0,  62.5,   31.2),  # NVIDIA A10 datasheet
    ("L40S",         362.1,  362.1,  183.0,  91.6),  # NVIDIA L40S datasheet
    ("L40",          181.0,  181.0,  90.5,   90.5),  # NVIDIA L40 datasheet
    ("L4",           121.0,  121.0,  60.0,   30.3),  # NVIDIA L4 datasheet
    ("RTX 6000 Ada", 364.2,  364.2,  182.1,  91.1),  # NVIDIA Ada architecture whitepaper
    ("RTX A6000",    154.8,  154.8,  77.4,   38.7),  # NVIDIA Ampere GA102 whitepaper
    ("RTX 4090",     165.2,  165.2,  82.6,   82.6),  # NVIDIA Ada architecture whitepaper
    ("RTX 3090",     71.0,   71.0,   35.6,   35.6),  # NVIDIA Ampere GA102 whitepaper
    ("V100-PCIE",    None,   112.0,  None,   14.0),  # NVIDIA V100 datasheet, PCIe
    ("V100",         None,   125.0,  None,   15.7),  # NVIDIA V100 datasheet, SXM2
    ("T4",           None,   65.0,   None,   8.1),   # NVIDIA T4 datasheet
    ("MI300X",       1307.4, 1307.4, 653.7,  163.4),  # AMD Instinct MI300X datasheet
)  # fmt: skip


def matmul_format(dtype: torch.dtype | None) -> str:
    """The format of the run's matmuls: its compute dtype (amp's, or the stored weights' of
    opt.lowbit), else float32's, on TF32 tensor cores when the float32 matmul precision allows
    them (+opt=tf32 sets it), on the CUDA cores otherwise."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def table_peak(name: str, fmt: str) -> float | None:
    """The table's dense TFLOP/s of the GPU named `name` in format `fmt`; None if not listed."""
    for key, *peaks in PEAKS:
        if re.search(rf"\b{re.escape(key)}\b", name):
            return peaks[FORMATS.index(fmt)]
    return None


def peak_flops(
    device: torch.device, override_tflops: float | None = None, dtype: torch.dtype | None = None
) -> float | None:
    """MFU's denominator, FLOP/s: `perf.peak_tflops` if set, else the table's dense peak of this
    GPU in the format of matmuls in `dtype` (the run's compute dtype; None: float32). None on a
    CPU, and for a GPU or format not in the table, with a one-line hint: MFU is then n/a, never
    measured against another GPU's peak."""
    if override_tflops:
        log(f"[perf] MFU against {override_tflops} TFLOP/s (perf.peak_tflops)")
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name, fmt = torch.cuda.get_device_name(device), matmul_format(dtype)
    tflops = table_peak(name, fmt)
    if tflops is None:
        log(
            f"[perf] MFU n/a: no {fmt} peak for {name} in recipe/hardware.py; set "
            f"perf.peak_tflops to its dense (not 2:4-sparse) {fmt} TFLOP/s"
        )
        return None
    log(f"[perf] MFU against {tflops} TFLOP/s, the dense {fmt} peak of {name} (recipe/hardware.py)")
    return tflops * 1e12


def matmul_tflops(
    device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16
) -> float:
    """The TFLOP/s of (n x n) @ (n x n) matmuls in `dtype` on `device`: the mean of 20 back to back
    after 5 to warm up (cuBLAS's choice of kernel, the clocks)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for repeats in (5, 20):
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    return 2 * n**3 * repeats / seconds / 1e12


def matmul_ceiling(device: torch.device) -> dict[str, float | None]:
    """`perf/matmul_ceiling_tflops` (perf.matmul_ceiling): what a large bfloat16 matmul reaches on
    this GPU (under a second of work), a more honest 100% than the datasheet's peak for a run's
    smaller matmuls. A ceiling above the table's bf16 peak means the table is wrong for this GPU:
    said in one line. Nothing on a CPU."""
    if device.type != "cuda":
        log(f"[perf] matmul_ceiling: recorded, no effect on a {device.type} run")
        return {}
    ceiling, name = matmul_tflops(device), torch.cuda.get_device_name(device)
    peak = table_peak(name, "bf16")
    log(f"[perf] matmul ceiling {ceiling:.0f} TFLOP/s (bf16, {name}; table peak {peak})")
    if peak is not None and ceiling > peak:
        log(
            f"[warning] the measured bf16 matmul ceiling {ceiling:.0f} TFLOP/s exceeds the table's "
            f"peak {peak} for {name}: fix recipe/hardware.py's row, or set perf.peak_tflops"
        )
    return {"perf/matmul_ceiling_tflops": ceiling}


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
