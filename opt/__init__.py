"""The optimization stages. Each `conf/opt/<name>.yaml` is switched on with `+opt=<name>` and
applied by one small function in `opt/<module>.py`; this file applies them all, in one fixed
order, whatever order they were listed in:

    batch     bs -> accum                    the step's batch, then its micro-batches
    input     workers -> non_blocking        how batches reach the GPU
    numerics  tf32 -> amp                    the precision the step runs in
    optimizer forloop | foreach | fused      AdamW's implementation
    model     custom_op -> ac -> compile     the fused head + loss replaces a piece of the model
              -> ddp | fsdp                  before anything wraps it; checkpointing is applied
                                             before compile so that compile traces the
                                             recomputation; compile works on the plain module,
                                             before the data-parallel wrappers hook into its
                                             parameters and gradients.

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
from opt.ac import apply_ac
from opt.accum import apply_accum, gradient_sync
from opt.amp import apply_amp
from opt.bs import apply_bs
from opt.compile import apply_compile
from opt.custom_op import apply_custom_op
from opt.ddp import apply_ddp
from opt.fsdp import apply_fsdp, pure_low_precision
from opt.non_blocking import apply_non_blocking
from opt.optimizer_impl import IMPLEMENTATIONS, apply_optimizer_impl
from opt.tf32 import apply_tf32
from opt.workers import apply_workers
from recipe.distributed import Distributed

ORDER = (
    "bs", "accum",
    "workers", "non_blocking",
    "tf32", "amp",
    *IMPLEMENTATIONS,
    "custom_op", "ac", "compile", "ddp", "fsdp",
)  # fmt: skip

__all__ = ["ORDER", "Plan", "apply_model_stages", "gradient_sync", "plan"]


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
    optimizer_kwargs: dict = field(default_factory=dict)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_steps

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """The loss scaler: a no-op unless float16. Under FSDP each rank checks only its own
        gradient shards for overflow, so the ranks must agree on skipping a step: the
        ShardedGradScaler all-reduces that verdict."""
        if self.scale_loss and "fsdp" in self.stages:
            return ShardedGradScaler(device.type)
        return torch.amp.GradScaler(device.type, enabled=self.scale_loss)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Autocast to the amp dtype; none under FSDP with mixed_precision=pure, whose
        MixedPrecisionPolicy casts the parameters itself."""
        if self.amp_dtype is None or self.pure_low_precision:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.amp_dtype)


def selected(opt_cfg: DictConfig) -> list[str]:
    """The stages in `cfg.opt`, in application order; unknown names are refused."""
    unknown = [name for name in opt_cfg if name not in ORDER]
    if unknown:
        raise ValueError(
            f"unknown optimization stage(s) {unknown} in cfg.opt: the code applies only "
            f"{', '.join(ORDER)} (see opt/__init__.py to add one)"
        )
    return [name for name in ORDER if name in opt_cfg]


def check(stages: list[str], dist: Distributed) -> None:
    """Refuses conflicting stages before any work starts, naming both sides."""
    impls = [s for s in stages if s in IMPLEMENTATIONS]
    if len(impls) > 1:
        raise ValueError(
            f"+opt={impls[0]} and +opt={impls[1]} both choose AdamW's implementation: pick one"
        )
    if "ddp" in stages and "fsdp" in stages:
        raise ValueError("+opt=ddp and +opt=fsdp are two ways to spread training: pick one")
    if "fsdp" in stages and not dist.enabled:
        raise ValueError(
            "+opt=fsdp shards the model over processes, but this is a single process: launch "
            "with `torchrun --nproc_per_node=N train.py ...` (N >= 2)"
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
        p.amp_dtype, p.scale_loss, p.residual_dtype = apply_amp(opt.amp, device)
        p.pure_low_precision = "fsdp" in stages and pure_low_precision(opt.fsdp)
    for impl in IMPLEMENTATIONS:
        if impl in stages:
            p.optimizer_kwargs = apply_optimizer_impl(impl, device)
    return p


def apply_model_stages(
    model: torch.nn.Module, opt: DictConfig, p: Plan, dist: Distributed
) -> torch.nn.Module:
    """Applies the model stages in their fixed order; returns the module to train with.

    `model` itself stays the plain module (changed in place), for checkpoints and sampling.
    A multi-process run without +opt=fsdp uses DDP with conf/opt/ddp.yaml's knobs."""
    model.residual_dtype = p.residual_dtype  # opt.amp.residual (planned with the numerics)
    if "custom_op" in p.stages:
        apply_custom_op(model, opt.custom_op)
    if "ac" in p.stages:
        apply_ac(model, opt.ac)
    if "compile" in p.stages:
        apply_compile(model, opt.compile, sharded="fsdp" in p.stages)
    if "fsdp" in p.stages:
        return apply_fsdp(model, opt.fsdp, dist, p.amp_dtype)
    if dist.enabled:
        return apply_ddp(model, opt.get("ddp"), dist)
    return model
