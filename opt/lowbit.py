"""`+opt=lowbit`: AdamW whose two moments are stored in 8 or 4 bits (torchao's `AdamW8bit` and
`AdamW4bit`), block-wise quantized with a float32 scale per block of 256 (8-bit) or 128 (4-bit)
values. Optimizer state falls from 8 bytes per parameter to about 2 (8-bit) or 1 (4-bit);
tensors under 4096 values (biases, LayerNorms) keep float32 moments.

It changes the math: every update dequantizes the moments, updates them in float32 and rounds
them back, so losses drift from AdamW's; the ladder rows report the loss next to the memory.

torchao's update is its own implementation (one `torch.compile`d function per parameter, one
graph per parameter shape: the first step compiles them), so it replaces +opt=forloop, foreach
or fused rather than combining with them. Its learning rate is a tensor, which the trainer
updates in place (recipe/schedule.py) so that a new rate does not recompile the update.

torchao 0.18's `step` wraps that function in a new `torch.compile(...)` for every parameter at
every step (pytorch/ao#2500): building the wrapper alone costs ~0.6 ms of host time, ~350 ms a
step for GPT-2 XL's 580 parameters, and left the GPU idle most of the memory_xl `lowbit` step.
The class returned here steps the same way (torchao's state, torchao's update function) with
the function compiled once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig

from recipe.distributed import log

BITS = (8, 4)


def apply_lowbit(cfg: DictConfig) -> type[torch.optim.Optimizer]:
    """The optimizer class for `cfg.bits`, built by the trainer like AdamW (same groups, learning
    rate, betas and weight decay)."""
    if cfg.bits not in BITS:
        raise ValueError(f"opt.lowbit.bits={cfg.bits!r}: choose 8 or 4")
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as e:
        raise ImportError(
            f"+opt=lowbit needs torchao (`pip install --no-deps torchao==0.18.0`): {e}"
        ) from e
    optimizer_class = _update_compiled_once(AdamW8bit if cfg.bits == 8 else AdamW4bit)
    log(f"[opt] lowbit: {optimizer_class.__name__}, AdamW's moments in {cfg.bits} bits (torchao)")
    return optimizer_class


@functools.cache
def _update_compiled_once(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """A subclass of torchao's low-bit AdamW `base` (same name, state and update) whose `step`
    calls torchao's per-parameter update through one `torch.compile` wrapper."""
    from torchao.optim.adam import single_param_adam

    update = torch.compile(single_param_adam, fullgraph=True, dynamic=False)

    @torch.no_grad()
    def step(self: Any, closure: Callable[[], float] | None = None):  # torchao's class: untyped
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # As torchao does: one graph per parameter shape, a fixed number, so no cache limit.
        with torch._dynamo.utils.disable_cache_limit():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:  # torchao's layout: a CPU step count, quantized moments
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    beta1, beta2 = group["betas"]
                    update(
                        p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                        state.get("max_exp_avg_sq"), group["lr"], beta1, beta2,
                        group["weight_decay"], group["eps"], self.is_adamw,
                        self.bf16_stochastic_round and p.dtype is torch.bfloat16,
                    )  # fmt: skip
        return loss

    return type(base.__name__, (base,), {"step": step, "__module__": __name__})
