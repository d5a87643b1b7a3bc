"""`+opt=tf32`: float32 matmuls and convolutions on TF32 tensor cores (Ampere and newer): a
10-bit mantissa for the products, float32 range and accumulation."""

from __future__ import annotations

import torch

from opt.stage import Stage
from recipe.distributed import log


def apply_tf32(enabled: bool) -> None:
    """Sets the process-wide precision either way, so a previous run in the same process (a test,
    a notebook) cannot leak its choice into this one."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    if enabled:
        log("[opt] tf32: float32 matmuls on TF32 tensor cores")


STAGE = Stage(
    "tf32", "numerics", lambda ctx: apply_tf32(True),
    unselected=lambda ctx: apply_tf32(False),  # process-wide: reset what an earlier run set
)  # fmt: skip
