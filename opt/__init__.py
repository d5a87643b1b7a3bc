"""The optimization stages. Each `conf/opt/<name>.yaml` is switched on with `+opt=<name>` and
applied by one small function in `opt/<module>.py`; this file applies them all, in one fixed
order, whatever order they were listed in:

    batch     bs -> accum                    the step's batch, then its micro-batches
    input     workers -> non_blocking        how batches reach the GPU
    numerics  tf32 -> amp                    the precision the step runs in
    optimizer forloop | foreach | fused      AdamW's implementation, or torchao's low-bit AdamW
              | lowbit
    model     custom_op -> tp -> ac          the fused head + loss replaces a piece of the model
              -> compile -> pp               before anything wraps it; tensor parallelism then
              -> ddp | fsdp | offload        splits the matmuls (checkpointing recomputes and
                                             compile traces the DTensor program; FSDP and DDP
                                             take the data-parallel dimension of its mesh);
                                             checkpointing is applied before compile so that
                                             compile traces the recomputation; compile works
                                             on the module (DTensors included; under pp in
                                             pieces: each block, embed and head), before pp
                                             splits it into stages that call those pieces, and
                                             before the data-parallel wrappers (and offload's
                                             FSDP) hook into its parameters and gradients.
    step      opt_in_backward                last, on the built optimizer: it hooks the
                                             parameters that every model stage has settled.

To add a stage: a yaml file with its knobs nested under its own name, a module with its
`apply_*` function, its name in ORDER, and its call below.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from data import LoaderOptions
from model import GPT, GPTConfig
from opt.ac import apply_ac, check_ac
from opt.accum import apply_accum, gradient_sync
from opt.amp import apply_amp
from opt.bs import apply_bs
from opt.compile import apply_compile, check_compile
from opt.custom_op import apply_custom_op, check_custom_op
from opt.ddp import apply_ddp, check_ddp
from opt.fsdp import apply_fsdp, check_fsdp, pure_low_precision
from opt.lowbit import apply_lowbit
from opt.non_blocking import apply_non_blocking
from opt.offload import apply_offload, offloads
from opt.opt_in_backward import apply_opt_in_backward
from opt.optimizer_impl import IMPLEMENTATIONS, apply_optimizer_impl
from opt.pp import Pipeline, apply_pp, check_pp
from opt.tf32 import apply_tf32
from opt.tp import apply_tp, check_tp, check_tp_model, tp_loss_context
from opt.workers import apply_workers
from recipe.distributed import Distributed, mesh_shape
from recipe.errors import ConfigError
from recipe.guard import NonFiniteGuard

ORDER = (
    "bs", "accum",
    "workers", "non_blocking",
    "tf32", "amp",
    *IMPLEMENTATIONS, "lowbit",
    "custom_op", "tp", "ac", "compile", "pp", "ddp", "fsdp", "offload",
    "opt_in_backward",
)  # fmt: skip

__all__ = [
    "ORDER", "Pipeline", "Plan", "apply_model_stages", "apply_optimizer_stages", "gradient_sync",
    "plan",
]  # fmt: skip


@dataclass
class Plan:
    """What the selected stages decided, for the trainer to read."""

    stages: list[str]  # the selected stages, in the order they are applied
    batch_size: int  # sequences per optimizer step per rank
    micro_steps: int = 1  # gradient-accumulation micro-steps per optimizer step
    defer_reduce: bool = True  # reduce gradients over ranks after the last micro-step only
    loader: LoaderOptions = field(default_factory=LoaderOptions)
    amp_dtype: torch.dtype | None = None  # the amp stage's compute dtype; None: fp32
    pure_low_precision: bool = False  # FSDP casts the parameters to amp_dtype: no autocast
    scale_loss: bool = False  # float16: scale the loss so that small gradients survive
    residual_dtype: torch.dtype | None = None  # the residual stream's dtype; None: float32
    amp_weight_cache: bool = True  # autocast caches its weight casts (opt.amp.weight_cache)
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW  # lowbit: torchao's
    optimizer_kwargs: dict = field(default_factory=dict)
    step_in_backward: bool = False  # opt_in_backward: each parameter steps from its grad hook
    tp_degree: int = 1  # +opt=tp: ranks per tensor-parallel group (Distributed.with_mesh)
    vocab_parallel_loss: bool = False  # +opt=tp's loss_parallel: see loss_context
    pp_degree: int = 1  # +opt=pp: pipeline ranks (the trainer's Distributed.with_mesh)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_steps

    def sharded(self, device: torch.device) -> bool:
        """Whether FSDP's `fully_shard` wraps the model: +opt=fsdp, or +opt=offload on a GPU."""
        return "fsdp" in self.stages or ("offload" in self.stages and offloads(device))

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """The loss scaler: a no-op unless float16. Under FSDP each rank checks only its own
        gradient shards for overflow, so the ranks must agree on skipping a step: the
        ShardedGradScaler all-reduces that verdict (it also unscales offloaded gradients).
        So does +opt=tp, whose ranks hold shards of the gradients too."""
        if self.scale_loss and (self.sharded(device) or "tp" in self.stages):
            return ShardedGradScaler(device.type)
        return torch.amp.GradScaler(device.type, enabled=self.scale_loss)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What the loss's forward and backward run in: +opt=tp's `loss_parallel()` (the
        cross-entropy on vocabulary shards), else nothing."""
        return tp_loss_context(self.vocab_parallel_loss)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Autocast to the amp dtype; none under FSDP with mixed_precision=pure, whose
        MixedPrecisionPolicy casts the parameters itself."""
        if self.amp_dtype is None or self.pure_low_precision:
            return contextlib.nullcontext()
        return torch.autocast(
            device.type, dtype=self.amp_dtype, cache_enabled=self.amp_weight_cache
        )


