"""`+opt=bs`: a bigger batch per optimizer step (the book's "increase BatchSize"). Larger
matmuls keep the GPU busier and the fixed per-step costs (launches, optimizer, data) are spread
over more tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from omegaconf import DictConfig

from base.distributed import log
from base.knobs import count
from opt.stage import Context, Stage


def batch_size(cfg: DictConfig) -> int:
    """The new per-rank batch size (sequences per optimizer step)."""
    log(f"[opt] bs: {cfg.batch_size} sequences per step per rank")
    return cfg.batch_size


@dataclass
class Knobs:
    batch_size: Annotated[int, count(1)]  # sequences per optimizer step per rank


def _apply(ctx: Context) -> None:
    ctx.plan.batch_size = batch_size(ctx.knobs)


STAGE = Stage("bs", "batch", _apply, Knobs)
