"""`+opt=fsdp`: fully sharded data parallelism (FSDP2, `fully_shard`). Parameters, gradients and
optimizer state are split over the processes, each holding about 1/W of them; a block's full
parameters are all-gathered just before it runs and freed after, gradients are reduce-scattered.

Each transformer block is its own unit (so only one block is unsharded at a time), then the root
takes the embeddings and the head. With +opt=amp the parameters are cast for compute by FSDP's
MixedPrecisionPolicy (gradients reduced in float32) instead of autocast.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from recipe.distributed import Distributed, log


def apply_fsdp(
    model: torch.nn.Module, cfg: DictConfig, dist: Distributed, amp_dtype: torch.dtype | None
) -> torch.nn.Module:
    kwargs = {}
    if amp_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=amp_dtype, reduce_dtype=torch.float32
        )
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    # The root's parameters (embeddings, final norm) are needed again at once by the tied head.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    log(
        f"[opt] fsdp: {dist.world_size} shards, reshard_after_forward={cfg.reshard_after_forward}"
        f", cpu_offload={cfg.cpu_offload}, mixed precision={amp_dtype}"
    )
    return model
