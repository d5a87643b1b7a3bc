"""A fused vocabulary projection + cross-entropy: `gpt2_recipe::linear_cross_entropy`.

The plain head computes logits = hidden @ W^T for every token (tokens x 50304 in the compute
dtype), upcasts them to float32 for the cross-entropy, and keeps them for backward, where the
gradient of the logits is yet another tokens x 50304 tensor. For GPT-2 at 32 x 1024 tokens that
is 3.3 GB of bfloat16 logits plus 6.6 GB of float32 ones, and several passes over them.

This operator never materialises the float32 logits. Chunk by chunk of `chunk_size` tokens:

    logits_c = hidden_c @ W^T                  cuBLAS, compute dtype (fp32 accumulation)
    loss_c, logits_c <- softmax - onehot       one kernel per row: log-sum-exp, loss, gradient
    grad_hidden_c = logits_c @ W               cuBLAS
    grad_W += logits_c^T @ hidden_c            cuBLAS, accumulated in float32

so the gradients of the hidden states and of the (tied) weight are produced in the forward
pass, and backward only multiplies them by grad_loss / N. They are kept unnormalised (no 1/N)
and the weight's in float32: under float16 the loss scale of a GradScaler arrives only in
backward, and (softmax - onehot) / N would underflow before it does. The chunk's logits buffer
is the only transient: chunk_size x vocab in the compute dtype, once.

With `float8`, the logits and grad_hidden matmuls run on float8 tensor cores
(`torch._scaled_mm`): hidden and W in e4m3 with one scale each (from their max), and the
gradient written a second time by the kernel, in e5m2 with the fixed scale 2**15 (it lies in
[-1, 1], so no max is needed). W's gradient, a sum over all tokens, stays in the compute dtype.

On CUDA the middle step is a Triton kernel (`kernels/triton_cross_entropy.py`); elsewhere it is
the same math in PyTorch (log_softmax in float32), which is also the reference the tests use.
The operator is registered with `torch.library`: a fake implementation for tracing and an
autograd formula, so `torch.compile` captures it as one node with no graph break, and an
autocast rule that casts hidden and weight to the autocast dtype, as autocast casts `F.linear`'s;
and its FLOPs with `torch.utils.flop_counter`, which sees one op, not the matmuls inside.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import register_flop_formula

OP = "gpt2_recipe::linear_cross_entropy"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRAD8_SCALE = 2.0**15  # |softmax - onehot| <= 1, and e5m2 reaches 57344: a fixed, safe scale


def _to_float8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in e4m3 with one scale (its max maps to e4m3's largest value), and that scale's
    inverse, which multiplies the matmul's result back."""
    top = torch.finfo(E4M3).max
    scale = top / x.detach().abs().amax().float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-top, top).to(E4M3), scale.reciprocal()


