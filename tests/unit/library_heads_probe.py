"""Run by test_head_backends.py with TRITON_INTERPRET=1 (which triton reads when it is first
imported, hence a process of its own): the real libraries behind `opt.custom_op.backend`, called
through kernels/library_heads.py on CPU tensors, against the plain head in float32. liger runs
its Triton kernel in Triton's interpreter; cut-cross-entropy's Triton kernel does not run there,
so its own `impl="torch_compile"` path (the same function, its PyTorch implementation) stands in.
Prints one JSON line: {backend: [loss error, hidden grad error, weight grad error, padding grad]}.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.library_heads import LOSSES  # noqa: E402

TOKENS, WIDTH, VOCAB, PADDED = 24, 16, 60, 64  # 4 padding rows, as GPT-2 pads 50257 to 50304


def plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(PADDED)
    mask[VOCAB:] = float("-inf")
    return F.cross_entropy(F.linear(hidden, weight, mask), targets)


def errors(backend: str) -> list[float]:
    torch.manual_seed(0)
    hidden = torch.randn(TOKENS, WIDTH, requires_grad=True)
    weight = (0.5 * torch.randn(PADDED, WIDTH)).requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS,))
    expected = plain(hidden, weight, targets)
    grads = torch.autograd.grad(expected, (hidden, weight))
    loss = LOSSES[backend](hidden, weight, targets, VOCAB)
    got = torch.autograd.grad(loss, (hidden, weight))
    return [
        (loss - expected).abs().item(),
        *((a - b).abs().max().item() for a, b in zip(got, grads, strict=True)),
        got[1][VOCAB:].abs().max().item(),
    ]


if __name__ == "__main__":
    if "cce" in sys.argv[1:]:
        import cut_cross_entropy

        real = cut_cross_entropy.linear_cross_entropy
        cut_cross_entropy.linear_cross_entropy = functools.partial(real, impl="torch_compile")
    print(json.dumps({backend: errors(backend) for backend in sys.argv[1:]}))
