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
from collections.abc import Iterator

import torch

from recipe.distributed import log
from recipe.guard import NonFiniteGuard


def apply_opt_in_backward(optimizer: torch.optim.Optimizer, guard: NonFiniteGuard) -> int:
    """Hooks every parameter of `optimizer` so that backward steps it and frees its gradient;
    returns the number of hooked parameters."""
    hooked = 0
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            param.register_post_accumulate_grad_hook(
                functools.partial(_step_now, optimizer, index, guard)
            )
            hooked += 1
    log(
        f"[opt] opt_in_backward: {hooked} parameters stepped by {type(optimizer).__name__} in "
        "backward, each gradient freed at once"
    )
    return hooked


def _step_now(
    optimizer: torch.optim.Optimizer, group_index: int, guard: NonFiniteGuard, param: torch.Tensor
) -> None:
    """The post-accumulate-grad hook: this parameter's update, then its gradient is dropped."""
    with _only(optimizer, group_index, param):
        guard.step_parameter(optimizer, param.grad)  # type: ignore[arg-type]  # set by now
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