def _mm_float8(
    a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """a @ b of float8 operands, rescaled, in `dtype`: float8 tensor cores on CUDA (a row-major,
    b column-major), the same arithmetic in float32 elsewhere (the reference)."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=dtype)
    return ((a.float() @ b.float()) * (a_inv * b_inv)).to(dtype)


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} must be (N, C) and weight "
            f"{tuple(weight.shape)} (V, C)"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy: targets {tuple(targets.shape)} must be ({hidden.shape[0]},)"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}: cast "
            "them to one dtype, or call it under torch.autocast, which casts both"
        )
    if not 0 < vocab <= weight.shape[0]:
        raise ValueError(f"linear_cross_entropy: vocab_size={vocab} not in (0, {weight.shape[0]}]")


def _cross_entropy_rows_torch_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    losses: torch.Tensor,
    vocab_size: int,
    grad8: torch.Tensor | None = None,
) -> None:
    """The reference of the Triton kernel: each row's loss into `losses`, and `logits`
    overwritten by softmax - onehot over the first `vocab_size` columns (0 beyond); with
    `grad8`, that gradient times GRAD8_SCALE in float8 there too."""
    x = logits.float()  # the plain head's upcast: its float32 log-softmax
    x[:, vocab_size:] = float("-inf")  # the padding (x may alias logits: overwritten anyway)
    lse = torch.logsumexp(x, dim=1)
    losses.copy_(lse - x.gather(1, targets[:, None]).squeeze(1))
    grad = torch.exp(x - lse[:, None])  # padding: exp(-inf) = 0
    grad[torch.arange(len(targets), device=grad.device), targets] -= 1.0
    logits.copy_(grad)
    if grad8 is not None:
        grad8.copy_((grad * GRAD8_SCALE).to(grad8.dtype))


def _add_weight_grad_(
    acc: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor, first: bool
) -> None:
    """acc += grad_logits^T @ hidden (acc = ... for the first chunk: acc is uninitialised and
    beta=0 neither reads it nor propagates its NaNs); products in the compute dtype, sums in
    float32."""
    beta = 0.0 if first else 1.0
    if grad_logits.dtype == acc.dtype:
        acc.addmm_(grad_logits.t(), hidden, beta=beta)
    elif acc.is_cuda:
        try:  # cuBLAS accumulates into the float32 C in place
            torch.addmm(acc, grad_logits.t(), hidden, beta=beta, out_dtype=acc.dtype, out=acc)
        except RuntimeError:  # builds whose addmm(out_dtype) wants C in the inputs' dtype
            part = torch.mm(grad_logits.t(), hidden, out_dtype=acc.dtype)
            if first:
                acc.copy_(part)
            else:
                acc.add_(part)
    else:  # no out_dtype kernel on the CPU: a float32 matmul (the reference path, small shapes)
        acc.addmm_(grad_logits.t().float(), hidden.float(), beta=beta)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    chunk_size: int,
    with_grads: bool,
    rows_kernel: Callable[..., None],
    float8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operator's body (see the module docstring); `rows_kernel(logits, targets, losses,
    vocab_size, write_grad, grad8)` is the per-row step. Returns the mean loss (float32), the
    unnormalised gradients of hidden (its dtype) and of weight (float32), or two empty tensors
    without `with_grads`."""
    _check(hidden, weight, targets, vocab_size)
    n, dtype = hidden.shape[0], hidden.dtype
    chunk = min(chunk_size, n) if chunk_size > 0 else n
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    logits_buffer = hidden.new_empty(chunk, weight.shape[0])
    if with_grads:
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    else:
        grad_hidden, grad_weight = hidden.new_empty(0), weight.new_empty(0, dtype=torch.float32)
    if float8:
        hidden8, hidden_inv = _to_float8(hidden)
        weight8, weight_inv = _to_float8(weight)
        weight8_t = weight8.t().contiguous()  # (C, V): column-major W for grad_hidden's matmul
        grad8_buffer = torch.empty(chunk, weight.shape[0], dtype=E5M2, device=hidden.device)
        grad8_inv = torch.tensor(1 / GRAD8_SCALE, device=hidden.device)
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        h, t = hidden[rows], targets[rows]
        if float8:
            logits = _mm_float8(hidden8[rows], weight8.t(), hidden_inv, weight_inv, dtype)
        else:
            logits = torch.mm(h, weight.t(), out=logits_buffer[: len(h)])
        grad8 = grad8_buffer[: len(h)] if float8 and with_grads else None
        rows_kernel(logits, t, losses[rows], vocab_size, with_grads, grad8)
        if with_grads:  # logits now holds the gradient of the chunk's summed loss
            if float8:
                # grad8 is a buffer whenever float8 and with_grads (mypy cannot see it)
                part = _mm_float8(grad8, weight8_t.t(), grad8_inv, weight_inv, dtype)  # type: ignore[arg-type]

                grad_hidden[rows] = part
            else:
                torch.mm(logits, weight, out=grad_hidden[rows])
            _add_weight_grad_(grad_weight, logits, h, first=start == 0)
    return losses.sum() / n, grad_hidden, grad_weight


# ---- the operator: its implementation (Triton on CUDA), fake, autograd, autocast


def _rows_kernel(device: torch.device, block: int, num_warps: int) -> Callable[..., None]:
    """The per-row step for `device`: the Triton kernel on CUDA, the PyTorch reference elsewhere
    (`block` and `num_warps` are the Triton kernel's)."""
    if device.type == "cuda":
        from kernels.triton_cross_entropy import cross_entropy_rows_

        def triton_rows(logits, targets, losses, vocab, write_grad, grad8) -> None:
            cross_entropy_rows_(
                logits, targets, losses, vocab, block, num_warps, write_grad, grad8, GRAD8_SCALE
            )

        return triton_rows

    def reference_rows(logits, targets, losses, vocab, write_grad, grad8) -> None:
        _cross_entropy_rows_torch_(logits, targets, losses, vocab, grad8)

    return reference_rows


@torch.library.custom_op(OP, mutates_args=())
def _linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    chunk_size: int,
    block: int,
    num_warps: int,
    with_grads: bool,
    float8: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = _rows_kernel(hidden.device, block, num_warps)
    return chunked_linear_cross_entropy(
        hidden, weight, targets.contiguous(), vocab_size, chunk_size, with_grads, rows, float8
    )


@_linear_cross_entropy.register_fake
def _(hidden, weight, targets, vocab_size, chunk_size, block, num_warps, with_grads, float8):
    _check(hidden, weight, targets, vocab_size)
    loss = hidden.new_empty((), dtype=torch.float32)
    if not with_grads:
        return loss, hidden.new_empty(0), weight.new_empty(0, dtype=torch.float32)
    return loss, torch.empty_like(hidden), weight.new_empty(weight.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight = inputs[0], inputs[1]
    _, grad_hidden, grad_weight = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.tokens, ctx.weight_dtype = hidden.shape[0], weight.dtype
    ctx.mark_non_differentiable(grad_hidden, grad_weight)  # for backward only, not for users


def _backward(ctx, grad_loss: torch.Tensor, _grad_hidden, _grad_weight):
    """The gradients were computed in forward: scale them by d(total)/d(mean loss) / N.
    grad_loss carries a GradScaler's scale (and 1/micro-steps), so the float16 gradients
    are scaled exactly as the plain head's would be."""
    grad_hidden, grad_weight = ctx.saved_tensors
    if grad_hidden.numel() == 0 and grad_weight.numel() == 0:
        raise RuntimeError(
            "linear_cross_entropy was called without gradients (under no_grad, or with inputs "
            "that require none): call it with grad enabled to backpropagate through it"
        )
    scale = grad_loss / ctx.tokens  # float32; multiplied in float32, then rounded once
    return (
        (grad_hidden.float() * scale).to(grad_hidden.dtype),
        (grad_weight * scale).to(ctx.weight_dtype),
        None, None, None, None, None, None, None,
    )  # fmt: skip


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.gpt2_recipe.linear_cross_entropy)
def _flops(hidden, weight, targets, vocab_size, chunk_size, block, num_warps, with_grads, float8,
           out_shape=None) -> int:  # fmt: skip
    """For torch.utils.flop_counter (which sees the operator as one op, not its matmuls): the
    logits' matmul, and with gradients the two of backward, which it does in forward."""
    (n, c), v = hidden, weight[0]
    return 2 * n * c * v * (3 if with_grads else 1)


def _cast_like_linear(device_type: str):
    """An autocast rule that casts hidden and weight to the *current* autocast dtype, as autocast
    does for `F.linear`. (`torch.library.register_autocast` would fix one dtype at registration,
    but +opt=amp picks float16 or bfloat16 per run.)"""

    def autocast_kernel(hidden, weight, targets, *args):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):  # dispatch on, below autocast
            return _linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, *args)

    return autocast_kernel


_autocast_rules = torch.library.Library(OP.split("::")[0], "FRAGMENT")  # kept alive: registered
for _device_type, _key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
    _autocast_rules.impl(OP.split("::")[1], _cast_like_linear(_device_type), _key)


# ---- the public function


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    chunk_size: int = 0,
    block: int = 8192,
    num_warps: int = 16,
    float8: bool = False,
) -> torch.Tensor:
    """The mean over the N tokens of cross_entropy(hidden @ weight[:vocab_size]^T, targets):
    hidden (N, C), weight (V >= vocab_size, C), targets (N,) int64 in [0, vocab_size).

    chunk_size: tokens per chunk (0: all at once), the logits buffer's height. block, num_warps:
    the CUDA kernel's columns per step (>= V: each row in one pass) and warps per row.
    float8: the logits and the hidden states' gradient from float8 matmuls (see above).
    Gradients are computed in the forward pass only when autograd will need them."""
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, _, _ = _linear_cross_entropy(
        hidden, weight, targets, vocab_size, chunk_size, block, num_warps, with_grads, float8
    )
    return loss
