"""`+opt=bs`: a bigger batch per optimizer step (the book's "increase BatchSize"). Larger
matmuls keep the GPU busier and the fixed per-step costs (launches, optimizer, data) are spread
over more tokens."""

from __future__ import annotations

from omegaconf import DictConfig

from recipe.distributed import log
from recipe.errors import ConfigError


def apply_bs(cfg: DictConfig) -> int:
    """The new per-rank batch size (sequences per optimizer step)."""
    if cfg.batch_size < 1:
        raise ConfigError(f"opt.bs.batch_size must be >= 1, got {cfg.batch_size}")
    log(f"[opt] bs: {cfg.batch_size} sequences per step per rank")
    return cfg.batch_size
