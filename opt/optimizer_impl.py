"""`+opt=forloop`, `+opt=foreach`, `+opt=fused`: how AdamW updates the parameters.

- forloop: one parameter at a time. Slowest, but needs no temporaries beyond one tensor: the
  book's memory-friendly optimizer.
- foreach: multi-tensor kernels over lists of parameters (PyTorch's default on GPU): fewer
  launches, but intermediates for whole parameter groups at once.
- fused: a single fused kernel per group: the fastest.
"""

from __future__ import annotations

import torch

from base.distributed import log
from base.errors import ConfigError
from opt.stage import Context, Stage

IMPLEMENTATIONS = ("forloop", "foreach", "fused")


def adamw_kwargs(name: str, device: torch.device) -> dict:
    """AdamW's keyword arguments for the implementation `name`."""
    if name == "fused":
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        if device.type not in _get_fused_kernels_supported_devices():
            raise ConfigError(f"+opt=fused: PyTorch has no fused AdamW for {device.type!r}")
    kwargs = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    log(f"[opt] {name}: AdamW({', '.join(f'{k}={v}' for k, v in kwargs[name].items())})")
    return kwargs[name]


def _stage(name: str) -> Stage:
    def apply(ctx: Context) -> None:
        ctx.plan.optimizer_kwargs = adamw_kwargs(name, ctx.dist.device)

    why = "both choose AdamW's implementation"
    others = {other: why for other in IMPLEMENTATIONS if other != name}
    return Stage(name, "optimizer", apply, conflicts=others)


FORLOOP, FOREACH, FUSED = (_stage(name) for name in IMPLEMENTATIONS)
