"""`+opt=custom_op`: the book's "use a custom operator" stage. The vocabulary head and the loss
(final-norm output -> logits -> float32 cross-entropy) become one fused operator,
`gpt2_recipe::linear_cross_entropy` (kernels/linear_cross_entropy.py): chunked over tokens, a
Triton kernel per logits chunk for the log-sum-exp, the loss and the gradient, and the head's
gradients computed in the same pass. No (tokens x vocab) float32 logits exist, and the bfloat16
ones only one chunk at a time.

Only the loss path changes: logits without targets (sampling) still come from the plain head.
It is a model stage applied before `ac` and `compile`: compile then traces the operator as one
node (registered with torch.library, it breaks no graph).

`backend` picks whose fused head + loss it is: `ours` (the operator above), or one a user would
otherwise pick, `liger` (liger-kernel) or `cce` (Apple's cut-cross-entropy), called through
kernels/library_heads.py and measured beside ours by scripts/bench_head.py. The other knobs are
our operator's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated, Literal

from omegaconf import DictConfig

from base.distributed import log
from base.errors import ConfigError
from base.knobs import count
from kernels import linear_cross_entropy
from kernels.library_heads import LIBRARIES, LOSSES, missing
from model import GPT
from opt.stage import Stage


def check_custom_op(cfg: DictConfig) -> None:
    """Refuses knobs that cannot work, before any work starts (opt.plan calls it)."""
    if cfg.block < 16 or cfg.block & (cfg.block - 1):
        raise ConfigError(f"opt.custom_op.block={cfg.block}: a power of two >= 16")
    if cfg.backend != "ours":
        if cfg.float8:
            raise ConfigError(
                f"opt.custom_op.float8=true is our kernel's, not {cfg.backend}'s: drop it or "
                "set opt.custom_op.backend=ours"
            )
        why = missing(cfg.backend)
        if why:
            raise ConfigError(f"opt.custom_op.backend={cfg.backend}: {why}")


def apply_custom_op(model: GPT, cfg: DictConfig) -> None:
    """Routes the model's loss through the fused operator, with the knobs of `cfg`."""
    check_custom_op(cfg)
    if cfg.backend != "ours":
        model.fused_loss = functools.partial(
            LOSSES[cfg.backend], vocab_size=model.config.vocab_size
        )
        log(f"[opt] custom_op: fused head + cross-entropy from {LIBRARIES[cfg.backend][0]}")
        return
    model.fused_loss = functools.partial(
        linear_cross_entropy,
        vocab_size=model.config.vocab_size,
        chunk_size=cfg.chunk_size,
        block=cfg.block,
        num_warps=cfg.num_warps,
        float8=cfg.float8,
    )
    chunk = "all tokens" if cfg.chunk_size == 0 else f"{cfg.chunk_size} tokens"
    device = model.lm_head.weight.device
    rows = (  # the per-row step: kernels/linear_cross_entropy.py's _rows_kernel
        f"Triton kernel block={cfg.block}, num_warps={cfg.num_warps}"
        if device.type == "cuda"
        else f"the PyTorch reference per row on the {device.type} (the Triton kernel is CUDA's)"
    )
    log(
        f"[opt] custom_op: fused head + cross-entropy, chunks of {chunk}, {rows}"
        + (", float8 matmuls" if cfg.float8 else "")
    )


@dataclass
class Knobs:
    backend: Literal["ours", "liger", "cce"]
    chunk_size: Annotated[int, count(0)]  # tokens per chunk (0: all at once)
    block: Annotated[int, count(16)]  # a power of two
    num_warps: Literal[1, 2, 4, 8, 16, 32]
    float8: bool


STAGE = Stage(
    "custom_op", "model", lambda ctx: apply_custom_op(ctx.model, ctx.knobs), Knobs,
    check=lambda ctx: check_custom_op(ctx.knobs),
)  # fmt: skip
