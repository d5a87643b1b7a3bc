"""`+opt=ac`: activation checkpointing. A checkpointed region keeps only its input for backward
and recomputes its activations when backward reaches it: roughly one more forward pass of
compute for most of the activation memory.

- full: every transformer block.
- selective: every `every`-th block, and within it the whole block or only its `attn` or `mlp`
  sub-layer, trading less recomputation for less memory saved.

The region's `forward` is replaced in place, so parameter names (and checkpoints) are unchanged.
"""

from __future__ import annotations

import functools

import torch
from omegaconf import DictConfig
from torch.utils.checkpoint import checkpoint

from recipe.distributed import log

MODES = ("full", "selective")
TARGETS = ("block", "attn", "mlp")


def apply_ac(model: torch.nn.Module, cfg: DictConfig) -> list[str]:
    """Checkpoints the chosen regions; returns their names."""
    if cfg.mode not in MODES:
        raise ValueError(f"opt.ac.mode={cfg.mode!r}: choose one of {', '.join(MODES)}")
    every, target = (1, "block") if cfg.mode == "full" else (cfg.every, cfg.target)
    if target not in TARGETS or every < 1:
        raise ValueError(
            f"opt.ac: target={target!r} must be one of {', '.join(TARGETS)} and every={every} >= 1"
        )
    wrapped = []
    for i, block in enumerate(model.transformer.h):
        if i % every:
            continue
        region = block if target == "block" else getattr(block, target)
        region.forward = functools.partial(
            checkpoint, region.forward, use_reentrant=cfg.use_reentrant
        )
        wrapped.append(f"transformer.h.{i}" + ("" if target == "block" else f".{target}"))
    log(f"[opt] ac: {cfg.mode}, {len(wrapped)} of {len(model.transformer.h)} blocks ({target})")
    return wrapped