def selected(opt_cfg: DictConfig) -> list[str]:
    """The stages in `cfg.opt`, in application order; unknown names are refused."""
    unknown = [name for name in opt_cfg if name not in ORDER]
    if unknown:
        raise ConfigError(
            f"unknown optimization stage(s) {unknown} in cfg.opt: the code applies only "
            f"{', '.join(ORDER)} (see opt/__init__.py to add one)"
        )
    return [name for name in ORDER if name in opt_cfg]


# Pairs of stages that cannot run together, and why (opt.check names both).
CONFLICTS = {
    ("ddp", "fsdp"): "two ways to spread training",
    ("lowbit", "forloop"): "torchao's low-bit AdamW is its own implementation",
    ("lowbit", "foreach"): "torchao's low-bit AdamW is its own implementation",
    ("lowbit", "fused"): "torchao's low-bit AdamW is its own implementation",
    ("lowbit", "offload"): "two ways to shrink the optimizer state on the GPU",
    ("offload", "fsdp"): "offload is FSDP's CPU offload for one process (for several: "
    "+opt=fsdp with opt.fsdp.cpu_offload=true)",
    ("offload", "ddp"): "offload runs in one process, ddp over several",
    ("opt_in_backward", "accum"): "a step per micro-batch would not be the step of their summed "
    "gradients",
    ("opt_in_backward", "ddp"): "each parameter would step before its gradient is reduced over "
    "the processes",
    ("opt_in_backward", "fsdp"): "each parameter would step before its gradient is reduced over "
    "the processes",
    ("opt_in_backward", "offload"): "offload steps AdamW on the CPU after backward, "
    "opt_in_backward on the GPU during it",
    ("tp", "custom_op"): "the fused head + cross-entropy has no vocabulary-parallel form",
    ("tp", "offload"): "offload runs in one process, tp over several",
    ("tp", "opt_in_backward"): "each parameter would step before its gradient is reduced over "
    "the tensor-parallel ranks",
    ("pp", "accum"): "opt.pp.microbatches is the pipeline's own gradient accumulation",
    ("pp", "custom_op"): "the fused head + loss has no ignored targets, which the pipeline's "
    "evaluation pads a short batch with",
    ("pp", "ddp"): "pipeline stages with data parallelism over several pipelines are not done yet",
    ("pp", "fsdp"): "pipeline stages with data parallelism over several pipelines are not done yet",
    ("pp", "offload"): "offload runs in one process, pp over several",
    ("pp", "opt_in_backward"): "the pipeline's tied weights and global clipping need every "
    "gradient before the step",
    ("pp", "tp"): "pipeline x tensor-parallel meshes are not done yet",
}
# Stages for one process: a multi-process run wraps the model in DDP, whose gradient reduction
# runs after the hooks that step (opt_in_backward), or shards it (offload's one-process FSDP).
SINGLE_PROCESS = {
    "opt_in_backward": "each parameter would step before DDP reduces its gradient",
    "offload": "for several processes use +opt=fsdp with opt.fsdp.cpu_offload=true",
}


