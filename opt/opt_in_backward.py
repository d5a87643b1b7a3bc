"""`+opt=opt_in_backward`: the optimizer step in backward (the book's chapter 7 trick, torchtitan's
`early_step_in_backward`). Every parameter gets a `register_post_accumulate_grad_hook`; once the
last gradient of a block (a numbered transformer layer, else the module owning the parameter) is
ready, the block's AdamW update runs and its gradients are freed: the full set of gradients
(4 bytes per parameter) never exists at once, only one block's.

A block, not a parameter, is the unit so that the host keeps up with the GPU: one optimizer call
(one multi-tensor launch of fused AdamW, one guard) per block instead of per parameter. Stepped
one parameter at a time, GPT-2 XL's 580 hooks with torchao's update left the GPU idle 45-65% of
the memory_xl `lowbit` step (docs/results/nvidia-h100-80gb-hbm3/memory_xl_lowbit_budget.md).

The update is the optimizer's own, restricted to the block: its class and implementation
(for-loop, foreach, fused, or +opt=lowbit's), its state, its current learning rate, so a run
with this stage equals one without it when nothing needs all gradients at once. What does:
- clipping by the global gradient norm: the norm needs every gradient before the first update.
  Instead each block's gradients are scaled by min(1, train.grad_clip / an estimate of the
  step's norm: the blocks in so far exact, the others as last step; `_NormEstimate`)
  (train.grad_clip=inf: none). Clipping matters: with it off, GPT-2 124M ended 0.19 nats worse
  on the plays after 300 steps (quality_noclip.md);
- accumulation (+opt=accum): each micro-batch's backward would step, not the sum of them;
- DDP and FSDP: the hook fires before the gradient is reduced over the processes;
- float16's GradScaler: it unscales and checks every gradient, then skips or steps them all.
Those combinations are refused (opt.check, opt.plan).

The non-finite guard (recipe/guard.py) acts per block here: a block with a gradient that is not
finite skips its update (on the device with fused AdamW and +opt=lowbit's AdamW; one host sync
per block with for-loop/foreach AdamW) and the step counts as bad. The other blocks' updates
stand: unlike the normal step, a bad step can be partly applied. A non-finite loss is seen only
after backward: it counts the step as bad but cannot undo the updates of blocks whose gradients
were finite.

Under +opt=compile with scope=model, the compiled backward hands every gradient over at its end:
the updates still run in backward, but the gradients all exist together (scope=block keeps the
saving, each block's backward being its own graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from base.distributed import log
from base.errors import ConfigError
from opt.stage import Context, Stage
from opt.step import LoopStep
from recipe.guard import NonFiniteGuard, step_unless


class StepInBackward(torch.optim.Optimizer):
    """`optimizer` stepped in backward, as torchtitan's in-backward optimizer container: every
    parameter is hooked so that backward steps each of `model`'s blocks as soon as the block's
    last gradient is ready (its gradients clipped against `max_norm` by an estimate of the
    step's global norm, `_NormEstimate`), then frees the block's gradients. It shares the
    optimizer's parameter groups (the learning rate the schedule sets) and state (what a
    checkpoint saves); its own `step()` has nothing left to do, and `grad_norm()` is the norm of
    the gradients the blocks stepped with."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, max_norm: float
    ) -> None:
        super().__init__(optimizer.param_groups, optimizer.defaults)  # the same group dicts
        self.state = optimizer.state
        self.inner = optimizer  # the real update, which the hooks call
        self.blocks = _Blocks(optimizer, _blocks_of(optimizer, model), max_norm)
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.register_post_accumulate_grad_hook(self.blocks.gradient_ready)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Every parameter stepped in backward already."""

    def grad_norm(self) -> torch.Tensor:
        """The norm of every gradient of the last backward (not finite if one was not)."""
        return self.blocks.take_norm()


def apply_opt_in_backward(
    optimizer: torch.optim.Optimizer,
    guard: NonFiniteGuard,
    model: torch.nn.Module,
    max_norm: float = float("inf"),
) -> StepInBackward:
    """`optimizer`, stepping each of `model`'s blocks in backward (`StepInBackward`): the
    optimizer the trainer's step steps."""
    stepped = StepInBackward(optimizer, model, max_norm)
    guard.partial_steps = True  # its error message: a bad step may be partly applied
    blocks = stepped.blocks
    clipped = (
        f", clipped to {max_norm:g} by the step's estimated norm" if max_norm < float("inf") else ""
    )
    log(
        f"[opt] opt_in_backward: {len(blocks.block_of)} parameters in {len(blocks.members)} "
        f"blocks stepped by {type(optimizer).__name__} in backward, each block's gradients "
        f"freed at once{clipped}"
    )
    return stepped


