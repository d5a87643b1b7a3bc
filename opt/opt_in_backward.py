"""`+opt=opt_in_backward`: the optimizer step in backward (the book's chapter 7 trick, torchtitan's
`early_step_in_backward`). Every parameter gets a `register_post_accumulate_grad_hook` that runs
its AdamW update as soon as backward has finished its gradient, then frees that gradient: the
full set of gradients (4 bytes per parameter) never exists at once.

The update is the optimizer's own, restricted to one parameter: its class and implementation
(for-loop, foreach, fused, or torchao's low-bit AdamW), its state, its current learning rate, so
a run with this stage equals one without it when nothing needs all gradients at once. What does:
- clipping by the global gradient norm (`train.grad_clip` must be inf): the norm needs every
  gradient before the first update;
- accumulation (+opt=accum): each micro-batch's backward would step, not the sum of them;
- DDP and FSDP: the hook fires before the gradient is reduced over the processes;
- float16's GradScaler: it unscales and checks every gradient, then skips or steps them all.
Those combinations are refused (opt.check, opt.plan).

The non-finite guard (recipe/guard.py) acts per parameter here: a hook whose gradient is not
finite skips that parameter's update (on the device with fused AdamW; with torchao's low-bit
AdamW on the device too, as a zero gradient at learning rate 0: the weights stay, the moments
decay one step; one host sync per parameter with for-loop/foreach AdamW) and the step counts as
bad. The other parameters' updates stand: unlike the normal step, a bad step can be partly
applied. A non-finite loss is seen only after backward: it counts the step as bad but cannot
undo the updates of parameters whose gradients were finite.

Under +opt=compile with scope=model, the compiled backward hands every gradient over at its end:
the updates still run in backward, but the gradients all exist together (scope=block keeps the
saving, each block's backward being its own graph).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from opt.lowbit import skips_at_zero_lr, step_at_zero_lr_unless
from opt.stage import Context, Stage
from recipe.distributed import log
from recipe.errors import ConfigError
from recipe.guard import NonFiniteGuard, step_unless


def apply_opt_in_backward(optimizer: torch.optim.Optimizer, guard: NonFiniteGuard) -> int:
    """Hooks every parameter of `optimizer` so that backward steps it and frees its gradient,
    and makes `optimizer.step()` do nothing (the trainer's step finds the work done, as with
    torchtitan's in-backward optimizer container); returns the number of hooked parameters."""
    measured = _GradNorm(optimizer)
    step = optimizer.step  # the real update, for the hooks (restricted to one parameter)
    hooked = 0
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            param.register_post_accumulate_grad_hook(
                functools.partial(_step_now, optimizer, step, index, measured)
            )
            hooked += 1
    # The trainer's step (recipe/guard.py) hands this optimizer the step's verdict as fused AdamW
    # gets it, without a sync: there is nothing left to skip.
    optimizer.step = _stepped_in_backward  # type: ignore[method-assign,assignment]
    optimizer.reads_found_inf = True  # type: ignore[attr-defined]
    _MEASURED[optimizer] = measured
    guard.partial_steps = True  # its error message: a bad step may be partly applied
    log(
        f"[opt] opt_in_backward: {hooked} parameters stepped by {type(optimizer).__name__} in "
        "backward, each gradient freed at once"
    )
    return hooked


def _stepped_in_backward(*args: Any, **kwargs: Any) -> None:
    """The optimizer's `step()` under +opt=opt_in_backward: every parameter stepped already."""


class _GradNorm:
    """The step's gradient norm, gathered parameter by parameter while backward runs."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        device = optimizer.param_groups[0]["params"][0].device
        self.sq_sum = torch.zeros((), device=device)

    def take(self) -> torch.Tensor:
        """The norm of every gradient of the last backward (not finite if one was not)."""
        norm = self.sq_sum.sqrt()
        self.sq_sum = torch.zeros_like(self.sq_sum)
        return norm


_MEASURED: weakref.WeakKeyDictionary[torch.optim.Optimizer, _GradNorm] = weakref.WeakKeyDictionary()


def grad_norm_measured(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The gradient norm of the step that `optimizer` took in backward; None for an optimizer
    that steps after backward (its gradients are all there to measure)."""
    measured = _MEASURED.get(optimizer)
    return measured.take() if measured else None


def _step_now(
    optimizer: torch.optim.Optimizer,
    step: Callable[[], Any],
    group_index: int,
    measured: _GradNorm,
    param: torch.Tensor,
) -> None:
    """The post-accumulate-grad hook: this parameter's update unless its gradient is not finite
    (on the device with fused AdamW and with torchao's low-bit AdamW; one host sync per
    parameter with for-loop/foreach AdamW), then its gradient is dropped."""
    grad = param.grad
    assert grad is not None  # the hook runs once it is accumulated
    norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
    bad = ~torch.isfinite(norm)
    measured.sq_sum += norm.square()
    with _only(optimizer, group_index, param):
        if skips_at_zero_lr(optimizer):
            step_at_zero_lr_unless(optimizer, grad, bad, step)
        else:
            step_unless(optimizer, bad, step)
    param.grad = None


@contextlib.contextmanager
def _only(
    optimizer: torch.optim.Optimizer, group_index: int, param: torch.Tensor
) -> Iterator[None]:
    """The optimizer restricted to `param`: its group's hyperparameters as they are now (the
    learning rate the schedule last set), its state, its implementation. The hooks run one at a
    time while the trainer waits in backward, so nothing else sees the swapped groups."""
    groups = optimizer.param_groups
    optimizer.param_groups = [{**groups[group_index], "params": [param]}]
    try:
        yield
    finally:
        optimizer.param_groups = groups


def _plan(ctx: Context) -> None:
    """What the step in backward cannot do besides its conflicts: anything that needs every
    gradient before the first update."""
    grad_clip = ctx.cfg.train.grad_clip
    if grad_clip != float("inf"):
        raise ConfigError(
            f"+opt=opt_in_backward with train.grad_clip={grad_clip}: clipping by the global "
            "gradient norm needs every gradient before the first update, but each parameter "
            "steps as soon as its own is ready: set train.grad_clip=inf (no clipping)"
        )
    if ctx.plan.scale_loss:
        raise ConfigError(
            "+opt=opt_in_backward and +opt=amp with opt.amp.dtype=float16: the GradScaler "
            "unscales and checks every gradient before it steps or skips them all, but each "
            "parameter steps as soon as its own is ready: use opt.amp.dtype=bfloat16 (no scaler)"
        )
    ctx.plan.step_in_backward = True


WOULD_STEP_BEFORE_REDUCE = (
    "each parameter would step before its gradient is reduced over the processes"
)
STAGE = Stage(
    "opt_in_backward", "step", lambda ctx: apply_opt_in_backward(ctx.optimizer, ctx.guard),
    plan=_plan,
    conflicts={
        "accum": "a step per micro-batch would not be the step of their summed gradients",
        "ddp": WOULD_STEP_BEFORE_REDUCE, "fsdp": WOULD_STEP_BEFORE_REDUCE,
        "offload": "offload steps AdamW on the CPU after backward, opt_in_backward on the GPU "
        "during it",
    },
    processes=("one", "each parameter would step before DDP reduces its gradient"),
)  # fmt: skip
