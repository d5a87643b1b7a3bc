"""`+opt=workers`: DataLoader worker processes. Reading, preprocessing and tokenizing samples
move out of the training process, which then only launches GPU work."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Annotated

from omegaconf import DictConfig

from base.distributed import log
from base.knobs import count
from data import LoaderOptions
from opt.stage import Context, Stage


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or a scheduler's share,
    not the machine's count), as the DataLoader itself counts them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def with_workers(options: LoaderOptions, cfg: DictConfig) -> LoaderOptions:
    """`num_workers` persistent workers, at most one per available CPU: more only take turns on
    the same cores (and the DataLoader warns about them each time it starts its workers)."""
    workers = min(cfg.num_workers, available_cpus())
    capped = (
        f" (opt.workers.num_workers={cfg.num_workers} capped to the {workers} CPUs this process "
        "may use)"
        if workers < cfg.num_workers
        else ""
    )
    log(f"[opt] workers: {workers} persistent{capped}, prefetch {cfg.prefetch_factor} batches each")
    return replace(options, num_workers=workers, prefetch_factor=cfg.prefetch_factor)


@dataclass
class Knobs:
    num_workers: Annotated[int, count(1)]
    prefetch_factor: Annotated[int, count(1)]


def _apply(ctx: Context) -> None:
    ctx.plan.loader = with_workers(ctx.plan.loader, ctx.knobs)


STAGE = Stage("workers", "input", _apply, Knobs)
