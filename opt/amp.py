"""`+opt=amp`: automatic mixed precision. Matmuls run in float16 or bfloat16 while weights,
reductions and the loss stay in float32. float16's narrow range needs a GradScaler: the loss is
multiplied up before backward, gradients are unscaled before clipping, and a step whose
gradients overflowed is skipped (the scale then shrinks).

`dtype: auto` (the default) picks bfloat16 where the device computes in it (a CPU; a CUDA GPU of
compute capability 8.0 or newer: Ampere, Hopper), as nanoGPT does, and float16 elsewhere: on a
CPU float16 gains no speed over float32, and bfloat16 needs no scaler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from omegaconf import DictConfig

from base.distributed import log
from base.errors import ConfigError
from opt.stage import Context, Stage
from recipe.precision import AUTOCAST_DTYPES as DTYPES  # the dtypes opt.amp.dtype chooses from
from recipe.precision import warn_if_float16_on_cpu

AUTO = "auto"  # opt.amp.dtype: bfloat16 where the device supports it, else float16


@dataclass(frozen=True)
class Precision:
    """What +opt=amp decides.

    `residual_dtype`: the residual stream's (None: float32, as the weights; `residual=compute`:
    the compute dtype, which halves the bytes that LayerNorms, residual adds and their gradients
    move, at the cost of rounding the running sum of the blocks' outputs)."""

    dtype: torch.dtype  # the compute dtype
    scale_loss: bool  # float16: a GradScaler
    residual_dtype: torch.dtype | None
    weight_cache: bool  # autocast caches its weight casts


def precision(cfg: DictConfig, device: torch.device) -> Precision:
    """The precision `cfg` (opt.amp) asks for on `device`.

    The cache keeps each weight's low-precision copy until the autocast region ends, so a weight
    used twice is cast once. Every weight here is used once per forward, and without activation
    checkpointing the matmuls save those copies for backward anyway; with checkpointing they
    save nothing, and the cache alone keeps a copy of every weight (2 bytes per parameter in
    bfloat16) alive to the end of the forward: `weight_cache=false` frees each after its use."""
    name = resolve_dtype(cfg.dtype, device)
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"+opt=amp with dtype=bfloat16, but {torch.cuda.get_device_name(device)} has no "
            "bfloat16 support: use opt.amp.dtype=float16"
        )
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        raise ConfigError(f"+opt=amp: autocast is not available on device type {device.type!r}")
    warn_if_float16_on_cpu(dtype, device, "opt.amp.dtype")
    scaled = dtype == torch.float16
    residual = dtype if cfg.residual == "compute" else None
    log(
        f"[opt] amp: {name} mixed precision{' (auto)' if cfg.dtype == AUTO else ''}"
        f"{', with a GradScaler' if scaled else ''}"
        f"{f', residual stream in {name}' if residual else ''}"
        f"{'' if cfg.weight_cache else ', no weight cache'}"
    )
    return Precision(dtype, scaled, residual, cfg.weight_cache)


def resolve_dtype(choice: str, device: torch.device) -> str:
    """The amp dtype's name for `opt.amp.dtype=choice`: `auto` becomes bfloat16 on a CPU and on a
    GPU that computes in it (compute capability >= 8.0; not counting the emulation that
    `is_bf16_supported()` accepts by default on older GPUs), float16 elsewhere; float16 and
    bfloat16 stay what was asked."""
    if choice == AUTO:
        native = device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)
        return "bfloat16" if native else "float16"
    return choice


@dataclass
class Knobs:
    dtype: Literal["auto", "float16", "bfloat16"]
    residual: Literal["float32", "compute"]
    weight_cache: bool


def _apply(ctx: Context) -> None:
    chosen = precision(ctx.knobs, ctx.dist.device)
    p = ctx.plan
    p.amp_dtype, p.scale_loss = chosen.dtype, chosen.scale_loss
    p.residual_dtype, p.amp_weight_cache = chosen.residual_dtype, chosen.weight_cache


def _prepare_model(ctx: Context) -> None:
    """The residual stream's dtype as planned (opt.amp.residual=compute; float32 under
    opt.lowbit.weights=bfloat16), before any stage wraps the model."""
    ctx.model.residual_dtype = ctx.plan.residual_dtype


STAGE = Stage("amp", "numerics", _apply, Knobs, prepare_model=_prepare_model)
