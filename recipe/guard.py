"""The non-finite guard: a step whose loss or gradient norm is NaN or infinite is skipped (the
weights and the optimizer state stay as they were), counted and logged; `train.max_bad_steps`
such steps in a row stop the run with an error that names the step and what to try.

It adds no host-device synchronisation where the optimizer can skip on a device flag: fused AdamW
reads `found_inf` itself (as it does for the GradScaler), and float16's GradScaler already skips
steps whose gradients overflowed. The for-loop and foreach implementations cannot, so for them
the guard reads the flag on the host once a step (one sync; use +opt=fused to avoid it).
Across ranks the flag is reduced, so every rank skips the same steps.

Under +opt=opt_in_backward each parameter steps from its gradient hook, during backward
(`step_parameter`): a parameter whose gradient is not finite skips its own update, and the step
counts as bad if any did or if the loss is not finite (`steps_in_backward_done`). The parameters
updated before a bad gradient turned up keep their updates: such a step can be partly applied.
There a sync per parameter would stall backward, so torchao's low-bit AdamW (no device flag, but
a tensor learning rate) skips on the device: a zero gradient at learning rate 0.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist

from recipe.distributed import Distributed
from recipe.errors import Reported


class NonFiniteSteps(Reported, RuntimeError):
    """Too many consecutive non-finite steps: the run cannot go on (its line, exit status 1)."""


class NonFiniteGuard:
    def __init__(self, device: torch.device, dist: Distributed, max_bad_steps: int) -> None:
        self.dist, self.max_bad_steps = dist, max_bad_steps
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # since the start
        self.in_a_row = torch.zeros((), dtype=torch.int64, device=device)
        # +opt=opt_in_backward: this step's sum of squared gradient norms and any bad gradient,
        # gathered parameter by parameter while backward runs.
        self.grad_sq_sum = torch.zeros((), device=device)
        self.bad_grad = torch.zeros((), dtype=torch.bool, device=device)
        self.stepped_in_backward = False  # set by the first step_parameter: for the error message

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
    ) -> None:
        """The optimizer step, unless `loss` (this rank's) or `grad_norm` (global) is not finite.
        Call it after `scaler.unscale_` and clipping, in place of `scaler.step(optimizer)`."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if self.dist.enabled and bad.is_cuda:  # a NaN loss on one rank skips the step on all
            bad = bad.to(torch.int32)
            torch_dist.all_reduce(bad, op=torch_dist.ReduceOp.MAX)
            bad = bad.bool()
        elif self.dist.enabled:
            bad = torch.tensor(self.dist.any(bool(bad)))
        if scaler.is_enabled():
            # The scaler skips on overflowing gradients by itself; a non-finite loss with finite
            # gradients (an infinite target logit) must skip too: fold the flag into the scaler's
            # own per-device verdicts, which `step` reads (and `update` then lowers the scale).
            verdicts = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            for found_inf in verdicts.values():
                torch.maximum(found_inf, bad.to(found_inf), out=found_inf)
            scaler.step(optimizer)
            scaler.update()
        else:
            _step_unless(optimizer, bad)
        self._count(bad)

    def step_parameter(self, optimizer: torch.optim.Optimizer, grad: torch.Tensor) -> None:
        """+opt=opt_in_backward, from a gradient hook: `optimizer` (restricted to the one
        parameter whose gradient `grad` is) steps unless `grad` is not finite. Its norm is kept
        for the step's gradient norm; its verdict for the step's."""
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
        bad = ~torch.isfinite(norm)
        self.grad_sq_sum += norm.square()
        self.bad_grad |= bad
        self.stepped_in_backward = True
        if _skips_at_zero_lr(optimizer):
            _step_at_zero_lr_unless_finite(optimizer, grad, bad)
        else:
            _step_unless(optimizer, bad)

    def steps_in_backward_done(self, loss: torch.Tensor) -> torch.Tensor:
        """+opt=opt_in_backward, after backward: counts the step as bad if a parameter skipped
        its update or `loss` is not finite; returns the gradient norm (on the device)."""
        self._count(self.bad_grad | ~torch.isfinite(loss))
        grad_norm = self.grad_sq_sum.sqrt()
        self.grad_sq_sum.zero_()
        self.bad_grad.zero_()
        return grad_norm

    def _count(self, bad: torch.Tensor) -> None:
        self.skipped += bad
        self.in_a_row = (self.in_a_row + 1) * bad

    def check(self, step: int, scale: float | None) -> dict[str, int]:
        """At a log point (a sync): the count so far, or an error if too many in a row."""
        skipped, in_a_row = int(self.skipped), int(self.in_a_row)
        if in_a_row >= self.max_bad_steps:
            scaled = f" (float16 loss scale now {scale:g})" if scale else ""
            weights, clip = (
                ("Parameters whose gradients stayed finite were updated all the same "
                 "(+opt=opt_in_backward steps each in backward).", "dropping +opt=opt_in_backward "
                 "to clip gradients (train.grad_clip)")
                if self.stepped_in_backward
                else ("The weights are those of the last good step.", "a lower train.grad_clip")
            )  # fmt: skip
            raise NonFiniteSteps(
                f"step {step}: the last {in_a_row} steps had a non-finite loss or gradient and "
                f"were skipped{scaled}; train.max_bad_steps={self.max_bad_steps}. {weights} Try a "
                "lower train.lr, +opt=amp with opt.amp.dtype=bfloat16 instead of float16, or "
                f"{clip}."
            )
        return {"train/skipped_steps": skipped}


def _skips_at_zero_lr(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a bad parameter must skip as zeros at learning rate 0: no `found_inf` flag (not
    fused) but a tensor learning rate the update reads on the device (torchao's low-bit AdamW)."""
    return not optimizer.defaults.get("fused") and torch.is_tensor(optimizer.param_groups[0]["lr"])


def _step_at_zero_lr_unless_finite(
    optimizer: torch.optim.Optimizer, grad: torch.Tensor, bad: torch.Tensor
) -> None:
    """One parameter's step without reading `bad` on the host: a bad gradient becomes zeros and
    the learning rate 0, so the weights stay exactly as they were; the moments decay one step
    (as for a zero gradient) and the step count advances. A sync per parameter instead (as
    `_step_unless` does) would stall every gradient hook of backward: measured on GPT-2 XL with
    torchao's AdamW8bit, the GPU idled 65% of the step."""
    group = optimizer.param_groups[0]
    lr = group["lr"]
    grad.masked_fill_(bad, 0.0)
    group["lr"] = torch.where(bad, 0.0, lr)  # on the flag's device: the update reads it there
    try:
        optimizer.step()
    finally:
        group["lr"] = lr


def _step_unless(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """`optimizer.step()` unless the device flag `bad` is set."""
    if optimizer.defaults.get("fused"):
        # Fused AdamW skips on this flag, on the device. Parameters offloaded to the host (FSDP's
        # CPU offload) need it in host memory first: fused AdamW would copy it asynchronously,
        # and a CPU kernel could read it before the copy lands; this copy waits.
        params_device = optimizer.param_groups[0]["params"][0].device
        optimizer.found_inf = bad.to(params_device).float()  # type: ignore[attr-defined]
        optimizer.step()
        del optimizer.found_inf  # type: ignore[attr-defined]
    elif not bad.item():  # the for-loop/foreach kernels have no such flag: one sync
        optimizer.step()
