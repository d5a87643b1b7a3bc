"""The learning rate: linear warmup, then cosine decay to `min_lr` at `max_steps`."""

from __future__ import annotations

import math

import torch


def learning_rate(
    step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int
) -> float:
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Sets every parameter group's learning rate: in place where it is a tensor (torchao's
    low-bit AdamW keeps it as one, so that a new rate does not recompile its update)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
