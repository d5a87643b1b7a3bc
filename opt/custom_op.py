"""`+opt=custom_op`: the book's "use a custom operator" stage. The vocabulary head and the loss
(final-norm output -> logits -> float32 cross-entropy) become one fused operator,
`gpt2_recipe::linear_cross_entropy` (kernels/linear_cross_entropy.py): chunked over tokens, a
Triton kernel per logits chunk for the log-sum-exp, the loss and the gradient, and the head's
gradients computed in the same pass. No (tokens x vocab) float32 logits exist, and the bfloat16
ones only one chunk at a time.

Only the loss path changes: logits without targets (sampling) still come from the plain head.
It is a model stage applied before `ac` and `compile`: compile then traces the operator as one
node (registered with torch.library, it breaks no graph).
"""

from __future__ import annotations

import functools

from omegaconf import DictConfig

from kernels import linear_cross_entropy
from model import GPT
from recipe.distributed import log
from recipe.errors import ConfigError

WARPS = (1, 2, 4, 8, 16, 32)


def check_custom_op(cfg: DictConfig) -> None:
    """Refuses knobs that cannot work, before any work starts (opt.plan calls it)."""
    if cfg.chunk_size < 0:
        raise ConfigError(
            f"opt.custom_op.chunk_size={cfg.chunk_size}: tokens per chunk, >= 1 (0: all at once)"
        )
    if cfg.block < 16 or cfg.block & (cfg.block - 1):
        raise ConfigError(f"opt.custom_op.block={cfg.block}: a power of two >= 16")
    if cfg.num_warps not in WARPS:
        raise ConfigError(f"opt.custom_op.num_warps={cfg.num_warps}: one of {WARPS}")


def apply_custom_op(model: GPT, cfg: DictConfig) -> None:
    """Routes the model's loss through the fused operator, with the knobs of `cfg`."""
    check_custom_op(cfg)
    model.fused_loss = functools.partial(
        linear_cross_entropy,
        vocab_size=model.config.vocab_size,
        chunk_size=cfg.chunk_size,
        block=cfg.block,
        num_warps=cfg.num_warps,
        float8=cfg.float8,
    )
    chunk = "all tokens" if cfg.chunk_size == 0 else f"{cfg.chunk_size} tokens"
    log(
        f"[opt] custom_op: fused head + cross-entropy, chunks of {chunk}, "
        f"kernel block={cfg.block}, num_warps={cfg.num_warps}"
        + (", float8 matmuls" if cfg.float8 else "")
    )
