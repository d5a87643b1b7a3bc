"""Run by test_custom_op.py with TRITON_INTERPRET=1 (which triton reads when it is first
imported, hence a process of its own): the fused head's Triton kernel on CPU tensors, against
the PyTorch reference. Prints one JSON line: {case: [loss error, gradient error, tolerance]}."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.linear_cross_entropy import (  # noqa: E402
    GRAD8_SCALE,
    _cross_entropy_rows_torch_,
    chunked_linear_cross_entropy,
)
from kernels.triton_cross_entropy import cross_entropy_rows_  # noqa: E402

ROWS, N_COLS, VOCAB = 6, 320, 300  # 20 padding columns, as GPT-2 pads 50257 to 50304
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3}  # bfloat16: one rounding of the grad


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def kernel_cases() -> dict[str, list[float]]:
    """The kernel alone: two passes with a partial last block (64, 128), one pass (512)."""
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        for block in (64, 128, 512):
            logits = (3 * torch.randn(ROWS, N_COLS)).to(dtype)
            targets = torch.randint(0, VOCAB, (ROWS,))
            expected, expected_losses = logits.clone(), torch.empty(ROWS)
            _cross_entropy_rows_torch_(expected, targets, expected_losses, VOCAB)
            grad, losses = logits.clone(), torch.empty(ROWS)
            cross_entropy_rows_(grad, targets, losses, VOCAB, block, num_warps=4)
            untouched, loss_only = logits.clone(), torch.empty(ROWS)
            cross_entropy_rows_(untouched, targets, loss_only, VOCAB, block, 4, write_grad=False)
            assert torch.equal(untouched, logits) and torch.equal(loss_only, losses)
            assert not grad[:, VOCAB:].any()
            errors[f"kernel {dtype} block={block}"] = [
                max_error(losses, expected_losses),
                max_error(grad, expected),
                TOLERANCE[dtype],
            ]
    return errors


def float8_cases() -> dict[str, list[float]]:
    """The kernel's float8 copy of the gradient (e5m2, scaled by GRAD8_SCALE): e5m2 keeps two
    mantissa bits, so each value above its normal range (2**-14 / GRAD8_SCALE, 2e-9) is within
    1/8 of itself. Values whose rounding carries into the next power of two are left out: Triton
    3.6's interpreter drops that carry (-32761 -> -16384, where torch and the GPU's cvt.rn give
    -32768)."""
    errors = {}
    for block in (128, 512):
        logits = 3 * torch.randn(ROWS, N_COLS)
        targets = torch.randint(0, VOCAB, (ROWS,))
        grad, losses = logits.clone(), torch.empty(ROWS)
        grad8 = torch.empty(ROWS, N_COLS, dtype=torch.float8_e5m2)
        cross_entropy_rows_(grad, targets, losses, VOCAB, block, 4, True, grad8, GRAD8_SCALE)
        scaled = grad * GRAD8_SCALE
        carries = scaled.to(grad8.dtype).float().abs().log2().floor() > scaled.abs().log2().floor()
        normal = (grad.abs() > 2**-14 / GRAD8_SCALE) & ~carries
        relative = ((grad8.float() / GRAD8_SCALE - grad).abs() / grad.abs())[normal]
        errors[f"float8 gradient block={block}"] = [0.0, relative.max().item(), 0.13]
    return errors


def operator_cases() -> dict[str, list[float]]:
    """The chunked operator with the Triton kernel as its row step, against the plain head."""
    errors = {}
    hidden, weight = torch.randn(20, 16), 0.5 * torch.randn(N_COLS, 16)
    targets = torch.randint(0, VOCAB, (20,))
    logits = hidden @ weight.t()
    logits[:, VOCAB:] = float("-inf")
    hidden.requires_grad_()
    expected = F.cross_entropy(logits, targets)
    expected_grad = torch.autograd.grad(
        F.cross_entropy(hidden @ weight[:VOCAB].t(), targets), hidden
    )
    for chunk_size, block in [(0, 512), (7, 64), (20, 128)]:

        def rows(chunk, t, losses, vocab, write_grad, grad8, block=block):
            cross_entropy_rows_(chunk, t, losses, vocab, block, 4, write_grad, grad8)

        loss, grad_hidden, _ = chunked_linear_cross_entropy(
            hidden.detach(), weight, targets, VOCAB, chunk_size, True, rows
        )
        errors[f"operator chunk={chunk_size} block={block}"] = [
            max_error(loss, expected),
            max_error(grad_hidden / len(targets), expected_grad[0]),
            1e-6,
        ]
    return errors


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(kernel_cases() | float8_cases() | operator_cases()))
