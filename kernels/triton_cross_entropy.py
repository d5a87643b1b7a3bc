"""The Triton kernel of the fused head: per row of a logits chunk, the cross-entropy loss and its
gradient (softmax - onehot), written in place over the logits.

A row of GPT-2's padded vocabulary is 50304 logits (100 KB in bfloat16). The kernel is memory
bound: it must read the row once and write the gradient once, and everything else (the maximum,
the sum of exponentials, the target's logit) stays in registers. One program handles one row:

- one pass (`block` >= the row): the whole row is loaded into registers once; max, sum of exp2
  and the gradient come from that one load (one exp2 per logit).
- two passes (`block` < the row): an online log-sum-exp over blocks of `block` columns (one
  block-wide max and sum per step), then a second sweep that rereads each block (usually from
  L2: the rows of the programs in flight fit in it) and writes the gradient (one exp2 per
  logit per pass).

Columns >= `vocab_size` are the embedding's padding: never predicted, gradient 0.
Imported only where it runs (CUDA, or the interpreter in tests): CPU installs need no triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# exp(x) = exp2(x * log2(e)): exp2 is the GPU's native instruction. (Globals used in a kernel
# must be constexpr.)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,  # (rows, N_COLS), the compute dtype: read, then overwritten by the gradient
    targets_ptr,  # (rows,) int64
    losses_ptr,  # (rows,) float32: written
    grad8_ptr,  # (rows, N_COLS) float8_e5m2: the gradient times GRAD8_SCALE, if WRITE_GRAD8
    vocab_size,  # columns >= vocab_size are padding
    N_COLS: tl.constexpr,  # the row length (and stride): the padded vocabulary, fixed per model
    BLOCK: tl.constexpr,  # columns per step; the whole (power-of-two-padded) row if ONE_PASS
    ONE_PASS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,  # False: the loss only (evaluation)
    WRITE_GRAD8: tl.constexpr,  # also a float8 copy of the gradient, for a float8 matmul
    GRAD8_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # rows * N_COLS can exceed 2**31
    row_ptr = logits_ptr + row * N_COLS
    target = tl.load(targets_ptr + row)
    # The target's logit, read before the row is overwritten by its gradient.
    target_logit = tl.load(row_ptr + target).to(tl.float32)
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        inside = cols < N_COLS
        x = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32) * LOG2E
        x = tl.where(cols < vocab_size, x, float("-inf"))
        row_max = tl.max(x, axis=0)
        e = tl.exp2(x - row_max)  # padding: exp2(-inf) = 0
        total = tl.sum(e, axis=0)
        lse2 = row_max + tl.log2(total)  # log2-sum-exp2 of the row, in base-2 units
        if WRITE_GRAD:
            p = e * (1.0 / total)
            grad = tl.where(cols == target, p - 1.0, p)
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=inside)
            if WRITE_GRAD8:
                grad8 = (grad * GRAD8_SCALE).to(grad8_ptr.dtype.element_ty)
                tl.store(grad8_ptr + row * N_COLS + cols, grad8, mask=inside)
    else:
        row_max = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        for start in range(0, N_COLS, BLOCK):
            c = start + cols
            x = tl.load(row_ptr + c, mask=c < N_COLS, other=float("-inf")).to(tl.float32) * LOG2E
            x = tl.where(c < vocab_size, x, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(x, axis=0))
            total = total * tl.exp2(row_max - new_max) + tl.sum(tl.exp2(x - new_max), axis=0)
            row_max = new_max
        lse2 = row_max + tl.log2(total)
        if WRITE_GRAD:
            for start in range(0, N_COLS, BLOCK):
                c = start + cols
                inside = c < N_COLS
                x = tl.load(row_ptr + c, mask=inside, other=0.0).to(tl.float32) * LOG2E
                p = tl.where(c < vocab_size, tl.exp2(x - lse2), 0.0)
                grad = tl.where(c == target, p - 1.0, p)
                tl.store(row_ptr + c, grad.to(logits_ptr.dtype.element_ty), mask=inside)
                if WRITE_GRAD8:
                    grad8 = (grad * GRAD8_SCALE).to(grad8_ptr.dtype.element_ty)
                    tl.store(grad8_ptr + row * N_COLS + c, grad8, mask=inside)
    tl.store(losses_ptr + row, lse2 * LN2 - target_logit)


def cross_entropy_rows_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    losses: torch.Tensor,
    vocab_size: int,
    block: int,
    num_warps: int,
    write_grad: bool = True,
    grad8: torch.Tensor | None = None,
    grad8_scale: float = 1.0,
) -> None:
    """Writes each row's loss into `losses` and, if `write_grad`, overwrites `logits` (rows,
    n_cols, contiguous) with (softmax - onehot(targets)) over its first `vocab_size` columns and
    0 over the rest, and writes that gradient times `grad8_scale` into `grad8` (float8) if given.
    `block` >= n_cols loads each row once (see the module docstring)."""
    rows, n_cols = logits.shape
    one_pass = block >= n_cols
    _cross_entropy_rows_kernel[(rows,)](
        logits,
        targets,
        losses,
        grad8 if grad8 is not None else losses,  # unused without WRITE_GRAD8
        vocab_size,
        N_COLS=n_cols,
        BLOCK=triton.next_power_of_2(n_cols) if one_pass else block,
        ONE_PASS=one_pass,
        WRITE_GRAD=write_grad,
        WRITE_GRAD8=write_grad and grad8 is not None,
        GRAD8_SCALE=grad8_scale,
        num_warps=num_warps,
    )
