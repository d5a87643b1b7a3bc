"""`+opt=ddp`: DistributedDataParallel. Every process holds the whole model and trains on its
share of the batch; gradients are averaged with all-reduces that start, bucket by bucket, while
backward is still running. A multi-process run without +opt=fsdp uses DDP with PyTorch's
defaults; this stage exposes its knobs."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel

from recipe.distributed import Distributed, log


def apply_ddp(model: torch.nn.Module, cfg: DictConfig | dict, dist: Distributed) -> torch.nn.Module:
    kwargs = dict(cfg)
    ddp = DistributedDataParallel(
        model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None, **kwargs
    )
    log(f"[opt] ddp: {dist.world_size} processes{', ' + str(kwargs) if kwargs else ''}")
    return ddp