# The model stages' knobs, checked with the rest of the plan: before any data is prepared or
# model built (the other stages are applied, and so checked, in `plan` itself).
KNOB_CHECKS = {
    "custom_op": check_custom_op, "ac": check_ac, "compile": check_compile, "ddp": check_ddp,
    "fsdp": check_fsdp, "tp": check_tp,
}  # fmt: skip


def check(stages: list[str], dist: Distributed) -> None:
    """Refuses conflicting stages before any work starts, naming both sides."""
    impls = [s for s in stages if s in IMPLEMENTATIONS]
    if len(impls) > 1:
        raise ConfigError(
            f"+opt={impls[0]} and +opt={impls[1]} both choose AdamW's implementation: pick one"
        )
    for (a, b), why in CONFLICTS.items():
        if a in stages and b in stages:
            raise ConfigError(f"+opt={a} and +opt={b}: {why}; pick one")
    for stage, why in SINGLE_PROCESS.items():
        if stage in stages and dist.enabled:
            raise ConfigError(
                f"+opt={stage} runs in one process, this run has {dist.world_size}: {why} "
                f"(resuming its run on several processes: drop it with '~opt={stage}')"
            )
    if "fsdp" in stages and not dist.enabled:
        raise ConfigError(
            "+opt=fsdp shards the model over processes, but this is a single process: launch "
            "with `torchrun --nproc_per_node=N train.py ...` (N >= 2), or, resuming an FSDP run "
            "in one process, drop the stage: '~opt=fsdp'"
        )
    if "tp" in stages and not dist.enabled:
        raise ConfigError(
            "+opt=tp splits the model over processes, but this is a single process: launch "
            "with `torchrun --nproc_per_node=N train.py ...` (N a multiple of opt.tp.degree), "
            "or, resuming a tp run in one process, drop the stage: '~opt=tp'"
        )
    if "ddp" in stages and not dist.enabled:
        warnings.warn(
            "+opt=ddp has no effect in a single process: launch with torchrun to use it",
            stacklevel=2,
        )


def plan(cfg: DictConfig, dist: Distributed) -> Plan:
    """Validates the selected stages together and applies the ones that shape the batch, the
    input pipeline, the numerics and the optimizer. Model stages: `apply_model_stages`."""
    stages = selected(cfg.opt)
    check(stages, dist)
    opt, device = cfg.opt, dist.device
    for stage in stages:
        if stage in KNOB_CHECKS:
            KNOB_CHECKS[stage](opt[stage])
    p = Plan(stages=stages, batch_size=cfg.train.batch_size)
    if "bs" in stages:
        p.batch_size = apply_bs(opt.bs)
    if "accum" in stages:
        p.micro_steps, p.defer_reduce = apply_accum(p.batch_size, opt.accum, "fsdp" in stages)
    if "workers" in stages:
        p.loader = apply_workers(p.loader, opt.workers)
    if "non_blocking" in stages:
        p.loader = apply_non_blocking(p.loader, device)
    apply_tf32("tf32" in stages)  # sets (or resets) the global matmul precision
    if "amp" in stages:
        p.amp_dtype, p.scale_loss, p.residual_dtype, p.amp_weight_cache = apply_amp(opt.amp, device)
        p.pure_low_precision = "fsdp" in stages and pure_low_precision(opt.fsdp)
    for impl in IMPLEMENTATIONS:
        if impl in stages:
            p.optimizer_kwargs = apply_optimizer_impl(impl, device)
    if "lowbit" in stages:
        p.optimizer_class = apply_lowbit(opt.lowbit)
    if "tp" in stages:
        p.tp_degree = plan_tp(cfg, dist)
        p.vocab_parallel_loss = opt.tp.loss_parallel
    if "opt_in_backward" in stages:
        check_step_in_backward(cfg.train.grad_clip, p.scale_loss)
        p.step_in_backward = True
    if "pp" in stages:
        check_pp(cfg, batch_size=p.batch_size, world_size=dist.world_size, scale_loss=p.scale_loss)
        p.pp_degree = opt.pp.degree
    return p


