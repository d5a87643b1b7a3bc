"""The Triton kernels of +opt=lowbit's fused update (opt.lowbit.impl=triton): AdamW over one
parameter in one launch, its moments either in torchao's 8-bit format or in float32.

torchao's `AdamW8bit` steps each parameter through a compiled PyTorch function; GPT-2 XL has
580 of them, and each call costs ~0.5 ms of host time (dynamo's guards on the quantized state's
tensor subclasses, the launch of the graph's kernels), as long as the GPU's whole step: the
memory_xl `lowbit` row waited on the host (docs/results/nvidia-h100-80gb-hbm3/
memory_xl_lowbit_budget.md). These kernels do the same update in one launch per parameter from
plain pointers (tens of microseconds of host time), and skip on a device flag instead of a host
read, so +opt=opt_in_backward can step a whole transformer block without waiting for the host.

The state is torchao's (`OptimState8bit`: uint8 codes in the parameter's shape, one float32
scale per block of 256 values, the 256-entry dynamic map of the 8-bit optimizers paper): the
same checkpoints, the same math (dequantize, AdamW in float32 with the float32 moments, the
block's absolute maximum as its new scale, the nearest code by a branchless binary search), so
quality measured with torchao's update holds for this one.

One program updates ROWS quantization blocks of 256 values, held as a (ROWS, 256) tile: a
block's new scale is a reduction over its row. Imported only where it runs (CUDA, or Triton's
interpreter in the tests): CPU installs need no triton.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

QBLOCK = 256  # values per scale: torchao's AdamW8bit block_size
ROWS = 8  # quantization blocks per program (2048 values)
FLAT_BLOCK = 1024  # values per program for the float32-moment kernel


@triton.jit
def _nearest_code(x, qmap_ptr):
    """The index of the `qmap` entry nearest to `x` (values in [-1, 1]; qmap sorted, 256
    entries): eight halving steps find the last entry <= x, then round to the closer of it and
    the next (torchao's quantize_8bit_with_qmap, elementwise)."""
    codes = tl.where(x >= tl.load(qmap_ptr + 128), 128, 0)
    codes += tl.where(x >= tl.load(qmap_ptr + codes + 64), 64, 0)
    codes += tl.where(x >= tl.load(qmap_ptr + codes + 32), 32, 0)
    codes += tl.where(x >= tl.load(qmap_ptr + codes + 16), 16, 0)
    codes += tl.where(x >= tl.load(qmap_ptr + codes + 8), 8, 0)
    codes += tl.where(x >= tl.load(qmap_ptr + codes + 4), 4, 0)
    codes += tl.where(x >= tl.load(qmap_ptr + codes + 2), 2, 0)
    codes += tl.where(x >= tl.load(qmap_ptr + codes + 1), 1, 0)
    up = tl.minimum(codes + 1, 255)
    below = tl.load(qmap_ptr + codes)
    above = tl.load(qmap_ptr + up)
    return tl.where(x - below >= (above - below) * 0.5, up, codes)


@triton.jit
def _adamw(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias_correction1,
           bias_correction2_sqrt):  # fmt: skip
    """One AdamW step in float32 of weights `p` with gradient `g` and moments `m`, `v`, as
    torchao's single_param_adam writes it (lerp with a weight < 0.5 is start + weight * (end -
    start)); returns the new weights and moments (the step uses the moments before rounding)."""
    p = p - lr * weight_decay * p
    m = m + (1.0 - beta1) * (g - m)
    v = v + (1.0 - beta2) * (g * g - v)
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    return p - lr * (m / bias_correction1) / denom, m, v


@triton.jit
def _rounded_for(param_ptr, p, offsets, seed, STOCHASTIC_ROUND: tl.constexpr):
    """The float32 weights `p` as the parameter's dtype. For bfloat16 weights the 16 bits that
    bfloat16 drops decide the rounding, done on the bits so that it does not depend on the
    conversion's mode: to nearest (ties to even), or with STOCHASTIC_ROUND up (away from zero)
    with the probability of those bits, so that the rounding is unbiased (torchao's
    bf16_stochastic_round, elementwise). The value is then exact in bfloat16."""
    if param_ptr.dtype.element_ty == tl.bfloat16:
        bits = p.to(tl.uint32, bitcast=True)
        if STOCHASTIC_ROUND:
            bits += tl.randint(seed, offsets.to(tl.uint32)) & 0xFFFF
        else:
            bits += 0x7FFF + ((bits >> 16) & 1)
        p = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return p.to(param_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["seed"])  # a new seed each step: one compiled kernel
def _adamw_8bit_kernel(
    param_ptr,  # (n,) the weights, float32 or bfloat16: read, updated in place
    grad_ptr,  # (n,) the gradient
    m_codes_ptr, m_scale_ptr, m_qmap_ptr,  # the first moment: uint8 codes, scales, signed map
    v_codes_ptr, v_scale_ptr, v_qmap_ptr,  # the second moment: the unsigned map
    skip_ptr,  # () float32: nonzero skips the update (nothing is written)
    n_blocks,  # n // QBLOCK
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
    seed,  # the stochastic rounding's random stream (this step's)
    QBLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    STOCHASTIC_ROUND: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    # A skipped step masks every row: nothing is read or written.
    row_mask = rows < tl.where(tl.load(skip_ptr) == 0.0, n_blocks, 0)
    mask = row_mask[:, None]

    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m_codes = tl.load(m_codes_ptr + offsets, mask=mask, other=0).to(tl.int32)
    v_codes = tl.load(v_codes_ptr + offsets, mask=mask, other=0).to(tl.int32)
    m_scale = tl.load(m_scale_ptr + rows, mask=row_mask, other=0.0)
    v_scale = tl.load(v_scale_ptr + rows, mask=row_mask, other=0.0)
    m = tl.load(m_qmap_ptr + m_codes) * m_scale[:, None]
    v = tl.load(v_qmap_ptr + v_codes) * v_scale[:, None]

    p, m, v = _adamw(
        p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt
    )
    tl.store(
        param_ptr + offsets, _rounded_for(param_ptr, p, offsets, seed, STOCHASTIC_ROUND), mask=mask
    )

    # Each block's new scale is its absolute maximum (at least 1e-12); the codes the nearest
    # map entries to the moments over their scale.
    m_scale = tl.maximum(tl.max(tl.abs(m), axis=1), 1e-12)
    v_scale = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12)
    m_codes = _nearest_code(m / m_scale[:, None], m_qmap_ptr)
    v_codes = _nearest_code(v / v_scale[:, None], v_qmap_ptr)
    tl.store(m_codes_ptr + offsets, m_codes.to(tl.uint8), mask=mask)
    tl.store(v_codes_ptr + offsets, v_codes.to(tl.uint8), mask=mask)
    tl.store(m_scale_ptr + rows, m_scale, mask=row_mask)
    tl.store(v_scale_ptr + rows, v_scale, mask=row_mask)


@triton.jit(do_not_specialize=["seed"])
def _adamw_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr,  # (n,) each; the moments float32
    skip_ptr,
    n,
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
    seed,
    BLOCK: tl.constexpr,
    STOCHASTIC_ROUND: tl.constexpr,
):  # fmt: skip
    """The same update with unquantized moments (the parameter's dtype): torchao keeps those
    for tensors under 4096 values (biases, LayerNorms)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < tl.where(tl.load(skip_ptr) == 0.0, n, 0)
    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p, m, v = _adamw(
        p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt
    )
    tl.store(
        param_ptr + offsets, _rounded_for(param_ptr, p, offsets, seed, STOCHASTIC_ROUND), mask=mask
    )
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: Any,  # torchao's OptimState8bit (untyped) or a float32 tensor
    exp_avg_sq: Any,
    skip: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    stochastic_round: bool = False,
) -> None:
    """One AdamW step of `param` in place, unless `skip` (a float32 scalar on the parameter's
    device) is nonzero. `exp_avg`/`exp_avg_sq`: torchao's `OptimState8bit` (signed and
    unsigned maps, blocks of 256) or tensors of the parameter's shape and dtype; `step`: the
    step count including this one; `stochastic_round`: bfloat16 weights rounded stochastically
    (a random stream drawn from torch's CPU generator: no device sync). Every tensor
    contiguous."""
    stochastic = stochastic_round and param.dtype is torch.bfloat16
    seed = int(torch.randint(0, 2**31 - 1, ())) if stochastic else 0
    scalars = dict(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        bias_correction1=1.0 - beta1**step, bias_correction2_sqrt=(1.0 - beta2**step) ** 0.5,
    )  # fmt: skip
    n = param.numel()
    if hasattr(exp_avg, "codes"):  # torchao's OptimState8bit
        n_blocks = n // QBLOCK
        _adamw_8bit_kernel[(triton.cdiv(n_blocks, ROWS),)](
            param, grad,
            exp_avg.codes, exp_avg.scale, exp_avg.qmap,
            exp_avg_sq.codes, exp_avg_sq.scale, exp_avg_sq.qmap,
            skip, n_blocks, **scalars, seed=seed, QBLOCK=QBLOCK, ROWS=ROWS,
            STOCHASTIC_ROUND=stochastic, num_warps=8,
        )  # fmt: skip
    else:
        _adamw_kernel[(triton.cdiv(n, FLAT_BLOCK),)](
            param, grad, exp_avg, exp_avg_sq, skip, n, **scalars, seed=seed,
            BLOCK=FLAT_BLOCK, STOCHASTIC_ROUND=stochastic, num_warps=4,
        )  # fmt: skip
