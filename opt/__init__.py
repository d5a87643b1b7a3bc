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
                                             on the module (DTensors included; under pp the
                                             head, then each stage whole once pp has built it;
                                             with FSDP or tp in pieces: each block, embed and
                                             head),
                                             and before the data-parallel wrappers (and offload's
                                             FSDP) hook into its parameters and gradients. The
                                             attention kernel is set after compile, which
                                             traces at the first step and so sees it, and whose
                                             private cache folder the FlexAttention probe
                                             compiles into. DDP wraps any multi-process run
                                             that nothing else spreads, selected or not.
    step      opt_in_backward                last, on the built optimizer: it hooks the
                                             parameters that every model stage has settled.

To add a stage: a yaml file with its knobs nested under its own name, a module that declares
its `STAGE` (opt/stage.py: its phase, knobs and hooks), one line in STAGES, and its test
(docs/adding_a_stage.md walks through one).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig

from base import knobs
from base.distributed import Distributed, ParallelDims
from base.errors import ConfigError
from checkpointing import StateLayout
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
from opt.stage import PLANNED, Context, Phase, Plan, Stage, Step
from opt.step import LoopStep
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
# What a trained model's evaluation, in one process, leaves out of its run's stages: those that
# spread training over processes, and lowbit's optimizer, which changes nothing evaluated (and
# would need torchao to plan).
NOT_EVALUATED: tuple[Stage, ...] = (ddp.STAGE, fsdp.STAGE, pp.STAGE, tp.STAGE, lowbit.STAGE)

__all__ = [
    "NOT_EVALUATED", "ORDER", "STAGES", "Plan", "Step", "apply_model_stages", "build_step",
    "check_resume", "checkpoint_layouts", "for_evaluation", "gradient_sync", "plan",
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


def for_evaluation(opt_cfg: DictConfig) -> dict[str, Any]:
    """A run's stages (its `cfg.opt`, each with its knobs) as a trained model's evaluation plans
    them in one process: without NOT_EVALUATED."""
    left_out = {stage.name for stage in NOT_EVALUATED}
    return {str(name): knobs for name, knobs in opt_cfg.items() if name not in left_out}


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
    parallel = ParallelDims(dist.world_size)  # the stages that split the model set its degrees
    p = Plan(stages=stages, batch_size=cfg.train.batch_size, parallel=parallel)
    ctx = Context(dist, p, cfg=cfg)
    _each(chosen, "check", cfg.opt, ctx)
    for phase in PLANNED:
        _run(phase, cfg.opt, ctx)
    _each(chosen, "plan", cfg.opt, ctx)
    _each(chosen, "check_plan", cfg.opt, ctx)  # every stage's decisions are in the plan now
    return p


def check_resume(p: Plan, saved_stages: list[str] | None) -> None:
    """Refuses a resume (of a checkpoint written with `saved_stages`; None: not a resume) that
    a selected stage cannot make."""
    for stage in _chosen(p):
        if saved_stages is not None and stage.check_resume:
            stage.check_resume(saved_stages)


def apply_model_stages(
    model: GPT, opt_cfg: DictConfig, p: Plan, dist: Distributed
) -> torch.nn.Module:
    """Prepares the model as the selected stages ask (their `prepare_model`: dtypes), then
    applies the model stages in their fixed order; returns the module to train with.

    `model` itself stays the plain module (changed in place), for checkpoints and sampling."""
    ctx = Context(dist, p, model=model, module=model)
    for stage in _chosen(p):
        if stage.prepare_model:
            ctx.knobs = opt_cfg.get(stage.name)
            stage.prepare_model(ctx)
    _run("model", opt_cfg, ctx)
    return ctx.module


def build_step(
    opt_cfg: DictConfig,
    p: Plan,
    guard: NonFiniteGuard,
    model: GPT,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
) -> Step:
    """Applies the stages that change how `model`'s built optimizer steps (+opt=opt_in_backward:
    in backward), then returns the step the loop runs on `module` (the model stages' module):
    the one a selected stage runs (+opt=pp's pipeline, opt_in_backward's), else the plain
    loop's, with the selected stages' `after_optimizer_step` hooks."""
    ctx = Context(guard.dist, p, model=model, module=module, optimizer=optimizer, guard=guard)
    _run("step", opt_cfg, ctx)
    hooks = [
        functools.partial(stage.after_optimizer_step, replace(ctx, knobs=opt_cfg.get(stage.name)))
        for stage in _chosen(p)
        if stage.after_optimizer_step
    ]
    make = next((stage.step for stage in _chosen(p) if stage.step), LoopStep)
    return make(ctx, scaler, hooks)


def checkpoint_layouts(p: Plan) -> list[StateLayout]:
    """How the selected stages' parameters are laid out in a checkpoint, for the checkpoint's
    save and restore (+opt=tp's strided QKV)."""
    return [stage.checkpoint_layout for stage in _chosen(p) if stage.checkpoint_layout]


def _chosen(p: Plan) -> list[Stage]:
    """The selected stages, in ORDER."""
    return [stage for stage in STAGES if stage.name in p.stages]


def _each(chosen: list[Stage], hook: str, opt_cfg: DictConfig, ctx: Context) -> None:
    """Runs the planning `hook` (check, plan, check_plan) of each chosen stage that declares it,
    in ORDER, with its knobs."""
    for stage in chosen:
        run = getattr(stage, hook)
        if run:
            ctx.knobs = opt_cfg[stage.name]
            run(ctx)


def _check_knobs(stage: Stage, node: DictConfig) -> None:
    """The stage's knobs against its Knobs dataclass (base/knobs.py), in one line."""
    if stage.knobs is not None:
        knobs.check(node, stage.knobs, f"opt.{stage.name}")
    elif node:
        key = f"opt.{stage.name}.{next(iter(node))}"
        raise ConfigError(f"{key} is not a setting: +opt={stage.name} has no knobs")


def _run(phase: Phase, opt_cfg: DictConfig, ctx: Context) -> None:
    """Applies the stages of `phase` in their order (and the unselected ones' `unselected`);
    what a model stage returns becomes the module to train with (ctx.module), what a step stage
    returns the optimizer to step (ctx.optimizer)."""
    for stage in STAGES:
        if stage.phase != phase:
            continue
        apply = stage.apply if stage.name in ctx.plan.stages else stage.unselected
        if apply is None:
            continue
        ctx.knobs = opt_cfg.get(stage.name)
        result = apply(ctx)
        if phase == "model" and isinstance(result, torch.nn.Module):
            ctx.module = result
        elif phase == "step" and isinstance(result, torch.optim.Optimizer):
            ctx.optimizer = result
