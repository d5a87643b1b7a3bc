"""`+opt=non_blocking`: batches in pinned (page-locked) host memory, copied with
`.to(device, non_blocking=True)` one step ahead on a side stream. A copy from pageable memory
makes the CPU wait for the GPU's queue to drain; from pinned memory the CPU only queues it."""

from __future__ import annotations

from dataclasses import replace

import torch

from base.distributed import log
from data import LoaderOptions
from opt.stage import Context, Stage


def with_pinned_batches(options: LoaderOptions, device: torch.device) -> LoaderOptions:
    pin = device.type == "cuda"  # page-locking helps only transfers to an accelerator
    log(f"[opt] non_blocking: pinned batches {'on' if pin else 'off (CPU run)'}, async copies")
    return replace(options, pin_memory=pin, non_blocking=True)


def _apply(ctx: Context) -> None:
    ctx.plan.loader = with_pinned_batches(ctx.plan.loader, ctx.dist.device)


STAGE = Stage("non_blocking", "input", _apply)
