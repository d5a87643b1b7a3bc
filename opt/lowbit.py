"""`+opt=lowbit`: AdamW whose two moments are stored in 8 or 4 bits (torchao's `AdamW8bit` and
`AdamW4bit`), block-wise quantized with a float32 scale per block of 256 (8-bit) or 128 (4-bit)
values. Optimizer state falls from 8 bytes per parameter to about 2 (8-bit) or 1 (4-bit);
tensors under 4096 values (biases, LayerNorms) keep float32 moments.

It changes the math: every update dequantizes the moments, updates them in float32 and rounds
them back, so losses drift from AdamW's; the ladder rows report the loss next to the memory.

torchao's update is its own implementation (one `torch.compile`d function per parameter, one
graph per parameter shape: the first step compiles them), so it replaces +opt=forloop, foreach
or fused rather than combining with them. Its learning rate is a tensor, which the trainer
updates in place (recipe/schedule.py) so that a new rate does not recompile the update.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from recipe.distributed import log

BITS = (8, 4)


def apply_lowbit(cfg: DictConfig) -> type[torch.optim.Optimizer]:
    """The optimizer class for `cfg.bits`, built by the trainer like AdamW (same groups, learning
    rate, betas and weight decay)."""
    if cfg.bits not in BITS:
        raise ValueError(f"opt.lowbit.bits={cfg.bits!r}: choose 8 or 4")
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as e:
        raise ImportError(
            f"+opt=lowbit needs torchao (`pip install --no-deps torchao==0.18.0`): {e}"
        ) from e
    optimizer_class = AdamW8bit if cfg.bits == 8 else AdamW4bit
    log(f"[opt] lowbit: {optimizer_class.__name__}, AdamW's moments in {cfg.bits} bits (torchao)")
    return optimizer_class
