"""What a stage is. Each `opt/<module>.py` declares its stage(s) as a `Stage`: its name (the
`conf/opt/<name>.yaml` that `+opt=<name>` selects), the phase it runs in, its knobs (a dataclass
whose field types are the rules: base/knobs.py), the stages it cannot run with and why, how many
processes it needs, an optional check of what its knobs cannot do with the rest of the config,
and `apply`. opt/__init__.py's ORDER lists them in the order they run; `opt.plan` checks every
selected stage's knobs and rules, then applies the planning phases; the model and step phases
run once the model and the optimizer exist.

    phase       apply(ctx) does                                  and returns
    batch       sets ctx.plan's batch size and micro-steps        None
    input       sets ctx.plan.loader                              None
    numerics    sets ctx.plan's precision fields                  None
    optimizer   sets ctx.plan's optimizer class and arguments     None
    model       changes ctx.model in place, or wraps ctx.module   the module to train with, or None
    step        changes how ctx.optimizer steps                   the optimizer to step, or None

Besides `apply`, a stage may declare hooks for what happens around it, each optional:

    hook                  runs                                         for
    check(ctx)            in opt.plan, before any phase                what the knobs cannot do
    plan(ctx)             in opt.plan, after the planning phases       a model or step stage's
                                                                       decisions (the mesh's
                                                                       degrees: ctx.plan.parallel)
    check_plan(ctx)       in opt.plan, last: every stage has planned   what the knobs cannot do
                                                                       with the others' decisions
                                                                       (ctx.plan.compiled, the
                                                                       parallel layout)
    unselected(ctx)       in its phase, when not selected              a process-wide reset, the
                                                                       default DDP
    check_resume(stages)  before restoring a checkpoint                refusing one it cannot read
    prepare_model(ctx)    first in opt.apply_model_stages              the plain model, from the
                                                                       plan (dtypes)
    step                  the loop's Step (opt/step.py), one stage's   a step run otherwise: the
                                                                       pipeline, the update in
                                                                       backward
    after_optimizer_step  after every optimizer step                   work on the updated weights
    checkpoint_layout     on every save and restore                    parameters DCP cannot take
                                                                       as they are (tp's QKV)

docs/adding_a_stage.md walks through adding one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from omegaconf import DictConfig
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from base.distributed import Distributed, ParallelDims
from data import LoaderOptions

if TYPE_CHECKING:
    from checkpointing import StateLayout
    from model import GPT
    from recipe.guard import NonFiniteGuard

Phase = Literal["batch", "input", "numerics", "optimizer", "model", "step"]
PHASES: tuple[Phase, ...] = ("batch", "input", "numerics", "optimizer", "model", "step")
PLANNED: tuple[Phase, ...] = ("batch", "input", "numerics", "optimizer")  # by opt.plan


@dataclass
class Plan:
    """What the selected stages decided, for the trainer to read."""

    stages: list[str]  # the selected stages, in the order they are applied
    batch_size: int  # sequences per optimizer step per rank
    micro_steps: int = 1  # gradient-accumulation micro-steps per optimizer step
    defer_fsdp_reduce: bool = False  # opt.accum.defer_fsdp_reduce: see defer_reduce
    loader: LoaderOptions = field(default_factory=LoaderOptions)
    amp_dtype: torch.dtype | None = None  # the amp stage's compute dtype; None: fp32
    pure_low_precision: bool = False  # FSDP casts the parameters to amp_dtype: no autocast
    scale_loss: bool = False  # float16: scale the loss so that small gradients survive
    residual_dtype: torch.dtype | None = None  # the residual stream's dtype; None: float32
    weights_dtype: torch.dtype | None = None  # opt.lowbit.weights: the stored weights'; None: fp32
    amp_weight_cache: bool = True  # autocast caches its weight casts (opt.amp.weight_cache)
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW  # lowbit: torchao's
    optimizer_kwargs: dict = field(default_factory=dict)
    # The parallel layout: the degrees that +opt=pp, +opt=tp and +opt=fsdp plan, and whether
    # FSDP wraps the model; the trainer builds its mesh (Distributed.with_parallel).
    parallel: ParallelDims = field(default_factory=lambda: ParallelDims(1))
    vocab_parallel_loss: bool = False  # +opt=tp's loss_parallel: see loss_context
    # What the loss's forward and backward run in, a fresh context manager per call: +opt=tp's
    # `loss_parallel` (the cross-entropy on vocabulary shards), else nothing.
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    tp_sequence_parallel: bool = False  # +opt=tp: the residual stream split over the sequence
    compiled: bool = False  # +opt=compile: the first steps compile (the loop's meter says so)
    # +opt=compile's, when a later stage builds the modules that run (a pipeline's stages, each
    # compiled whole once built): compiles a module's forward as one graph. None: nothing to do.
    compile_later: Callable[[torch.nn.Module], None] | None = None
    step_in_backward: bool = False  # opt_in_backward: each block steps from its grad hooks
    clip_in_backward: float = float("inf")  # opt_in_backward: train.grad_clip, norm estimated
    attention_kernel: str | None = None  # what computes attention, as profiled (opt/attention.py)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_steps

    @property
    def defer_reduce(self) -> bool:
        """Whether gradients are reduced over the ranks after the last micro-step only: not
        under FSDP, whose skipped reduce-scatters would keep full-size gradients between
        micro-steps (opt/accum.py), unless opt.accum.defer_fsdp_reduce asks for it."""
        return self.defer_fsdp_reduce or not self.parallel.fsdp_enabled

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """The loss scaler: a no-op unless float16. Under FSDP each rank checks only its own
        gradient shards for overflow, so the ranks must agree on skipping a step: the
        ShardedGradScaler all-reduces that verdict (it also unscales offloaded gradients).
        So does +opt=tp, whose ranks hold shards of the gradients too."""
        if self.scale_loss and (self.parallel.fully_sharded or self.parallel.tp_enabled):
            return ShardedGradScaler(device.type)
        return torch.amp.GradScaler(device.type, enabled=self.scale_loss)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Autocast to the amp dtype; none under FSDP with mixed_precision=pure, whose
        MixedPrecisionPolicy casts the parameters itself."""
        from recipe.precision import autocast

        dtype = None if self.pure_low_precision else self.amp_dtype
        return autocast(dtype, device, self.amp_weight_cache)


