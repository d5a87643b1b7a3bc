"""`+opt=fsdp`: fully sharded data parallelism (FSDP2, `fully_shard`). Parameters, gradients and
optimizer state are split over the processes, each holding about 1/W of them; a block's full
parameters are all-gathered just before it runs and freed after, gradients are reduce-scattered.

Each transformer block is its own unit (so only one block is unsharded at a time), or each run of
`blocks_per_unit` consecutive blocks (fewer, larger all-gathers and reduce-scatters, and one
set of FSDP hooks per unit: FSDP2 on GPT-2 124M was host-bound, its per-block hooks and
compiled calls taking twice the GPU's step, traced), then the root takes the embeddings and the
head; under +opt=pp each pipeline stage is a root, sharded over the data-parallel dimension of
the mesh (several pipelines). The last unit keeps its parameters gathered after forward even
with `reshard_after_forward`: backward starts with it, so freeing them would only gather them
again at once.

With +opt=amp, `mixed_precision` chooses the math:
- autocast (default): float32 parameters are all-gathered and autocast runs the matmuls in the
  amp dtype, exactly as +opt=amp does alone or under DDP (norms, softmax, the residual stream
  and the loss stay in float32), so FSDP and DDP rows of a ladder compare the same math.
- pure: FSDP's MixedPrecisionPolicy all-gathers the parameters cast to the amp dtype and the
  whole forward runs in it (no autocast): half the all-gather bytes and activations, but
  LayerNorm, the residual stream and the embeddings in low precision too.
Gradients are reduced in float32 either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from omegaconf import DictConfig
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from base.distributed import Distributed, hsdp_shards, log
from base.knobs import count
from opt.pp import data_parallel_roots
from opt.stage import Context, Stage

MixedPrecision = Literal["autocast", "pure"]


def pure_low_precision(cfg: DictConfig | Knobs) -> bool:
    """Whether FSDP casts the parameters itself (`mixed_precision=pure`), so that autocast is
    off; with `autocast`, +opt=amp's autocast runs as without FSDP."""
    return cfg.mixed_precision == "pure"


def apply_fsdp(
    model: torch.nn.Module,
    cfg: DictConfig | Knobs,
    dist: Distributed,
    amp_dtype: torch.dtype | None,
    roots: list[torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """Shards `model`'s blocks, then each of `roots` (the model, or +opt=pp's stages)."""
    kwargs: dict[str, Any] = {}
    pure = pure_low_precision(cfg) and amp_dtype is not None
    if pure:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=amp_dtype, reduce_dtype=torch.float32
        )
    if cfg.cpu_offload:  # pinned host memory speeds up copies to a GPU (pinning needs one)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dist.device.type == "cuda")
    if dist.parallel.mesh is not None:  # +opt=tp, +opt=pp, HSDP: the mesh's data-parallel dims
        kwargs["mesh"] = dist.parallel.shard_mesh
    units = _units(list(model.transformer.h.children()), cfg.blocks_per_unit)
    for i, unit in enumerate(units):  # under pp, this rank's blocks (a ModuleDict)
        last = i == len(units) - 1
        reshard = cfg.reshard_after_forward and not last
        fully_shard(unit[0] if len(unit) == 1 else unit, reshard_after_forward=reshard, **kwargs)
    # The root's parameters (embeddings, final norm) are needed again at once by the tied head.
    for root in roots or [model]:
        fully_shard(root, reshard_after_forward=False, **kwargs)
    precision = "float32" if amp_dtype is None else f"{amp_dtype} ({cfg.mixed_precision})"
    mesh = kwargs.get("mesh")  # as FSDP got it: HSDP's is (replicas, shards)
    hsdp = mesh is not None and mesh.ndim == 2
    layout = f"{mesh.size(0)} replicas x {mesh.size(1)}" if hsdp else f"{dist.dp_size}"
    log(
        f"[opt] fsdp: {layout} shards, {len(units)} units of up to {cfg.blocks_per_unit} "
        f"block(s), reshard_after_forward={cfg.reshard_after_forward} (not the last unit)"
        f", cpu_offload={cfg.cpu_offload}, compute in {precision}"
    )
    return model


def _units(blocks: list[torch.nn.Module], size: int) -> list[list[torch.nn.Module]]:
    """`blocks` in runs of `size` consecutive ones (the last run may be shorter)."""
    return [blocks[i : i + size] for i in range(0, len(blocks), size)]


@dataclass
class Knobs:
    reshard_after_forward: bool
    blocks_per_unit: Annotated[int, count(1)]  # consecutive blocks gathered as one unit
    cpu_offload: bool
    mixed_precision: MixedPrecision
    replicas: Annotated[int, count(1)]  # HSDP: replicas of the model, each sharded (1: FSDP)


def _plan(ctx: Context) -> None:
    """The precision FSDP casts to, and HSDP's replicas (checked against the processes the
    model-splitting stages, planned before, leave to data parallelism)."""
    p = ctx.plan
    p.parallel.fully_sharded = True
    p.pure_low_precision = p.amp_dtype is not None and pure_low_precision(ctx.knobs)
    hsdp_shards(p.parallel.dp_size, ctx.knobs.replicas)
    p.parallel.dp_replicate = ctx.knobs.replicas


def _apply(ctx: Context) -> torch.nn.Module:
    """Shards the model, or under +opt=pp each stage of the pipeline (which it returns)."""
    roots = data_parallel_roots(ctx.module, ctx.plan.parallel)
    apply_fsdp(ctx.model, ctx.knobs, ctx.dist, ctx.plan.amp_dtype, roots)
    return ctx.module


STAGE = Stage(
    "fsdp", "model", _apply, Knobs, plan=_plan,
    processes=("several", "launch with `torchrun --nproc_per_node=N train.py ...` (N >= 2)"),
)  # fmt: skip
