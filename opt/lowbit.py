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
The class returned here keeps torchao's state and math and updates each parameter either with
torchao's function compiled once (`opt.lowbit.impl=torchao`, and 4 bits) or, by default, with
our own Triton kernel (`impl=triton`, 8 bits on CUDA: kernels/triton_adamw8bit.py): one launch
for all of a group's 8-bit tensors and one for the small ones (with +opt=opt_in_backward, a
transformer block's 12) from a table of pointers, instead of ~0.5 ms of dynamo guards and graph
launches per parameter.

Both read the non-finite guard's device flag `found_inf`, as fused AdamW does, so a bad step
costs no host sync: the kernel writes nothing; torchao's update, which reads no flag, steps a
zero gradient at learning rate 0 (the weights stay, the moments decay one step).

Its checkpointed state is plain tensors: torchao's quantized moments (`OptimState8bit`/`4bit`,
tensor subclasses that `torch.load(weights_only=True)` refuses unless torchao is imported) are
saved as their component tensors with a tag and rebuilt on load, so the after-training tools
read a lowbit run's checkpoint without torchao, as they read any other.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from base.distributed import log
from base.errors import ConfigError
from opt.compile import ready_inductor
from opt.stage import Context, Plan, Stage

TAG = "lowbit_bits"  # marks a quantized moment saved as its parts; its value: 8 or 4


def optimizer_class(cfg: DictConfig, device_type: str = "cuda") -> type[torch.optim.Optimizer]:
    """The optimizer class for `cfg.bits` and `cfg.impl`, built by the trainer like AdamW (same
    groups, learning rate, betas and weight decay), for parameters on a `device_type` device."""
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as e:
        raise ImportError(
            f"+opt=lowbit needs torchao, an optional extra ({e}): "
            'pip install -e ".[lowbit]" (or pip install torchao==0.18.*)'
        ) from e
    base = AdamW8bit if cfg.bits == 8 else AdamW4bit
    fused = cfg.impl == "triton" and cfg.bits == 8
    ready_inductor(cache_dir=None)  # torchao's update compiles, with or without +opt=compile
    optimizer_class = _lowbit_adamw(base, fused)
    how = (
        "our Triton kernel on CUDA, a launch for many tensors (kernels/triton_adamw8bit.py)"
        if fused and device_type == "cuda"
        else f"torchao's update, compiled once (on the {device_type})"
    )
    log(f"[opt] lowbit: {base.__name__}, AdamW's moments in {cfg.bits} bits; the update: {how}")
    return optimizer_class


def runs_the_kernel(param: torch.Tensor) -> bool:
    """Whether opt.lowbit.impl=triton steps `param` with the Triton kernel: on CUDA, or on the
    CPU under Triton's interpreter (TRITON_INTERPRET=1, the tests); elsewhere, and for the
    sharded parameters of +opt=fsdp/tp (DTensors, whose local shards torchao's update handles),
    torchao's update."""
    if isinstance(param, DTensor):
        return False
    return param.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _lowbit_adamw(base: type[torch.optim.Optimizer], fused: bool) -> type[torch.optim.Optimizer]:
    """A subclass of torchao's low-bit AdamW `base` (same name, state and math) whose `step`
    updates each parameter with our Triton kernel (`fused`, 8-bit only) or torchao's update
    through one `torch.compile` wrapper, and skips on the guard's device flag `found_inf`."""
    from torchao.optim.adam import single_param_adam

    update = torch.compile(single_param_adam, fullgraph=True, dynamic=False)

    @torch.no_grad()
    def step(self: Any, closure: Callable[[], float] | None = None):  # torchao's class: untyped
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # the guard's verdict, on the device
        bad = None if found_inf is None else found_inf.bool()
        # As torchao does: one graph per parameter shape, a fixed number, so no cache limit.
        with torch._dynamo.utils.disable_cache_limit():
            for group in self.param_groups:
                # torchao reads no flag: a bad step is zeros at learning rate 0 (_zero_lr_unless),
                # made once per group, when a parameter first takes torchao's update
                lr = None
                beta1, beta2 = group["betas"]
                # Our kernel's tensors, by what one launch needs in common: {(device, dtypes,
                # step): [(param, grad, exp_avg, exp_avg_sq)]}.
                launches: dict[tuple, list[tuple]] = defaultdict(list)
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
                    if fused and runs_the_kernel(p) and not group["amsgrad"]:
                        key = (p.device, p.dtype, p.grad.dtype, float(state["step"]))
                        launches[key].append(
                            (p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"])
                        )
                        continue
                    if lr is None:
                        lr = group["lr"] if bad is None else _zero_lr_unless(group["lr"], bad)
                    grad = p.grad if bad is None else p.grad.masked_fill(bad, 0.0)
                    update(
                        p.detach(), grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                        state.get("max_exp_avg_sq"), lr, beta1, beta2,
                        group["weight_decay"], group["eps"], self.is_adamw,
                        self.bf16_stochastic_round and p.dtype is torch.bfloat16,
                    )  # fmt: skip
                for (device, *_, step), tensors in launches.items():
                    _kernel().adamw_update_(
                        *zip(*tensors, strict=True),
                        _no_skip(device) if found_inf is None else found_inf,
                        lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], step=step,
                        stochastic_round=self.bf16_stochastic_round,
                    )  # fmt: skip
        return loss

    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self.register_state_dict_post_hook(_state_as_plain_tensors)
        self.register_load_state_dict_pre_hook(_state_from_plain_tensors)

    namespace = {
        "__init__": __init__, "step": step, "__module__": __name__,
        "skips_on_found_inf": True,  # recipe/guard.py hands it the verdict: no host sync
    }  # fmt: skip
    return type(base.__name__, (base,), namespace)


