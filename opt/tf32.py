"""`+opt=tf32`: float32 matmuls and convolutions on TF32 tensor cores (Ampere and newer): a
10-bit mantissa for the products, float32 range and accumulation."""

from __future__ import annotations

import torch

from base.distributed import log
from opt.stage import Stage


def apply_tf32(enabled: bool, device: torch.device) -> None:
    """Sets the process-wide precision either way, so a previous run in the same process (a test,
    a notebook) cannot leak its choice into this one."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    if enabled and device.type == "cuda":
        log("[opt] tf32: float32 matmuls on TF32 tensor cores")
    elif enabled:  # TF32 is a GPU's format: 'high' lets a CPU library choose a faster algorithm
        log(f"[opt] tf32: float32 matmul precision 'high' (no TF32 tensor cores: {device.type})")


STAGE = Stage(
    "tf32", "numerics", lambda ctx: apply_tf32(True, ctx.dist.device),
    unselected=lambda ctx: apply_tf32(False, ctx.dist.device),  # process-wide: reset a run's
)  # fmt: skip
