"""The optimization stages. Each `conf/opt/<name>.yaml` is switched on with `+opt=<name>` and
declared by its module in `opt/` (opt/stage.py: its knobs, phase, conflicts, process rule,
apply). STAGES lists them in the one order they run, whatever order they were listed in:

    batch     bs -> accum                    the step's batch, then its micro-batches
    input     workers -> non_blocking        how batches reach the GPU
    numerics  tf32 -> amp                    the precision the step runs in
    optimizer forloop | foreach | fused      AdamW's implementation, or torchao's low-bit AdamW
              | lowbit
    model     custom_op -> float8 -> tp      the fused head + loss replaces a piece of the model
              -> ac -> compile -> attention  before anything wraps it; float8 then swaps the
              -> pp -> fsdp | offload | ddp  Linear modules for torchao's, before anything
                                             splits, wraps or traces them (torchao's float8
                                             tensor-parallel plans and FSDP's float8 all-gather
                                             act on the swapped modules, and compile traces
                                             their casts into its kernels; the head is no
                                             Linear that float8 converts, so custom_op's order
                                             with it is free); tensor parallelism then
                                             splits the matmuls (checkpointing recomputes and
                                             compile traces the DTensor program; FSDP and DDP
                                             take the data-parallel dimension of its mesh);
                                             checkpointing is applied before compile so that
                                             compile traces the recomputation; compile works
                                             on the module (DTensors included; under pp in
                                             pieces: each block, embed and head), before pp
                                             splits it into stages that call those pieces, and
                                             before the data-parallel wrappers (and offload's
                                             FSDP) hook into its parameters and gradients. The
                                             attention kernel is set after compile, which
                                             traces at the first step and so sees it, and whose
                                             private cache folder the FlexAttention probe
                                             compiles into. DDP wraps any multi-process run
                                             that nothing else spreads, selected or not.
    step      opt_in_backward                last, on the built optimizer: it hooks the
                                             parameters that every model stage has settled.

To add a stage: a yaml file with its knobs nested under its own name, a module that declares
its `STAGE` (opt/stage.py), and one line in STAGES.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from model import GPT
from opt import (
    ac,
    accum,
    amp,
    attention,
    bs,
    compile,
    custom_op,
    ddp,
    float8,
    fsdp,
    lowbit,
    non_blocking,
    offload,
    opt_in_backward,
    optimizer_impl,
    pp,
    tf32,
    tp,
    workers,
)  # fmt: skip
from opt.accum import gradient_sync
from opt.pp import Pipeline
from opt.stage import PLANNED, Context, Phase, Plan, Stage
from recipe import knobs
from recipe.distributed import Distributed
from recipe.errors import ConfigError
from recipe.guard import NonFiniteGuard

STAGES: tuple[Stage, ...] = (
    bs.STAGE, accum.STAGE,
    workers.STAGE, non_blocking.STAGE,
    tf32.STAGE, amp.STAGE,
    optimizer_impl.FORLOOP, optimizer_impl.FOREACH, optimizer_impl.FUSED, lowbit.STAGE,
    custom_op.STAGE, float8.STAGE, tp.STAGE, ac.STAGE, compile.STAGE, attention.STAGE,
    pp.STAGE, fsdp.STAGE, offload.STAGE, ddp.STAGE,
    opt_in_backward.STAGE,
)  # fmt: skip
ORDER = tuple(stage.name for stage in STAGES)  # their names, in that order

__all__ = [
    "ORDER", "STAGES", "Pipeline", "Plan", "apply_model_stages", "apply_optimizer_stages",
    "check_resume", "clip_grad_norm_", "gradient_sync", "plan", "stage_metrics",
]  # fmt: skip


def selected(opt_cfg: DictConfig) -> list[str]:
    """The stages in `cfg.opt`, in application order; unknown names are refused."""
    unknown = [name for name in opt_cfg if name not in ORDER]
    if unknown:
        raise ConfigError(
            f"unknown optimization stage(s) {unknown} in cfg.opt: the code applies only "
            f"{', '.join(ORDER)} (see opt/__init__.py to add one)"
        )
    return [name for name in ORDER if name in opt_cfg]


def check(stages: list[str], dist: Distributed) -> None:
    """Refuses conflicting stages, and stages run on the wrong number of processes, before any
    work starts, naming both sides and how to fix it."""
    chosen = [s for s in STAGES if s.name in stages]
    for stage in chosen:
        for other, why in stage.conflicts.items():
            if other in stages:
                raise ConfigError(f"+opt={stage.name} and +opt={other}: {why}; pick one")
    for stage in chosen:
        rule, why = stage.processes
        if rule == "one" and dist.enabled:
            raise ConfigError(
                f"+opt={stage.name} runs in one process, this run has {dist.world_size}: {why} "
                f"(resuming its run on several processes: drop it with '~opt={stage.name}')"
            )
        if rule == "several" and not dist.enabled:
            raise ConfigError(
                f"+opt={stage.name} spreads the model over processes, but this is a single "
                f"process: {why}, or, resuming its run in one process, drop the stage: "
                f"'~opt={stage.name}'"
            )


def plan(cfg: DictConfig, dist: Distributed) -> Plan:
    """Checks every selected stage (conflicts, process count, each knob against its rule, what
    the knobs cannot do with the rest of the config), then applies the phases that shape the
    batch, the input pipeline, the numerics and the optimizer, and the model and step stages'
    decisions the trainer needs early. All before any data is prepared or model built."""
    stages = selected(cfg.opt)
    chosen = [s for s in STAGES if s.name in stages]
    for stage in chosen:  # the knobs first: a typo is the first thing to hear about
        _check_knobs(stage, cfg.opt[stage.name])
    check(stages, dist)
    p = Plan(stages=stages, batch_size=cfg.train.batch_size)
    ctx = Context(dist, p, cfg=cfg)
    for stage in chosen:
        if stage.check:
            ctx.knobs = cfg.opt[stage.name]
            stage.check(ctx)
    for phase in PLANNED:
        _run(phase, cfg.opt, ctx)
    for stage in chosen:
        if stage.plan:
            ctx.knobs = cfg.opt[stage.name]
            stage.plan(ctx)
    return p


def check_resume(p: Plan, saved_stages: list[str] | None) -> None:
    """Refuses a resume (of a checkpoint written with `saved_stages`; None: not a resume) that
    a selected stage cannot make."""
    for stage in STAGES:
        if saved_stages is not None and stage.name in p.stages and stage.check_resume:
            stage.check_resume(saved_stages)


def apply_model_stages(model: GPT, opt: DictConfig, p: Plan, dist: Distributed) -> torch.nn.Module:
    """Applies the model stages in their fixed order; returns the module to train with.

    `model` itself stays the plain module (changed in place), for checkpoints and sampling."""
    model.residual_dtype = p.residual_dtype  # opt.amp.residual (planned with the numerics)
    if p.weights_dtype is not None:  # opt.lowbit.weights=bfloat16: before any stage wraps it
        lowbit.store_matrices_in(model, p.weights_dtype)
    return _run("model", opt, Context(dist, p, model=model, module=model)) or model


def apply_optimizer_stages(
    optimizer: torch.optim.Optimizer, p: Plan, guard: NonFiniteGuard, model: GPT
) -> None:
    """Applies the stages that change how `model`'s built optimizer steps: +opt=opt_in_backward
    (which steps `model`'s blocks); sets `p.after_step`, what the trainer calls after each
    step: the selected stages' `after_optimizer_step` (+opt=float8's scales), in ORDER."""
    context = Context(guard.dist, p, model=model, optimizer=optimizer, guard=guard)
    _run("step", DictConfig({}), context)
    hooks = [
        s.after_optimizer_step for s in STAGES if s.name in p.stages and s.after_optimizer_step
    ]
    if hooks:
        p.after_step = functools.partial(_after_optimizer_step, hooks, context)


def _after_optimizer_step(hooks: list[Callable[[Context], None]], context: Context) -> None:
    for hook in hooks:
        hook(context)


def clip_grad_norm_(
    train_model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
) -> torch.Tensor:
    """Clips the step's gradients to the global norm `max_norm` and returns that norm (on the
    device): over every pipeline stage under +opt=pp, as measured in backward under
    +opt=opt_in_backward (which refuses clipping), over all ranks' shards under FSDP."""
    tp.reduce_pending_grads([p for group in optimizer.param_groups for p in group["params"]])
    if isinstance(train_model, Pipeline):
        return train_model.clip_grad_norm_(max_norm)
    measured = opt_in_backward.grad_norm_measured(optimizer)
    if measured is not None:
        return measured
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(grad_norm, DTensor):  # FSDP: the global norm, replicated on every rank
        grad_norm = grad_norm.full_tensor()
    return grad_norm


