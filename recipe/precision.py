"""The precisions a model computes in, named as the settings name them, and the autocast that
runs a forward in one: the trainer's `+opt=amp` (opt/amp.py) and the after-training tools'
`dtype=` (tools/loading.py) read the same table and enter the same context."""

from __future__ import annotations

import contextlib

import torch

from base.distributed import log

AUTOCAST_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # what autocast runs in
DTYPES = {"float32": torch.float32, **AUTOCAST_DTYPES}  # float32: the weights' own, no autocast


def autocast(
    dtype: torch.dtype | None, device: torch.device, cache: bool = True
) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device` (the weights stay float32); nothing for None or float32.
    `cache`: autocast keeps each weight's cast until the region ends (opt.amp.weight_cache)."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def warn_if_float16_on_cpu(dtype: torch.dtype, device: torch.device, key: str) -> None:
    """One line when float16 would run on a CPU: it buys no speed there over float32 (how fast
    depends on the CPU and the oneDNN kernels torch has for it), and its narrow range needs a
    loss scaler that bfloat16 does not. `key` is the setting that chose float16."""
    if dtype == torch.float16 and device.type == "cpu":
        log(
            f"[warning] {key}=float16 on a CPU gains no speed over float32, and its narrow range "
            f"needs a loss scaler; use {key}=bfloat16"
        )
