"""`+opt=offload`: the float32 master weights, their gradients and AdamW's state in host memory,
on one GPU, in one process (no torchrun).

It is FSDP2 (`fully_shard` per block then the root, opt/fsdp.py) with a `CPUOffloadPolicy`, on a
process group of this one process, created here: every parameter lives in pinned host memory;
a block's parameters are copied to the GPU just before it runs (forward, and with
`reshard_after_forward` again in backward) and dropped after; its gradients go back to the host
as backward produces them; AdamW steps on the CPU. What stays on the GPU is the activations and a
block or two of parameters and gradients: of GPT-2 XL's 16 bytes per parameter (25 GB), almost
nothing. The price is time: the copies (overlapped with compute where FSDP can prefetch) and
AdamW over every parameter on the host's cores, each step.

The math is unchanged (the same float32 AdamW and autocast, on the CPU): exact against no offload
(up to rounding: CPU AdamW and the fused CUDA kernel differ by ~1e-5 relative).

Why not torchao's `CPUOffloadOptimizer` (not measured): it keeps the float32 weights on the GPU
(6.2 GB of GPT-2 XL's 25, where this keeps almost nothing there), and it copies each gradient to
the host in backward, before the trainer clips it, so clipping would silently not apply; its
`param_groups` hold the host copies, which the checkpoint's `get_state_dict` cannot map back to
parameter names. Adopting it would mean refusing clipping and a checkpoint path of its own, for
an optimizer that leaves more on the GPU.

Conflicts (opt.check): +opt=fsdp (with opt.fsdp.cpu_offload=true: the same for several
processes) and ddp, several processes, +opt=opt_in_backward (the step runs on the host after
backward) and +opt=lowbit (another way to shrink the state: pick one). On a CPU run there is
nothing to offload: the stage says so and leaves the model alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from omegaconf import DictConfig

from base.distributed import Distributed, init_process_group, log
from opt import fsdp
from opt.stage import Context, Stage


def offloads(device: torch.device) -> bool:
    """Whether +opt=offload acts on `device`: only a GPU has memory of its own to spare."""
    return device.type != "cpu"


def apply_offload(
    model: torch.nn.Module, cfg: DictConfig, dist: Distributed, amp_dtype: torch.dtype | None
) -> torch.nn.Module:
    """Moves the parameters, gradients and optimizer state of `model` to host memory; returns
    the module to train with (the same object)."""
    if not offloads(dist.device):
        log(
            "[opt] offload: nothing to offload on a CPU run (weights, gradients and optimizer "
            "state are in host memory already): the stage does nothing"
        )
        return model
    return offload_to_host(model, cfg, dist, amp_dtype)


def offload_to_host(
    model: torch.nn.Module, cfg: DictConfig, dist: Distributed, amp_dtype: torch.dtype | None
) -> torch.nn.Module:
    """FSDP2 with CPU offload over a group of this one process (created if there is none).
    With +opt=amp the forward autocasts as it would without offload (FSDP's `autocast` mode)."""
    if not torch_dist.is_initialized():
        init_process_group(dist.device, rank=0, world_size=1, store=torch_dist.HashStore())
    knobs = fsdp.Knobs(  # every field named: a knob fsdp gains must be chosen here too
        reshard_after_forward=cfg.reshard_after_forward, blocks_per_unit=1, cpu_offload=True,
        mixed_precision="autocast", replicas=1,
    )  # fmt: skip
    fsdp.apply_fsdp(model, knobs, dist, amp_dtype)
    pinned = "pinned " if dist.device.type == "cuda" else ""
    log(
        f"[opt] offload: parameters, gradients and AdamW state in {pinned}host memory (FSDP2 "
        f"CPUOffloadPolicy, one process); AdamW steps on the CPU; blocks copied to "
        f"{dist.device.type} as they run (reshard_after_forward={cfg.reshard_after_forward})"
    )
    return model


@dataclass
class Knobs:
    reshard_after_forward: bool


def _plan(ctx: Context) -> None:
    """On a GPU the model is wrapped by FSDP (its CPU offload): the trainer's scaler must know."""
    ctx.plan.parallel.fully_sharded = offloads(ctx.dist.device)


STAGE = Stage(
    "offload", "model",
    lambda ctx: apply_offload(ctx.model, ctx.knobs, ctx.dist, ctx.plan.amp_dtype), Knobs,
    plan=_plan,
    conflicts={
        "fsdp": "offload is FSDP's CPU offload for one process (for several: +opt=fsdp with "
        "opt.fsdp.cpu_offload=true)",
        "ddp": "offload runs in one process, ddp over several",
    },
    processes=("one", "for several processes use +opt=fsdp with opt.fsdp.cpu_offload=true"),
)  # fmt: skip
