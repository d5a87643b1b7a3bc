"""`+opt=ddp`: DistributedDataParallel. Every process holds the whole model and trains on its
share of the batch; gradients are averaged with all-reduces that start, bucket by bucket, while
backward is still running.

Any multi-process run without +opt=fsdp uses DDP, with the knobs of conf/opt/ddp.yaml (the one
source of its settings, not PyTorch's defaults); +opt=ddp lets the command line change them.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import torch._dynamo
from omegaconf import DictConfig, OmegaConf
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from base.distributed import Distributed, log
from base.errors import ConfigError
from base.knobs import positive
from opt.pp import data_parallel_roots
from opt.stage import Context, Stage

KNOBS = Path(__file__).resolve().parents[1] / "conf" / "opt" / "ddp.yaml"
# Gradient compression for the all-reduce: the bucket is cast down, reduced, cast back.
COMM_HOOKS = {
    "none": None,
    "bf16": default_hooks.bf16_compress_hook,
    "fp16": default_hooks.fp16_compress_hook,
}
_DDP_ARGS = inspect.signature(DistributedDataParallel).parameters


def default_knobs() -> DictConfig:
    """The knobs of conf/opt/ddp.yaml, for a multi-process run without +opt=ddp."""
    return OmegaConf.load(KNOBS).ddp


def apply_ddp(model: torch.nn.Module, cfg: DictConfig | None, dist: Distributed) -> torch.nn.Module:
    """Wraps `model` in DDP with the knobs `cfg` (None: conf/opt/ddp.yaml's); under +opt=tp
    or +opt=pp, replicates it (each pipeline stage) over the mesh's data-parallel dimension
    instead."""
    cfg = default_knobs() if cfg is None else cfg
    check_ddp(cfg)
    # tp: DTensor parameters, which DDP's reducer cannot take; pp: stages the schedule must find
    # replicated.
    if dist.parallel.mesh is not None:
        return _replicate_on_mesh(model, dist)
    # Read when compile first traces the model inside DDP's forward, i.e. after this.
    torch._dynamo.config.optimize_ddp = cfg.optimize_ddp
    ddp = DistributedDataParallel(
        model,
        device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        **_buffer_sync(cfg.broadcast_buffers),
        **_batched_grad_copy(cfg.batched_grad_copy),
    )
    if (hook := COMM_HOOKS[cfg.comm_hook]) is not None:
        ddp.register_comm_hook(None, hook)
    knobs = ", ".join(f"{k}={v}" for k, v in cfg.items())
    log(f"[opt] ddp: {dist.dp_size} processes, {knobs}")
    return ddp


def _replicate_on_mesh(model: torch.nn.Module, dist: Distributed) -> torch.nn.Module:
    """DDP's math over the mesh's data-parallel dimension, for +opt=tp's DTensor parameters
    and +opt=pp's stages: FSDP2's `replicate` (gradients all-reduced, no sharding), each
    pipeline stage a root (data_parallel_roots); DDP's knobs do not apply."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for root in data_parallel_roots(model, dist.parallel):
        replicate(root, mesh=dist.parallel.dp_mesh)
    shard = "pipeline stage" if dist.parallel.pp_enabled else "tp shard"
    log(f"[opt] ddp: {dist.dp_size} replicas of each {shard} (FSDP2 replicate)")
    return model


def check_ddp(cfg: DictConfig) -> None:
    """Refuses knobs that cannot work, before any work starts (opt.plan calls it)."""
    _batched_grad_copy(cfg.batched_grad_copy)


def _buffer_sync(broadcast: bool) -> dict[str, Any]:
    """Whether buffers are re-broadcast from rank 0 before every forward. torch 2.13 renamed
    the argument (`forward_sync_buffers`; the old name warns, and skips the sync at
    construction too, which for our constant buffer makes no difference;
    torch-workaround(<2.13): the old name only)."""
    name = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
    return {name: broadcast}


def _batched_grad_copy(enabled: bool) -> dict[str, Any]:
    """DDP's one-kernel-per-bucket gradient copy, new in torch 2.13."""
    if not enabled:
        return {}
    if "batched_grad_copy" not in _DDP_ARGS:
        raise ConfigError(
            f"opt.ddp.batched_grad_copy=true needs torch >= 2.13 (this is {torch.__version__}): "
            "set it to false or upgrade torch"
        )
    return {"batched_grad_copy": True}


@dataclass
class Knobs:
    bucket_cap_mb: Annotated[float, positive()] | None  # None: PyTorch's default
    gradient_as_bucket_view: bool
    batched_grad_copy: bool
    static_graph: bool
    broadcast_buffers: bool
    comm_hook: Literal["none", "bf16", "fp16"]
    # How a compiled model and DDP cooperate (torch._dynamo.config.optimize_ddp). Its third
    # mode, python_reducer, needs compiled autograd around the backward call: not offered here.
    optimize_ddp: Literal["ddp_optimizer", "no_optimization"]


def _apply(ctx: Context) -> torch.nn.Module | None:
    """Any run with several data-parallel replicas uses DDP, with +opt=ddp's knobs or
    conf/opt/ddp.yaml's (a tp group or a pipeline alone needs none; FSDP and offload spread it
    otherwise)."""
    if ctx.dist.dp_size < 2 or ctx.plan.parallel.fully_sharded:
        return None
    return apply_ddp(ctx.module, ctx.knobs, ctx.dist)


def _check(ctx: Context) -> None:
    check_ddp(ctx.knobs)
    if not ctx.dist.enabled:
        warnings.warn(
            "+opt=ddp has no effect in a single process: launch with torchrun to use it",
            stacklevel=2,
        )


STAGE = Stage(
    "ddp", "model", _apply, Knobs, check=_check,
    conflicts={"fsdp": "two ways to spread training"},
    unselected=_apply,  # several processes: DDP with conf/opt/ddp.yaml's knobs
)  # fmt: skip