class InBackwardStep(LoopStep):
    """The loop's step under +opt=opt_in_backward: backward has stepped every block already
    (each skipping its update when its own gradients were not finite), so the norm is the one
    measured there, and the guard only counts the step's verdict."""

    def _clipped(self, max_norm: float) -> torch.Tensor:
        return cast(StepInBackward, self.optimizer).grad_norm()

    def _update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.guard.stepped(loss, grad_norm)


def _block_name(parameter_name: str) -> str:
    """The block a parameter steps with: its numbered layer ("transformer.h.3"), else the
    module that owns it ("transformer.ln_f")."""
    parts = parameter_name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or parameter_name


def _blocks_of(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[list[Any]]:
    """The optimizer's parameters by block, in the optimizer's order."""
    names = {id(p): name for name, p in model.named_parameters()}
    blocks: dict[str, list[Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names.get(id(param), f"parameter {id(param)}")  # not the model's: on its own
            blocks.setdefault(_block_name(name), []).append(param)
    return list(blocks.values())


class _Blocks:
    """The step in backward, one block at a time: a block steps when its last gradient has
    been accumulated, in one optimizer call over all its parameters (one multi-tensor launch
    with fused AdamW, one kernel per parameter with +opt=lowbit's, one guard per block)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, members: list[list[Any]], max_norm: float
    ) -> None:
        self.optimizer, self.members, self.max_norm = optimizer, members, max_norm
        self.block_of = {param: index for index, block in enumerate(members) for param in block}
        self.ready: list[list[Any]] = [[] for _ in members]
        device = members[0][0].device
        self.sq_sum = torch.zeros((), device=device)  # the gradients' squared norm so far
        self.clip = _NormEstimate(members, device) if max_norm < float("inf") else None

    def gradient_ready(self, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook: the block steps once all its gradients are in."""
        index = self.block_of[param]
        self.ready[index].append(param)
        if len(self.ready[index]) == len(self.members[index]):
            self._step(index, self.ready[index])
            self.ready[index] = []

    def _step(self, index: int, params: list[Any]) -> None:
        """The block's update unless one of its gradients is not finite (on the device with
        fused AdamW and +opt=lowbit's AdamW; one host sync per block with for-loop/foreach
        AdamW), then its gradients are dropped."""
        grads = [p.grad for p in params]
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
        squared = norms.square().sum()
        bad = ~torch.isfinite(squared)
        self.sq_sum += squared
        if self.clip is not None:
            estimate = self.clip.add(index, squared)
            coef = (self.max_norm / (estimate + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_'s
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        with _only(self.optimizer, params):
            step_unless(self.optimizer, bad)
        for param in params:
            param.grad = None

    def take_norm(self) -> torch.Tensor:
        """The norm of every gradient of the last backward (not finite if one was not). Blocks
        still waiting (a parameter that got no gradient this time) step first, with what they
        have."""
        for index, waiting in enumerate(self.ready):
            if waiting:
                self._step(index, waiting)
                self.ready[index] = []
        norm = self.sq_sum.sqrt()
        self.sq_sum = torch.zeros_like(self.sq_sum)
        if self.clip is not None:
            self.clip.next_step()
        return norm


class _NormEstimate:
    """The step's global gradient norm as well as it can be known when a block steps: the exact
    norms of the blocks in so far, plus the last step's norms of those still to come. Backward
    hands the blocks over from the last layer to the first, so the estimate tightens as it goes,
    a gradient that spikes is clipped as soon as its block arrives, and in steady training it is
    the norm `clip_grad_norm_` would see. On the first step, with no last step, the blocks still
    to come are taken to have the squared norm per parameter of those in so far.

    Why not the last step's norm alone: it leaves the first step, whose
    gradients are the run's largest, unclipped, and AdamW's second moment then remembers them
    for tens of steps (beta2 = 0.95), scaling the early updates down; and it sees a spike only a
    step late."""

    def __init__(self, members: list[list[Any]], device: torch.device) -> None:
        self.sizes = [sum(p.numel() for p in block) for block in members]
        self.total_size = sum(self.sizes)
        self.last = torch.zeros(len(members), device=device)  # each block's squared norm
        self.last_total = torch.zeros((), device=device)  # their sum: once per step, not block
        self.now = torch.zeros_like(self.last)
        self.first = True
        self._reset()

    def _reset(self) -> None:
        self.seen_sq = torch.zeros((), device=self.last.device)  # this step's, blocks in so far
        self.seen_last = torch.zeros_like(self.seen_sq)  # the last step's, same blocks
        self.seen_size = 0

    def add(self, index: int, squared: torch.Tensor) -> torch.Tensor:
        """Block `index` is in with this squared norm: the estimated global norm. A norm that is
        not finite (the block skips its update) counts as its last step's, so that the other
        blocks still step clipped as usual."""
        squared = torch.where(torch.isfinite(squared), squared, self.last[index])
        self.now[index] = squared
        self.seen_sq += squared
        self.seen_last += self.last[index]
        self.seen_size += self.sizes[index]
        if self.first:
            estimate = self.seen_sq * (self.total_size / self.seen_size)
        else:
            estimate = self.seen_sq + (self.last_total - self.seen_last).clamp(min=0.0)
        return estimate.sqrt()

    def next_step(self) -> None:
        """The step is over: its blocks' norms are the next one's "last step"."""
        self.last, self.now = self.now, self.last
        self.last_total = self.last.sum()
        self.first = False
        self._reset()


@contextlib.contextmanager
def _only(optimizer: torch.optim.Optimizer, params: list[Any]) -> Iterator[None]:
    """The optimizer restricted to `params`: their groups' hyperparameters as they are now (the
    learning rate the schedule last set), their state, its implementation. The hooks run one at
    a time while the trainer waits in backward, so nothing else sees the swapped groups."""
    chosen = {id(p) for p in params}
    groups = optimizer.param_groups
    restricted = [{**g, "params": [p for p in g["params"] if id(p) in chosen]} for g in groups]
    optimizer.param_groups = [g for g in restricted if g["params"]]
    try:
        yield
    finally:
        optimizer.param_groups = groups


def _plan(ctx: Context) -> None:
    """What the step in backward cannot do besides its conflicts: anything that needs every
    gradient before the first update. Clipping uses an estimate of the norm (`_NormEstimate`)."""
    ctx.plan.clip_in_backward = ctx.cfg.train.grad_clip
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
    "opt_in_backward", "step",
    lambda ctx: apply_opt_in_backward(
        ctx.optimizer, ctx.guard, ctx.model, ctx.plan.clip_in_backward
    ),
    plan=_plan, step=InBackwardStep,
    conflicts={
        "accum": "a step per micro-batch would not be the step of their summed gradients",
        "ddp": WOULD_STEP_BEFORE_REDUCE, "fsdp": WOULD_STEP_BEFORE_REDUCE,
        "offload": "offload steps AdamW on the CPU after backward, opt_in_backward on the GPU "
        "during it",
    },
    processes=("one", "each parameter would step before DDP reduces its gradient"),
)  # fmt: skip
