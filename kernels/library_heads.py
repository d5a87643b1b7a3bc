"""The field's fused head + cross-entropy, called as our operator is: liger-kernel's fused linear
cross-entropy (`liger_kernel.transformers.functional.liger_fused_linear_cross_entropy`, 0.8.x)
and Apple's cut-cross-entropy (`cut_cross_entropy.linear_cross_entropy`, 25.1.x). They back
`opt.custom_op.backend=liger|cce` and are measured beside ours by scripts/bench_head.py.

Both are optional GPU (Triton) libraries, imported when first called; `missing` says why one
cannot be imported here, with its pip line. Both get the real vocabulary's rows of the tied
weight, `weight[:vocab_size]` (a view): the padding rows then get no probability and a zero
gradient, as the plain head's -inf bias gives them. Under autocast, hidden and weight are cast to
the autocast dtype first, as autocast casts `F.linear`'s (and as our operator's autocast rule
does): the libraries' Triton kernels run in their inputs' dtype.

Where their defaults differ from ours: liger sums W's gradient in float32 (`accum_dtype`; by
default it would sum in the weight's dtype), as ours does. CCE keeps its default gradient filter
(`filter_eps="high"`: backward skips the softmax entries below the dtype's eps / 32), the speed
trick it ships with; the benchmark's error columns show what it costs.
"""

from __future__ import annotations

import importlib

import torch

# backend: (its package, the version measured, the module its function is imported from)
LIBRARIES = {
    "liger": ("liger-kernel", "0.8.5", "liger_kernel.transformers.functional"),
    "cce": ("cut-cross-entropy", "25.1.1", "cut_cross_entropy"),
}


def missing(backend: str) -> str | None:
    """Why `backend`'s library cannot be imported here, with its pip line; None if it can."""
    package, version, module = LIBRARIES[backend]
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"{module} cannot be imported ({e}): pip install {package}=={version}"
    return None


def _like_linear(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Under autocast, both in the autocast dtype (as autocast casts `F.linear`'s inputs)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return hidden.to(dtype), weight.to(dtype)
    return hidden, weight


# Run eagerly under torch.compile: Dynamo traces into liger's autograd Function and fails on its
# float32 gradient accumulator under autocast (measured on an H100, torch 2.11: "unsupported
# operand type(s) for *: 'torch.dtype' and 'FakeTensor'" in a fake-tensor addmm). The head is
# then its own eager piece between compiled graphs, as liger's own kernels run anyway.
@torch.compiler.disable
def liger_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """liger-kernel's fused linear cross-entropy: the mean over the N tokens of
    cross_entropy(hidden @ weight[:vocab_size]^T, targets), as `linear_cross_entropy` gives it."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    hidden, weight = _like_linear(hidden, weight[:vocab_size])
    return liger_fused_linear_cross_entropy(hidden, weight, targets, accum_dtype=torch.float32)


def cce_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Apple's cut-cross-entropy: the same mean, its Triton kernels (impl="cce") on Linux."""
    from cut_cross_entropy import linear_cross_entropy

    hidden, weight = _like_linear(hidden, weight[:vocab_size])
    return linear_cross_entropy(hidden, weight, targets)


LOSSES = {"liger": liger_linear_cross_entropy, "cce": cce_linear_cross_entropy}