@functools.cache
def _no_skip(device: torch.device) -> torch.Tensor:
    """The kernel's skip flag when no guard set one: 0."""
    return torch.zeros((), device=device)


@functools.cache
def _kernel() -> Any:
    """kernels/triton_adamw8bit.py, imported on first use (CPU installs need no triton)."""
    from kernels import triton_adamw8bit

    return triton_adamw8bit


def _zero_lr_unless(lr: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """A group's learning rate for torchao's update, which cannot skip on a device flag (and a
    host read of `bad` would stall every hook of +opt=opt_in_backward: measured on GPT-2 XL, the
    GPU idled 65% of the step). A bad step is a zero gradient (each parameter's, masked in
    `step`) at learning rate 0: the weights stay exactly as they were, the moments decay one
    step (as for a zero gradient), the step count advances. Once per group and step, and only
    for torchao's update. `lr` is torchao's CPU tensor: read on the host, never copied to the
    GPU, which from pageable memory waits for the GPU: a stall per block under
    +opt=opt_in_backward (the lowbit row ran 0.88x of `ac` instead of 1.01x)."""
    return torch.where(bad, 0.0, float(lr))


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


@dataclass
class Knobs:
    bits: Literal[8, 4]  # AdamW's moments in 8 or 4 bits
    impl: Literal["triton", "torchao"]  # triton: our fused kernel (8 bits, CUDA)
    weights: Literal["float32", "bfloat16"]  # bfloat16: stored so, updates stochastically rounded


def _apply(ctx: Context) -> None:
    ctx.plan.optimizer_class = optimizer_class(ctx.knobs, ctx.dist.device.type)
    if ctx.knobs.weights == "bfloat16":
        store_weights_in_bfloat16(ctx.plan)


def store_matrices_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The model's parameters of two or more dimensions (the matmuls' weights, the embeddings:
    all but 0.1% of GPT-2's) stored in `dtype`; the vectors (biases, LayerNorms) stay float32,
    as LayerNorm needs its parameters in its input's dtype on every device."""
    for param in model.parameters():
        if param.dim() >= 2:
            param.data = param.data.to(dtype)


def store_weights_in_bfloat16(plan: Plan) -> None:
    """opt.lowbit.weights=bfloat16: the model's matrices and embeddings stored in bfloat16 (2
    bytes a parameter instead of 4, their gradients too; `store_matrices_in`), each update
    computed in float32 and rounded to bfloat16 stochastically (up with the probability of the
    dropped bits), so that updates smaller than a bfloat16 step still move the weights on
    average. It changes the math. The residual stream stays float32 unless
    opt.amp.residual=compute."""
    if plan.amp_dtype is not torch.bfloat16:
        raise ConfigError(
            "opt.lowbit.weights=bfloat16 computes in bfloat16 under autocast: add +opt=amp with "
            "opt.amp.dtype=bfloat16"
        )
    plan.weights_dtype = torch.bfloat16
    plan.residual_dtype = plan.residual_dtype or torch.float32
    plan.optimizer_kwargs["bf16_stochastic_round"] = True  # torchao's update; ours reads it too


def _check_plan(ctx: Context) -> None:
    """opt.lowbit.weights=bfloat16 casts the whole model of one process (`_prepare_model`),
    before any stage wraps it: refused where the plan splits or shards the model over processes,
    whose stages lay out the float32 model themselves."""
    parallel = ctx.plan.parallel
    if ctx.plan.weights_dtype is None:
        return
    for on, what in (
        (parallel.tp_enabled, "tensor parallelism (+opt=tp) splits it"),
        (parallel.pp_enabled, "the pipeline (+opt=pp) splits it"),
        (parallel.fully_sharded, "FSDP (+opt=fsdp) shards it"),
    ):
        if on:
            raise ConfigError(
                f"opt.lowbit.weights=bfloat16 casts the whole model of one process, and {what} "
                "over processes: use opt.lowbit.weights=float32 there"
            )


def _prepare_model(ctx: Context) -> None:
    """opt.lowbit.weights=bfloat16: the matrices stored so before any stage wraps the model."""
    if ctx.plan.weights_dtype is not None:
        store_matrices_in(ctx.model, ctx.plan.weights_dtype)


OWN_IMPLEMENTATION = "torchao's low-bit AdamW is its own implementation"
STAGE = Stage(
    "lowbit", "optimizer", _apply, Knobs, check_plan=_check_plan, prepare_model=_prepare_model,
    conflicts={"forloop": OWN_IMPLEMENTATION, "foreach": OWN_IMPLEMENTATION,
               "fused": OWN_IMPLEMENTATION,
               "offload": "two ways to shrink the optimizer state on the GPU"},
)  # fmt: skip
