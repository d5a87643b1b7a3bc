"""The non-finite guard: a step whose loss or gradient norm is NaN or infinite is skipped (the
weights and the optimizer state stay as they were), counted and logged; `train.max_bad_steps`
such steps in a row stop the run with an error that names the step and what to try.

It adds no host-device synchronisation where the optimizer can skip on a device flag: fused AdamW
reads `found_inf` itself (as it does for the GradScaler), so does +opt=lowbit's AdamW (marked
`skips_on_found_inf`), and float16's GradScaler already skips
steps whose gradients overflowed. The for-loop and foreach implementations cannot, so for them
the guard reads the flag on the host once a step (one sync; use +opt=fused to avoid it).
Across ranks the flag is reduced, so every rank skips the same steps.

A step the optimizer took before the verdict (+opt=opt_in_backward's, each block in backward,
skipping itself when its own gradients are not finite: opt/opt_in_backward.py) is only counted
(`stepped`): there is nothing left to skip, and nothing to sync for.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist

from base.distributed import Distributed
from base.errors import Reported


class NonFiniteSteps(Reported, RuntimeError):
    """The run diverged: too many consecutive non-finite steps. It cannot go on (its line, exit
    status 1)."""


class NonFiniteGuard:
    def __init__(self, device: torch.device, dist: Distributed, max_bad_steps: int) -> None:
        self.dist, self.max_bad_steps = dist, max_bad_steps
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # since the start
        self.in_a_row = torch.zeros((), dtype=torch.int64, device=device)
        self.partial_steps = False  # +opt=opt_in_backward: a bad step may be partly applied

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
    ) -> None:
        """The optimizer step, unless `loss` (this rank's) or `grad_norm` (global) is not finite.
        Call it after `scaler.unscale_` and clipping, in place of `scaler.step(optimizer)`."""
        bad = self._verdict(loss, grad_norm)
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
            step_unless(optimizer, bad)
        self._count(bad)

    def stepped(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Counts a step that the optimizer took already, in backward, unless `loss` or
        `grad_norm` is not finite (+opt=opt_in_backward: each block skipped its own update)."""
        self._count(self._verdict(loss, grad_norm))

    def _verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether the step is bad on any rank: a device flag."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if self.dist.enabled and bad.is_cuda:  # a NaN loss on one rank skips the step on all
            bad = bad.to(torch.int32)
            torch_dist.all_reduce(bad, op=torch_dist.ReduceOp.MAX)
            bad = bad.bool()
        elif self.dist.enabled:
            bad = torch.tensor(self.dist.any(bool(bad)))
        return bad

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
                if self.partial_steps
                else ("The weights are those of the last good step.", "a lower train.grad_clip")
            )  # fmt: skip
            raise NonFiniteSteps(
                f"step {step}: the last {in_a_row} steps had a non-finite loss or gradient and "
                f"were skipped{scaled}; train.max_bad_steps={self.max_bad_steps}. {weights} Try a "
                "lower train.lr, +opt=amp with opt.amp.dtype=bfloat16 instead of float16, or "
                f"{clip}."
            )
        return {"train/skipped_steps": skipped}


def step_unless(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """`optimizer.step()` unless the device flag `bad` is set (+opt=opt_in_backward's hooks call
    it with the optimizer restricted to one block)."""
    # The optimizer's own step reads the flag (fused AdamW, +opt=lowbit's): no sync.
    skips_on_flag = optimizer.defaults.get("fused") or getattr(optimizer, "skips_on_found_inf", 0)
    if skips_on_flag:
        # Fused AdamW skips on this flag, on the device. Parameters offloaded to the host (FSDP's
        # CPU offload) need it in host memory first: fused AdamW would copy it asynchronously,
        # and a CPU kernel could read it before the copy lands; this copy waits.
        params_device = optimizer.param_groups[0]["params"][0].device
        optimizer.found_inf = bad.to(params_device).float()  # type: ignore[attr-defined]
        optimizer.step()
        del optimizer.found_inf  # type: ignore[attr-defined]
    elif not bad.item():  # the for-loop/foreach kernels have no such flag: one sync
        optimizer.step()