def plan_tp(cfg: DictConfig, dist: Distributed) -> int:
    """+opt=tp's degree, checked against the process count and the model before any work (the
    trainer builds the mesh from it: `dist.with_mesh(tp=plan.tp_degree)`)."""
    degree = cfg.opt.tp.degree
    mesh_shape(dist.world_size, 1, degree)  # refuses a process count that degree does not divide
    m = cfg.model  # a pretrained model's own shape is checked again by apply_tp
    shape = GPTConfig(n_head=m.n_head, n_embd=m.n_embd, vocab_size=m.vocab_size,
                      pad_vocab_to=m.pad_vocab_to)  # fmt: skip
    check_tp_model(degree, shape)
    return degree


def check_step_in_backward(grad_clip: float, scale_loss: bool) -> None:
    """What +opt=opt_in_backward cannot do besides the stages that check() refuses: anything
    that needs every gradient before the first update."""
    if grad_clip != float("inf"):
        raise ConfigError(
            f"+opt=opt_in_backward with train.grad_clip={grad_clip}: clipping by the global "
            "gradient norm needs every gradient before the first update, but each parameter "
            "steps as soon as its own is ready: set train.grad_clip=inf (no clipping)"
        )
    if scale_loss:
        raise ConfigError(
            "+opt=opt_in_backward and +opt=amp with opt.amp.dtype=float16: the GradScaler "
            "unscales and checks every gradient before it steps or skips them all, but each "
            "parameter steps as soon as its own is ready: use opt.amp.dtype=bfloat16 (no scaler)"
        )


def apply_model_stages(model: GPT, opt: DictConfig, p: Plan, dist: Distributed) -> torch.nn.Module:
    """Applies the model stages in their fixed order; returns the module to train with.

    `model` itself stays the plain module (changed in place), for checkpoints and sampling.
    A multi-process run without +opt=fsdp uses DDP with conf/opt/ddp.yaml's knobs."""
    model.residual_dtype = p.residual_dtype  # opt.amp.residual (planned with the numerics)
    if "custom_op" in p.stages:
        apply_custom_op(model, opt.custom_op)
    if "tp" in p.stages:
        apply_tp(model, opt.tp, dist)
    if "ac" in p.stages:
        apply_ac(model, opt.ac)
    if "compile" in p.stages:  # under pp in pieces (each block, embed, head), as under FSDP
        apply_compile(model, opt.compile, sharded=p.sharded(dist.device) or "pp" in p.stages)
    if "pp" in p.stages:  # each rank keeps its stages of `model`; the pipeline runs them
        return apply_pp(model, opt.pp, dist, lambda: p.autocast(dist.device), p.batch_size)
    if "fsdp" in p.stages:
        return apply_fsdp(model, opt.fsdp, dist, p.amp_dtype)
    if "offload" in p.stages:
        return apply_offload(model, opt.offload, dist, p.amp_dtype)
    if dist.dp_size > 1:  # replicas to keep in step (a tp group alone needs none)
        return apply_ddp(model, opt.get("ddp"), dist)
    return model


def apply_optimizer_stages(
    optimizer: torch.optim.Optimizer, p: Plan, guard: NonFiniteGuard
) -> None:
    """Applies the stages that change when the built optimizer steps: +opt=opt_in_backward."""
    if p.step_in_backward:
        apply_opt_in_backward(optimizer, guard)
