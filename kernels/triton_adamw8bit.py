"""The Triton kernels of +opt=lowbit's fused update (opt.lowbit.impl=triton): AdamW over one
parameter in one launch, its moments either in torchao's 8-bit format or in float32.

torchao's `AdamW8bit` steps each parameter through a compiled PyTorch function; GPT-2 XL has
580 of them, and each call costs ~0.5 ms of host time (dynamo's guards on the quantized state's
tensor subclasses, the launch of the graph's kernels), as long as the GPU's whole step: the
memory_xl `lowbit` row waited on the host (docs/results/nvidia-h100-80gb-hbm3/
memory_xl_lowbit_budget.md). These kernels do the same update in one launch for many tensors from
plain pointers (tens of microseconds of host time), and skip on a device flag instead of a host
read, so +opt=opt_in_backward can step a whole transformer block without waiting for the host.

The state is torchao's (`OptimState8bit`: uint8 codes in the parameter's shape, one float32
scale per block of 256 values, the 256-entry dynamic map of the 8-bit optimizers paper): the
same checkpoints, the same math (dequantize, AdamW in float32 with the float32 moments, the
block's absolute maximum as its new scale, the nearest code by a branchless binary search), so
quality measured with torchao's update holds for this one.

One program updates ROWS quantization blocks of 256 values, held as a (ROWS, 256) tile: a
block's new scale is a reduction over its row. One launch updates many tensors (a transformer
block's, as +opt=opt_in_backward steps them): a table of their addresses, and a table saying
which tensor and which rows each program takes (the multi-tensor launch of PyTorch's foreach
optimizers, for this state). Imported only where it runs (CUDA, or Triton's
interpreter in the tests): CPU installs need no triton.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
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


@triton.jit
def _step_8bit_rows(
    param_ptr, grad_ptr,
    m_codes_ptr, m_scale_ptr, m_qmap_ptr, v_codes_ptr, v_scale_ptr, v_qmap_ptr,
    rows, row_mask,  # (ROWS,) the quantization blocks this program updates, and which exist
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, seed,
    QBLOCK: tl.constexpr,
    STOCHASTIC_ROUND: tl.constexpr,
):  # fmt: skip
    """AdamW on rows of one tensor whose moments are torchao's 8-bit state."""
    offsets = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
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


@triton.jit(do_not_specialize=["seed"])  # a new seed each step: one compiled kernel
def _adamw_8bit_kernel(
    table_ptr,  # (tensors, 7) int64: param, grad, m codes, m scales, v codes, v scales, n_blocks
    work_ptr,  # (programs, 2) int64: each program's tensor and its first quantization block
    param_like_ptr, grad_like_ptr,  # the first tensor's: the dtypes of every one of them
    m_qmap_ptr, v_qmap_ptr,  # the signed and unsigned maps (the same for every tensor)
    skip_ptr,  # () float32: nonzero skips the update (nothing is written)
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
    seed,  # the stochastic rounding's random stream (this step's; tensor t uses seed + t)
    QBLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    STOCHASTIC_ROUND: tl.constexpr,
):  # fmt: skip
    tensor = tl.load(work_ptr + 2 * tl.program_id(0))
    entry = table_ptr + 7 * tensor
    rows = tl.load(work_ptr + 2 * tl.program_id(0) + 1) + tl.arange(0, ROWS)
    # A skipped step masks every row: nothing is read or written.
    row_mask = rows < tl.where(tl.load(skip_ptr) == 0.0, tl.load(entry + 6), 0)
    _step_8bit_rows(
        tl.load(entry).to(tl.pointer_type(param_like_ptr.dtype.element_ty)),
        tl.load(entry + 1).to(tl.pointer_type(grad_like_ptr.dtype.element_ty)),
        tl.load(entry + 2).to(tl.pointer_type(tl.uint8)),
        tl.load(entry + 3).to(tl.pointer_type(tl.float32)),
        m_qmap_ptr,
        tl.load(entry + 4).to(tl.pointer_type(tl.uint8)),
        tl.load(entry + 5).to(tl.pointer_type(tl.float32)),
        v_qmap_ptr,
        rows, row_mask,
        lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
        seed + tensor, QBLOCK, STOCHASTIC_ROUND,
    )  # fmt: skip


