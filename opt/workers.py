"""`+opt=workers`: DataLoader worker processes. Reading, preprocessing and tokenizing samples
move out of the training process, which then only launches GPU work."""

from __future__ import annotations

from dataclasses import replace

from omegaconf import DictConfig

from data import LoaderOptions
from recipe.distributed import log


def apply_workers(options: LoaderOptions, cfg: DictConfig) -> LoaderOptions:
    if cfg.num_workers < 1:
        raise ValueError(f"opt.workers.num_workers must be >= 1, got {cfg.num_workers}")
    log(f"[opt] workers: {cfg.num_workers} persistent, prefetch {cfg.prefetch_factor} batches each")
    return replace(options, num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor)