@dataclass
class Context:
    """What a stage's `check` and `apply` read: the config, the processes, the plan so far, the
    stage's own knobs; from the model phase on the model (changed in place) and the module to
    train with; in the step phase the optimizer and the non-finite guard."""

    dist: Distributed
    plan: Plan
    # Each set where its phase has it (None before): typed as set, since a stage reads only its
    # phase's. The whole config: in opt.plan's checks and `plan` hooks.
    cfg: DictConfig = None  # type: ignore[assignment]
    knobs: Any = None  # cfg.opt.<stage>: the fields of the stage's Knobs, checked
    model: GPT = None  # type: ignore[assignment]  # model phase on
    module: torch.nn.Module = None  # type: ignore[assignment]  # the module to train with so far
    optimizer: torch.optim.Optimizer = None  # type: ignore[assignment]  # step phase
    guard: NonFiniteGuard = None  # type: ignore[assignment]  # step phase


class Step(Protocol):
    """One training step on this rank's batch, as the selected stages run it: what the loop
    calls (train.py's train_step), implemented by the plain loop (opt/step.py's LoopStep) and
    by the stages that run it otherwise (+opt=pp, +opt=opt_in_backward: their `Stage.step`)."""

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batches' forward and backward; the sum of their losses (on the device)."""
        ...

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The gradients unscaled and clipped to the global norm `max_norm`; that norm."""
        ...

    def optimizer_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The update unless `loss` or `grad_norm` is not finite, then the stages' hooks."""
        ...

    @property
    def evaluated(self) -> torch.nn.Module:
        """What the validation loss runs through."""
        ...

    def metrics(self) -> dict[str, float]:
        """What the stages measured since the last log step (a collective)."""
        ...


@dataclass(frozen=True)
class Stage:
    name: str
    phase: Phase
    apply: Callable[[Context], Any]
    knobs: type | None = None  # a dataclass: its fields are conf/opt/<name>.yaml's keys
    conflicts: Mapping[str, str] = field(default_factory=dict)  # other stage -> why not both
    # "one": one process only; "several": needs torchrun; the reason, said with the refusal.
    processes: tuple[Literal["any", "one", "several"], str] = ("any", "")
    check: Callable[[Context], None] | None = None  # what the knobs cannot do with the config
    # A model or step stage's decisions that the trainer needs before the model exists (the
    # mesh's degrees, the precision FSDP casts to), and its checks that need the planned batch
    # or precision; run by opt.plan after the planning phases, in ORDER.
    plan: Callable[[Context], None] | None = None
    # Refuses, in one line, what the knobs cannot do with the other stages' decisions, which the
    # plan then holds whatever their order (Plan.compiled, ParallelDims' "is X on"): run by
    # opt.plan once every selected stage has planned, so that no stage asks which others were
    # selected by their names.
    check_plan: Callable[[Context], None] | None = None
    # Run in its phase when the stage is not selected: a process-wide setting reset (tf32), the
    # default DDP of a multi-process run.
    unselected: Callable[[Context], Any] | None = None
    # Refuses, in one line, resuming a checkpoint written with these stages (its `stages`).
    check_resume: Callable[[list[str]], None] | None = None
    # What the model needs before any model stage wraps it, from the plan (amp's residual
    # stream dtype, lowbit's bfloat16 weights); run first by opt.apply_model_stages, in ORDER.
    prepare_model: Callable[[Context], None] | None = None
    # The step the loop runs, when the stage runs it otherwise than the plain loop
    # (opt/step.py's LoopStep): +opt=pp's schedule, +opt=opt_in_backward's update in backward.
    step: Callable[[Context, torch.amp.GradScaler, Sequence[Callable[[], None]]], Step] | None = (
        None
    )
    # Run after every optimizer step (from Step.optimizer_step), with the stage's context: e.g.
    # a float8 stage's precomputed scales for FSDP's next all-gather.
    after_optimizer_step: Callable[[Context], None] | None = None
    # How the stage's parameters are laid out in a checkpoint when DCP or set_state_dict cannot
    # take them as they are (+opt=tp's strided QKV): checkpointing/state_layout.py's StateLayout.
    checkpoint_layout: StateLayout | None = None
