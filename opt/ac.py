"""`+opt=ac`: activation checkpointing. A checkpointed region keeps only its input for backward
and recomputes its activations when backward reaches it: roughly one more forward pass of
compute for most of the activation memory.

- full: every transformer block.
- selective: every `every`-th block, and within it the whole block or only its `attn` or `mlp`
  sub-layer, trading less recomputation for less memory saved.
- op: every block, with an op-level policy (`create_selective_checkpoint_contexts`): the outputs
  of the matmuls (mm, addmm, bmm, float8's _scaled_mm) and of attention (SDPA) are kept, the
  cheap elementwise ops (LayerNorm, GELU, residual adds, dropout, casts) are recomputed.
  Backward then redoes no matmul: less recomputation than `full`, much more memory kept (the
  matmul outputs of every block, e.g. 20 bytes per token per block and unit of width in
  bfloat16), still less than none.

The region's `forward` is replaced in place, so parameter names (and checkpoints) are unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from omegaconf import DictConfig
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from base.distributed import log
from base.errors import ConfigError
from base.knobs import count
from model import GPT
from opt.stage import Stage

Mode = Literal["full", "selective", "op"]
Target = Literal["block", "attn", "mlp"]

aten = torch.ops.aten
# mode=op keeps the outputs of these ops for backward and recomputes every other op of the block.
# Each attention backend has its own op: flash, memory-efficient and cuDNN on CUDA, flash on CPU.
SAVED_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_mm.default,  # +opt=float8's matmuls
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


def save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """mode=op's policy: keep what is expensive to recompute, recompute what is cheap."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def check_ac(cfg: DictConfig) -> None:
    """Refuses knobs that cannot work, before any work starts (opt.plan calls it)."""
    if cfg.mode == "op" and cfg.use_reentrant:
        raise ConfigError(
            "opt.ac.mode=op needs opt.ac.use_reentrant=false: the reentrant checkpoint takes "
            "no op-level policy"
        )


def apply_ac(model: GPT, cfg: DictConfig) -> list[str]:
    """Checkpoints the chosen regions; returns their names."""
    check_ac(cfg)
    options = {"use_reentrant": cfg.use_reentrant}
    if cfg.mode == "op":
        options["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, save_matmuls
        )
    every, target = (cfg.every, cfg.target) if cfg.mode == "selective" else (1, "block")
    wrapped = []
    for i, block in enumerate(model.transformer.h):  # type: ignore[arg-type]  # a ModuleList
        if i % every:
            continue
        region = block if target == "block" else getattr(block, target)
        region.forward = functools.partial(checkpoint, region.forward, **options)
        wrapped.append(f"transformer.h.{i}" + ("" if target == "block" else f".{target}"))
    # For HFU: what backward runs again; mode=op keeps every matmul's output.
    model.mark_recomputed([] if cfg.mode == "op" else wrapped, cfg.use_reentrant)
    blocks = len(model.transformer.h)  # type: ignore[arg-type]  # a ModuleList
    log(f"[opt] ac: {cfg.mode}, {len(wrapped)} of {blocks} blocks ({target})")
    return wrapped


@dataclass
class Knobs:
    mode: Mode
    every: Annotated[int, count(1)]  # selective: checkpoint every `every`-th block
    target: Target
    use_reentrant: bool


STAGE = Stage(
    "ac", "model", lambda ctx: apply_ac(ctx.model, ctx.knobs), Knobs,
    check=lambda ctx: check_ac(ctx.knobs),
)  # fmt: skip
