"""`+opt=float8`: float8 training of the Linear layers, with torchao's `convert_to_float8_training`.
Each converted `nn.Linear` becomes torchao's `Float8Linear`: its three matmuls (the output, the
input's gradient, the weight's gradient) cast their operands to float8 with dynamic scales
(`tensorwise`: one scale per tensor, cuBLAS's kernel; `rowwise`: one per row, rounded to powers of
two, CUTLASS's kernel: more accurate, slower) and run on the float8 tensor cores of an sm89+ GPU
(Ada, Hopper, Blackwell). The weights, their gradients and AdamW's state stay float32, under the
same names: a float8 checkpoint resumes with or without the stage, and the tools read it as any.

Which layers convert (`converts`): never the head, which GPT-2 ties to the token embedding (the
model multiplies by that weight itself, and the logits are where float8's rounding costs the
most); never a layer whose dimensions are not multiples of 16 (float8 matmuls need them); with
`skip_small`, not a layer whose matmul is too small for float8 to pay for its casts, by torchao's
thresholds for the recipe, measured on an H100 (docs/stages.md lists what converts at each size);
not a layer named in `skip_layers` (a part of its name: `attn.c_proj` is every block's attention
projection), for the user who measures a layer's casts to cost more than its matmul gains.

The casts and scales are elementwise work that only compile fuses into the neighbouring kernels:
float8 without +opt=compile runs, but slower than bfloat16 (a line says so). Under +opt=fsdp,
`fsdp_all_gather` gathers each weight already cast to float8 (half of bfloat16's bytes), with the
scales of all the weights computed after each optimizer step in one all-reduce
(`after_optimizer_step`). It is applied before anything splits, wraps or traces the model: tp,
ac, compile, pp and the data-parallel wrappers all see the converted modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch.distributed.tensor import DTensor

from base.distributed import log
from base.errors import ConfigError
from opt.stage import Context, Plan, Stage

if TYPE_CHECKING:
    from model import GPT

Recipe = Literal["tensorwise", "rowwise"]
HEAD = "lm_head"  # tied to transformer.wte: never converted
FLOAT8_GPU = (8, 9)  # the compute capability of the first GPUs with float8 tensor cores (Ada)
# Inductor's setting as this process started (env TORCHINDUCTOR_EMULATE_PRECISION_CASTS), which
# the rowwise recipe changes for its run and every other run gets back.
PRECISION_CASTS = inductor_config.emulate_precision_casts


@dataclass
class Knobs:
    recipe: Recipe
    skip_small: bool  # leave out the layers torchao measured too small for float8 to pay
    skip_layers: list[str]  # leave out the layers whose names contain one of these
    fsdp_all_gather: bool  # +opt=fsdp gathers float8 weights (tensorwise only)
    emulate: bool  # float8 casts, matmuls in float32: any device, eager only (for tests)


def torchao_float8() -> Any:
    """torchao's float8 package, or a one-line refusal naming the extra that installs it."""
    try:
        import torchao.float8
    except ImportError as e:
        raise ConfigError(
            f"+opt=float8 needs torchao, an optional extra ({e}): "
            'pip install -e ".[float8]" (or pip install torchao==0.18.*)'
        ) from e
    return torchao.float8


def check_float8(knobs: Any) -> None:
    """Refuses knobs that cannot work together, or without torchao, before any work starts."""
    torchao_float8()
    parts = knobs.skip_layers
    if isinstance(parts, str) or not all(isinstance(p, str) and p for p in parts):
        raise ConfigError(
            f"opt.float8.skip_layers must be a list of parts of layer names, e.g. "
            f"'opt.float8.skip_layers=[attn.c_proj]', got {parts!r}"
        )
    if knobs.fsdp_all_gather and knobs.recipe != "tensorwise":
        raise ConfigError(
            f"opt.float8.fsdp_all_gather=true needs opt.float8.recipe=tensorwise, not "
            f"{knobs.recipe}: torchao gathers float8 weights with one scale per tensor only"
        )


def check_with_plan(knobs: Any, plan: Plan) -> None:
    """Refuses knobs that the other stages' decisions rule out (FSDP's sharding, compile), once
    the plan holds them all: before any work starts."""
    if knobs.fsdp_all_gather and not plan.parallel.fsdp_enabled:
        raise ConfigError(
            "opt.float8.fsdp_all_gather=true gathers FSDP's weight shards in float8: add "
            "+opt=fsdp, or drop it"
        )
    if knobs.emulate and plan.compiled:
        raise ConfigError(
            "opt.float8.emulate=true runs eager only (torchao's emulated matmuls do not compile): "
            "drop +opt=compile, or emulate on a GPU of compute capability 8.9 or newer"
        )


def check_device(device: torch.device, emulate: bool) -> None:
    """Refuses a device without float8 matmuls, in one line (emulate: any device)."""
    if emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"+opt=float8 needs a CUDA GPU of compute capability 8.9 or newer (float8 tensor "
            f"cores), this run is on the {device.type}: drop it, or set opt.float8.emulate=true "
            "to try it without the speed"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_GPU:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"+opt=float8 needs compute capability 8.9 or newer (float8 tensor cores: Ada, "
            f"Hopper, Blackwell); {name} has {capability[0]}.{capability[1]}: drop it"
        )


