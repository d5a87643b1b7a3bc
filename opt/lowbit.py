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

Its checkpointed state is plain tensors: torchao's quantized moments (`OptimState8bit`/`4bit`,
tensor subclasses that `torch.load(weights_only=True)` refuses unless torchao is imported) are
saved as their component tensors with a tag and rebuilt on load, so the after-training tools
read a lowbit run's checkpoint without torchao, as they read any other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from omegaconf import DictConfig

from opt.stage import Context, Stage
from recipe.distributed import log

TAG = "lowbit_bits"  # marks a quantized moment saved as its parts; its value: 8 or 4


def apply_lowbit(cfg: DictConfig) -> type[torch.optim.Optimizer]:
    """The optimizer class for `cfg.bits`, built by the trainer like AdamW (same groups, learning
    rate, betas and weight decay)."""
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as e:
        raise ImportError(
            f"+opt=lowbit needs torchao, an optional extra ({e}): "
            'pip install -e ".[lowbit]" (or pip install torchao==0.18.*)'
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

    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self.register_state_dict_post_hook(_state_as_plain_tensors)
        self.register_load_state_dict_pre_hook(_state_from_plain_tensors)

    namespace = {"__init__": __init__, "step": step, "__module__": __name__}
    return type(base.__name__, (base,), namespace)


def _quantized_types() -> tuple[Any, Any]:  # torchao's classes (untyped)
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    return OptimState8bit, OptimState4bit


def _state_as_plain_tensors(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """state_dict()'s post-hook: each quantized moment becomes {TAG: bits, codes, scale, qmap,
    signed, shape}."""
    eight, four = _quantized_types()

    def plain(value: Any) -> Any:
        if not isinstance(value, eight | four):
            return value  # a step count, a float32 moment (small tensors), a DTensor (FSDP)
        return {
            TAG: torch.tensor(8 if isinstance(value, eight) else 4),
            "codes": value.codes, "scale": value.scale, "qmap": value.qmap,
            "signed": torch.tensor(value.signed), "shape": torch.tensor(value.shape),
        }  # fmt: skip

    return _map_state(state_dict, lambda _, value: plain(value))


def _state_from_plain_tensors(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """load_state_dict()'s pre-hook: rebuilds the quantized moments that the post-hook took
    apart, with their parameter's dtype (torchao's "appearance" dtype)."""
    eight, four = _quantized_types()
    saved_keys = [k for group in state_dict["param_groups"] for k in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    dtypes = {k: p.dtype for k, p in zip(saved_keys, params, strict=False)}

    def rebuilt(value: Any, dtype: torch.dtype) -> Any:
        if not (isinstance(value, dict) and TAG in value):
            return value
        parts = value["codes"], value["scale"], value["qmap"], bool(value["signed"])
        if int(value[TAG]) == 8:
            return eight(*parts, dtype=dtype)
        return four(*parts, torch.Size(value["shape"].tolist()), dtype=dtype)

    return _map_state(state_dict, lambda key, value: rebuilt(value, dtypes.get(key, torch.float32)))


def _map_state(state_dict: dict, convert: Callable[[Any, Any], Any]) -> dict:
    """`state_dict` with `convert(parameter key, value)` applied to each parameter's state values,
    in new dicts (the per-parameter ones are the optimizer's live state)."""
    state = {
        k: {name: convert(k, v) for name, v in s.items()} for k, s in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


# +opt=opt_in_backward with this optimizer: a parameter whose gradient is not finite cannot skip
# on a `found_inf` flag (torchao reads none), and a host sync per parameter would stall backward.


def skips_at_zero_lr(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a bad parameter must skip as zeros at learning rate 0: no `found_inf` flag (not
    fused) but a tensor learning rate the update reads on the device (torchao's low-bit AdamW)."""
    return not optimizer.defaults.get("fused") and torch.is_tensor(optimizer.param_groups[0]["lr"])


def step_at_zero_lr_unless(
    optimizer: torch.optim.Optimizer,
    grad: torch.Tensor,
    bad: torch.Tensor,
    step: Callable[[], Any],
) -> None:
    """One parameter's step without reading `bad` on the host: a bad gradient becomes zeros and
    the learning rate 0, so the weights stay exactly as they were; the moments decay one step
    (as for a zero gradient) and the step count advances. A sync per parameter instead (as
    `_step_unless` does) would stall every gradient hook of backward: measured on GPT-2 XL with
    torchao's AdamW8bit, the GPU idled 65% of the step."""
    group = optimizer.param_groups[0]
    lr = group["lr"]
    grad.masked_fill_(bad, 0.0)
    group["lr"] = torch.where(bad, 0.0, lr)  # on the flag's device: the update reads it there
    try:
        step()
    finally:
        group["lr"] = lr


@dataclass
class Knobs:
    bits: Literal[8, 4]  # AdamW's moments in 8 or 4 bits


def _apply(ctx: Context) -> None:
    ctx.plan.optimizer_class = apply_lowbit(ctx.knobs)


OWN_IMPLEMENTATION = "torchao's low-bit AdamW is its own implementation"
STAGE = Stage(
    "lowbit", "optimizer", _apply, Knobs,
    conflicts={"forloop": OWN_IMPLEMENTATION, "foreach": OWN_IMPLEMENTATION,
               "fused": OWN_IMPLEMENTATION,
               "offload": "two ways to shrink the optimizer state on the GPU"},
)  # fmt: skip