@triton.jit(do_not_specialize=["seed"])
def _adamw_kernel(
    table_ptr,  # (tensors, 5) int64: param, grad, m, v, n
    work_ptr,  # (programs, 2) int64: each program's tensor and its first value
    param_like_ptr, grad_like_ptr, moment_like_ptr,  # the dtypes of every tensor
    skip_ptr,
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
    seed,
    BLOCK: tl.constexpr,
    STOCHASTIC_ROUND: tl.constexpr,
):  # fmt: skip
    """The same update with unquantized moments (the parameter's dtype): torchao keeps those
    for tensors under 4096 values (biases, LayerNorms)."""
    tensor = tl.load(work_ptr + 2 * tl.program_id(0))
    entry = table_ptr + 5 * tensor
    param_ptr = tl.load(entry).to(tl.pointer_type(param_like_ptr.dtype.element_ty))
    grad_ptr = tl.load(entry + 1).to(tl.pointer_type(grad_like_ptr.dtype.element_ty))
    m_ptr = tl.load(entry + 2).to(tl.pointer_type(moment_like_ptr.dtype.element_ty))
    v_ptr = tl.load(entry + 3).to(tl.pointer_type(moment_like_ptr.dtype.element_ty))
    offsets = tl.load(work_ptr + 2 * tl.program_id(0) + 1) + tl.arange(0, BLOCK)
    mask = offsets < tl.where(tl.load(skip_ptr) == 0.0, tl.load(entry + 4), 0)
    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p, m, v = _adamw(
        p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt
    )
    tl.store(
        param_ptr + offsets,
        _rounded_for(param_ptr, p, offsets, seed + tensor, STOCHASTIC_ROUND),
        mask=mask,
    )
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)


def adamw_update_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[Any],  # torchao's OptimState8bit (untyped) or float32 tensors
    exp_avg_sqs: Sequence[Any],
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
    """One AdamW step of every tensor of `params` in place, unless `skip` (a float32 scalar on
    their device) is nonzero: one launch for those whose moments are torchao's `OptimState8bit`
    (signed and unsigned maps, blocks of 256) and one for those with moments of their own shape
    and dtype, however many tensors (a transformer block's 12: 2 launches instead of 12). The
    tensors share a device, a dtype (their gradients one too) and `step`, the step count
    including this one; `stochastic_round`: bfloat16 weights rounded stochastically (a random
    stream drawn from torch's CPU generator: no device sync). Every tensor contiguous."""
    if not params:
        return
    stochastic = stochastic_round and params[0].dtype is torch.bfloat16
    seed = int(torch.randint(0, 2**30, ())) if stochastic else 0
    scalars = dict(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        bias_correction1=1.0 - beta1**step, bias_correction2_sqrt=(1.0 - beta2**step) ** 0.5,
    )  # fmt: skip
    tensors = list(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True))
    quantized = [t for t in tensors if hasattr(t[2], "codes")]
    plain = [t for t in tensors if not hasattr(t[2], "codes")]
    device = params[0].device
    if quantized:
        entries = [(p.data_ptr(), g.data_ptr(), m.codes.data_ptr(), m.scale.data_ptr(),
                    v.codes.data_ptr(), v.scale.data_ptr(), p.numel() // QBLOCK)
                   for p, g, m, v in quantized]  # fmt: skip
        work = _work(tuple(e[-1] for e in entries), ROWS, device)
        _adamw_8bit_kernel[(len(work),)](
            _table(tuple(entries), device), work, quantized[0][0], quantized[0][1],
            quantized[0][2].qmap, quantized[0][3].qmap, skip, **scalars, seed=seed,
            QBLOCK=QBLOCK, ROWS=ROWS, STOCHASTIC_ROUND=stochastic, num_warps=8,
        )  # fmt: skip
    if plain:
        flat = [(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel())
                for p, g, m, v in plain]  # fmt: skip
        work = _work(tuple(e[-1] for e in flat), FLAT_BLOCK, device)
        _adamw_kernel[(len(work),)](
            _table(tuple(flat), device), work, plain[0][0], plain[0][1], plain[0][2], skip,
            **scalars, seed=seed, BLOCK=FLAT_BLOCK, STOCHASTIC_ROUND=stochastic, num_warps=4,
        )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _table(rows: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    """The launch's table of addresses and sizes, on `device`. Gradients are freed after each
    block's step and allocated again in the next backward, in the same order and sizes, so the
    caching allocator mostly hands back the same addresses: a table is made (from pinned memory,
    without a sync) only for addresses not seen before, and otherwise found by their values."""
    table = torch.tensor(rows, dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


@functools.lru_cache(maxsize=256)
def _work(units: tuple[int, ...], per_program: int, device: torch.device) -> torch.Tensor:
    """Each program's (tensor, first unit): tensor t of `units[t]` units (quantization blocks,
    or values) split into programs of `per_program` units. The shapes do not change from step
    to step: made once per set of shapes."""
    work = [(t, first) for t, n in enumerate(units) for first in range(0, n, per_program)]
    return torch.tensor(work, dtype=torch.int64, device=device)