def float8_config(knobs: Any) -> Any:
    """torchao's Float8LinearConfig for the knobs."""
    ao = torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(knobs.recipe)
    return dataclasses.replace(
        config, enable_fsdp_float8_all_gather=knobs.fsdp_all_gather, emulate=knobs.emulate
    )


def converts(
    module: nn.Module, fqn: str, recipe: str, skip_small: bool, skip_layers: Sequence[str] = ()
) -> bool:
    """The filter rule: whether the Linear at `fqn` trains in float8 (module docstring)."""
    if not isinstance(module, nn.Linear) or fqn == HEAD:
        return False
    if any(part in fqn for part in skip_layers):
        return False
    out_features, in_features = module.weight.shape
    if out_features % 16 or in_features % 16:
        return False
    if skip_small:
        return torchao_float8()._auto_filter_for_recipe(recipe, filter_fqns=[])(module, fqn)
    return True


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def convert_to_float8(model: nn.Module, knobs: Any) -> list[str]:
    """Converts `model`'s Linear layers that pass the rule, in place; returns their names."""
    ao = torchao_float8()
    linears = linear_names(model)
    for part in knobs.skip_layers:
        if not any(part in name for name in linears):
            raise ConfigError(
                f"opt.float8.skip_layers: {part!r} is in no Linear layer's name of this model "
                f"(they are like {linears[0]}): correct it, or drop it"
            )
    chosen = [
        name
        for name, module in model.named_modules()
        if converts(module, name, knobs.recipe, knobs.skip_small, knobs.skip_layers)
    ]
    ao.convert_to_float8_training(
        model,
        module_filter_fn=lambda module, fqn: fqn in chosen,
        config=float8_config(knobs),
    )
    if knobs.fsdp_all_gather:
        for name in chosen:
            model.get_submodule(name).register_state_dict_post_hook(_plain_weight)
    return chosen


def _plain_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict()'s post-hook under fsdp_all_gather: the weight as the plain float32 tensor
    inside torchao's float8-gathering wrapper (the same storage, so that loading into it loads
    the parameter). `torch.load(weights_only=True)` refuses the wrapper unless torchao is
    imported: checkpoints stay readable by every tool, and by a run without the stage."""
    key = prefix + "weight"
    weight = state_dict.get(key)
    if isinstance(weight, DTensor):  # FSDP's shard of it
        local = weight.to_local()
        state_dict[key] = DTensor.from_local(
            _unwrapped(local), weight.device_mesh, weight.placements,
            shape=weight.shape, stride=weight.stride(), run_check=False,
        )  # fmt: skip
    elif weight is not None:
        state_dict[key] = _unwrapped(weight)


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside torchao's wrapper (the parameter itself: detached, as
    state_dict() gives its tensors)."""
    return getattr(t, "_tensor", t).detach()


def _apply(ctx: Context) -> None:
    knobs, model = ctx.knobs, ctx.model
    check_device(ctx.dist.device, knobs.emulate)
    linears = linear_names(model)
    chosen = convert_to_float8(model, knobs)
    if not chosen:
        width = model.config.n_embd
        raise ConfigError(
            f"+opt=float8 converts no layer of this model (width {width}): every Linear is "
            f"below torchao's size threshold for the {knobs.recipe} recipe"
            + (" or in opt.float8.skip_layers" if knobs.skip_layers else "")
            + "; set "
            "opt.float8.skip_small=false to convert them anyway, or drop the stage"
        )
    # Inductor's casts rounded as eager rounds them: otherwise the rowwise recipe's scales that
    # backward recomputes (checkpointing) can differ from the forward's, and the loss goes NaN.
    inductor_config.emulate_precision_casts = knobs.recipe == "rowwise" or PRECISION_CASTS
    left = len(linears) - len(chosen)
    log(
        f"[opt] float8: {knobs.recipe} scaling, {len(chosen)} of {len(linears)} Linear layers "
        f"({left} left in high precision: the head, small layers"
        + (f", {', '.join(knobs.skip_layers)}" if knobs.skip_layers else "")
        + ": docs/stages.md)"
        + (", weights gathered in float8 under FSDP" if knobs.fsdp_all_gather else "")
        + (", emulated (float32 matmuls)" if knobs.emulate else "")
    )
    if not ctx.plan.compiled and not knobs.emulate:
        log(
            "[opt] float8 without +opt=compile: the casts and scales run as separate kernels, "
            "slower than bfloat16; add +opt=compile for the speed"
        )


def _reset(ctx: Context) -> None:
    inductor_config.emulate_precision_casts = PRECISION_CASTS


def precompute_scales(model: GPT) -> None:
    """After the optimizer step under fsdp_all_gather: every float8 weight's scale from its new
    values, in one all-reduce over the shards for all of them, instead of one per weight inside
    each all-gather (torchao's `precompute_float8_dynamic_scale_for_fsdp`; it finds nothing to
    do without float8 all-gather)."""
    torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


STAGE = Stage(
    "float8", "model", _apply, Knobs,
    conflicts={
        "tp": "tp splits the Linear layers with its own plans (c_attn's strided split replaces "
        "its forward), which torchao's float8 tensor-parallel plans would have to replace",
    },
    check=lambda ctx: check_float8(ctx.knobs),
    check_plan=lambda ctx: check_with_plan(ctx.knobs, ctx.plan),
    unselected=_reset,
    after_optimizer_step=lambda ctx: precompute_scales(ctx.model),
)  # fmt: skip
