"""Run by test_lowbit_kernel.py with TRITON_INTERPRET=1 (which triton reads when it is first
imported, hence a process of its own), or on a GPU by the same test's CUDA variant: +opt=lowbit's
fused update (kernels/triton_adamw8bit.py) against torchao's own update, over several steps.
Prints one JSON line: {case: measurement}."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from omegaconf import OmegaConf  # noqa: E402

import kernels.triton_adamw8bit as kernel  # noqa: E402
from opt.lowbit import optimizer_class  # noqa: E402

LAUNCHES = [0]  # calls of the fused update (each for several tensors): impl=triton ran it
_real_update = kernel.adamw_update_


def _counted(*args, **kwargs) -> None:
    LAUNCHES[0] += 1
    _real_update(*args, **kwargs)


kernel.adamw_update_ = _counted


def _pair(device: str, shapes: list[tuple[int, ...]]):
    """The same weights under +opt=lowbit with the fused update and with torchao's."""
    torch.manual_seed(0)
    weights = [torch.randn(shape, device=device) * 0.02 for shape in shapes]
    optimizers, params = {}, {}
    for update in ("fused", "torchao"):
        impl = "triton" if update == "fused" else "torchao"
        cls: Any = optimizer_class(OmegaConf.create({"bits": 8, "impl": impl}))
        params[update] = [torch.nn.Parameter(w.clone()) for w in weights]
        groups = [
            {"params": [p for p in params[update] if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params[update] if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizers[update] = cls(groups, lr=1e-3, betas=(0.9, 0.95))
    return optimizers, params


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if hasattr(t, "dequantize") else t


def compare(device: str, steps: int = 4) -> dict[str, float]:
    """Max differences after `steps` steps (weights relative to their size; moments relative
    to their block's scale through the codes' agreement), then a skipped step."""
    shapes = [(64, 256), (300, 64), (512,), (64,)]  # 8-bit (4096+ values), float32 moments
    optimizers, params = _pair(device, shapes)
    for step in range(steps):
        torch.manual_seed(100 + step)
        grads = [torch.randn(p.shape, device=device) * 10.0 ** (step - 2) for p in params["fused"]]
        for update in ("fused", "torchao"):
            for p, g in zip(params[update], grads, strict=True):
                p.grad = g.clone()
            optimizers[update].param_groups[0]["lr"].fill_(1e-3 * (step + 1))
            optimizers[update].step()
    result: dict[str, float] = {}
    weight_error = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(params["fused"], params["torchao"], strict=True)
    )
    result["weights_rel_error"] = weight_error
    same_codes, codes = 0, 0
    moment_error = 0.0
    for a, b in zip(params["fused"], params["torchao"], strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            mine, theirs = optimizers["fused"].state[a][key], optimizers["torchao"].state[b][key]
            if hasattr(mine, "codes"):
                same_codes += int((mine.codes == theirs.codes).sum())
                codes += mine.codes.numel()
            scale = _plain(theirs).abs().max().clamp_min(1e-30)
            moment_error = max(
                moment_error, ((_plain(mine) - _plain(theirs)).abs().max() / scale).item()
            )
    result["codes_equal_fraction"] = same_codes / codes
    result["moments_rel_error"] = moment_error
    # A skipped step: the guard's flag set, nothing may change (weights, codes, scales).
    fused = optimizers["fused"]
    before = [(p.detach().clone(), {k: _plain(v).clone() for k, v in fused.state[p].items()})
              for p in params["fused"]]  # fmt: skip
    for p in params["fused"]:
        p.grad = torch.randn(p.shape, device=device)
    fused.found_inf = torch.ones((), device=device)
    fused.step()
    del fused.found_inf
    unchanged = all(
        torch.equal(p, w) and all(torch.equal(_plain(fused.state[p][k]), v) for k, v in s.items()
                                  if k != "step")
        for p, (w, s) in zip(params["fused"], before, strict=True)
    )  # fmt: skip
    result["skipped_step_unchanged"] = float(unchanged)
    return result


def rounding(device: str) -> dict[str, float]:
    """bfloat16 weights of 1.0 (bfloat16's step there: 2**-7), one step of -1e-4 each (Adam's
    first step is the learning rate): to nearest they stay, stochastically they move by
    -1e-4 on average. Returns each update's mean change."""
    result = {}
    for name, impl, stochastic in [("stochastic_triton", "triton", True),
                                   ("stochastic_torchao", "torchao", True),
                                   ("nearest_triton", "triton", False)]:  # fmt: skip
        torch.manual_seed(0)
        cls: Any = optimizer_class(OmegaConf.create({"bits": 8, "impl": impl}))
        weights = [torch.nn.Parameter(torch.ones(shape, dtype=torch.bfloat16, device=device))
                   for shape in ((128, 256), (4000,))]  # fmt: skip
        optimizer = cls(weights, lr=1e-4, weight_decay=0.0, bf16_stochastic_round=stochastic)
        for w in weights:
            w.grad = torch.ones_like(w)
        optimizer.step()
        for w, part in zip(weights, ("quantized", "plain"), strict=True):
            result[f"{name}_{part}"] = (w.float() - 1.0).mean().item()
    return result


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(json.dumps({**compare(device), **rounding(device), "kernel_calls": LAUNCHES[0]}))
