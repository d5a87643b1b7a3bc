"""One training step, as the selected stages arrange it. The loop asks a `Step` for the four
things that differ between them, and nothing else:

    forward_backward(inputs, targets)   the micro-batches' forward and backward: the step's loss
    clip_grad_norm_(max_norm)           the global gradient norm, the gradients clipped to it
    optimizer_step(loss, grad_norm)     the update unless not finite, the stages' after-step hooks
    evaluated, metrics()                what evaluation runs through; what the stages measured

`LoopStep` is the plain loop's (one module, DDP's or FSDP's wrapper included); a stage that runs
the step otherwise declares its own subclass as its `Stage.step`: +opt=pp's pipeline schedule
(opt/pp.py), +opt=opt_in_backward's update in backward (opt/opt_in_backward.py). The protocol
the loop reads is opt/stage.py's `Step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor, Placement

from opt.accum import gradient_sync
from opt.stage import Context


class LoopStep:
    """The plain loop's step: forward and backward per micro-batch (the gradients add up; across
    ranks they are reduced after the last one, or after each under FSDP: `Plan.defer_reduce`),
    each in the plan's loss context and autocast, the loss scaled by the scaler (a no-op unless
    float16); the gradients unscaled and clipped by their global norm; the optimizer step unless
    the loss or the norm is not finite (recipe/guard.py), then the selected stages'
    `after_optimizer_step` hooks."""

    def __init__(
        self,
        ctx: Context,
        scaler: torch.amp.GradScaler,
        after_optimizer_step: Sequence[Callable[[], None]],
    ) -> None:
        self.plan, self.guard, self.scaler = ctx.plan, ctx.guard, scaler
        self.model, self.module, self.optimizer = ctx.model, ctx.module, ctx.optimizer
        self.after_optimizer_step = after_optimizer_step

    @property
    def evaluated(self) -> nn.Module:
        """What the validation loss runs through: the plain model (changed in place by the
        stages), which gives `(logits, loss)` on every rank."""
        return self.model

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The step's forward and backward on this rank's batch; returns the sum of the
        micro-batch losses, on the device (no sync)."""
        plan = self.plan
        losses = torch.zeros((), device=inputs.device)
        micro_batches = zip(
            inputs.chunk(plan.micro_steps), targets.chunk(plan.micro_steps), strict=True
        )
        for micro_step, (x, y) in enumerate(micro_batches):
            last = micro_step == plan.micro_steps - 1
            sync = gradient_sync(self.module, last or not plan.defer_reduce)
            with sync, plan.loss_context():
                with plan.autocast(inputs.device):
                    _, loss = self.module(x, y)
                self.scaler.scale(loss / plan.micro_steps).backward()
            losses += loss.detach()
        return losses

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Unscales the gradients (the true ones are clipped), clips them to the global norm
        `max_norm` and returns that norm, on the device: over all ranks' shards under FSDP and
        tp."""
        self.scaler.unscale_(self.optimizer)
        reduce_pending_grads(self.params())
        return self._clipped(max_norm)

    def _clipped(self, max_norm: float) -> torch.Tensor:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params(), max_norm)
        if isinstance(grad_norm, DTensor):  # FSDP: the global norm, replicated on every rank
            grad_norm = grad_norm.full_tensor()
        return grad_norm

    def optimizer_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The update unless `loss` (this rank's) or `grad_norm` is not finite, then the stages'
        hooks, and the gradients dropped."""
        self._update(loss, grad_norm)
        for hook in self.after_optimizer_step:
            hook()
        self.optimizer.zero_grad(set_to_none=True)

    def _update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.guard.step(self.optimizer, self.scaler, loss, grad_norm)

    def metrics(self) -> dict[str, float]:
        """What the stages measured of the steps since the last log step (a collective: every
        rank calls it at the same log steps)."""
        return {}

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]


def reduce_pending_grads(params: list[torch.Tensor]) -> None:
    """Lays out each gradient still pending a sum over its group (`Partial`: under +opt=tp's
    sequence parallelism the LayerNorms' and the positions' gradients are each rank's share of
    the sequence) as its parameter, summed: before clipping, which on torch 2.11 scales no
    `Partial` gradient (measured: one was left 7.7x over the clipped norm; the LayerNorm biases
    of a tp run were 9% off the one-process run's after two steps), and before the optimizer.

    Gradients alike (mesh, placements, dtype) are summed as one flat buffer, one collective for
    all of them: one per gradient made a GPT-2 large tp step run 147 all-reduces of a few KiB
    (traced on 2 H200s: each a DTensor redistribution on the host, and a kernel that waits for
    the other rank). A sum commutes with flattening; a redistribution that is not a plain sum
    into replicas (a reduce-scatter into shards) goes gradient by gradient."""
    alike: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(x.is_partial() for x in grad.placements):
            key = (grad.device_mesh, grad.placements, p.placements, grad.dtype)  # type: ignore[attr-defined]
            alike.setdefault(key, []).append(p)
    for (mesh, pending, target, _), group in alike.items():
        if not _sums_into_replicas(pending, target):
            for p in group:
                p.grad = p.grad.redistribute(placements=target)
            continue
        shares = [p.grad.to_local() for p in group]
        flat = DTensor.from_local(_flatten_dense_tensors(shares), mesh, pending, run_check=False)
        summed = flat.redistribute(placements=target).to_local()
        for p, share in zip(group, _unflatten_dense_tensors(summed, shares), strict=True):
            grad = p.grad  # its global shape and strides: shards may be uneven (FSDP's)
            p.grad = DTensor.from_local(
                share, mesh, target, run_check=False, shape=grad.shape, stride=grad.stride()
            )


def _sums_into_replicas(pending: Sequence[Placement], target: Sequence[Placement]) -> bool:
    """Each mesh dimension either stays as it is or goes from a pending sum to a replica."""
    return all(
        a == b or (a.is_partial() and b.is_replicate())
        for a, b in zip(pending, target, strict=True)
    )
