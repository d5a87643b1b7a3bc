"""`+opt=accum`: gradient accumulation. The step's batch is split into micro-batches whose
gradients add up before one optimizer step: the same effective batch, with the activation memory
of one micro-batch.

Under DDP the gradient all-reduce runs only on the last micro-step (`no_sync`): DDP holds full
gradients anyway, so skipping the others is free. Under FSDP skipping the reduce-scatter means
keeping full-size unsharded gradients between micro-steps, which undoes much of the sharding;
so by default FSDP reduce-scatters after every micro-step (`defer_fsdp_reduce` to change it)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Annotated

import torch
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel

from base.distributed import log
from base.errors import ConfigError
from base.knobs import count
from opt.stage import Context, Stage


def micro_steps(batch_size: int, cfg: DictConfig) -> int:
    """The number of micro-steps per optimizer step (when the gradients are reduced over the
    ranks: `Plan.defer_reduce`)."""
    if batch_size % cfg.steps:
        raise ConfigError(
            f"opt.accum.steps={cfg.steps} must divide the batch size {batch_size} "
            "(train.batch_size, or opt.bs.batch_size with +opt=bs)"
        )
    under_fsdp = "the last one" if cfg.defer_fsdp_reduce else "each one"
    log(
        f"[opt] accum: {cfg.steps} micro-batches of {batch_size // cfg.steps} per step, gradients "
        f"reduced after the last one (when distributed; under FSDP after {under_fsdp})"
    )
    return cfg.steps


def gradient_sync(model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skips the gradient all-reduce of a non-final micro-step (DDP's `no_sync`, FSDP2's
    `set_requires_gradient_sync`); a no-op for a single process."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


@dataclass
class Knobs:
    steps: Annotated[int, count(1)]  # micro-batches per optimizer step
    defer_fsdp_reduce: bool


def _apply(ctx: Context) -> None:
    p = ctx.plan
    p.micro_steps = micro_steps(p.batch_size, ctx.knobs)
    p.defer_fsdp_reduce = ctx.knobs.defer_fsdp_reduce


STAGE = Stage("accum", "batch", _apply, Knobs)