def stage_metrics(train_model: torch.nn.Module) -> dict[str, float]:
    """What the model stages measure of the steps since the last log step (every rank calls
    it: a collective): +opt=pp's bubble, measured and in theory."""
    return train_model.bubble_metrics() if isinstance(train_model, Pipeline) else {}


def _check_knobs(stage: Stage, node: DictConfig) -> None:
    """The stage's knobs against its Knobs dataclass (recipe/knobs.py), in one line."""
    if stage.knobs is not None:
        knobs.check(node, stage.knobs, f"opt.{stage.name}")
    elif node:
        key = f"opt.{stage.name}.{next(iter(node))}"
        raise ConfigError(f"{key} is not a setting: +opt={stage.name} has no knobs")


def _run(phase: Phase, opt: DictConfig, ctx: Context) -> torch.nn.Module | None:
    """Applies the stages of `phase` in their order (and the unselected ones' `unselected`);
    returns the module to train with (model phase)."""
    for stage in STAGES:
        if stage.phase != phase:
            continue
        apply = stage.apply if stage.name in ctx.plan.stages else stage.unselected
        if apply is None:
            continue
        ctx.knobs = opt.get(stage.name)
        result = apply(ctx)
        if phase == "model" and isinstance(result, torch.nn.Module):
            ctx.module = result
    return ctx.module
