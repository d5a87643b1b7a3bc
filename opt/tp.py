"""`+opt=tp`: tensor parallelism with DTensor (`parallelize_module`), Megatron's layout. Inside
each block, attention's QKV projection (`c_attn`) and the MLP's first matmul (`c_fc`) are split
column-wise (each of the `degree` ranks computes its share of the heads and of the hidden
units), the output projections (`c_proj`) row-wise (their partial sums reduced): one collective
per sub-layer forward, one backward. The ranks of a group read the same batch.

- sequence_parallel: between the matmuls, the LayerNorms, dropout and the residual stream are
  split over the sequence instead of repeated on every rank (the all-reduce becomes a
  reduce-scatter + all-gather: the same bytes, 1/degree of those activations).
- loss_parallel: the tied head's logits stay split over the vocabulary and the cross-entropy is
  computed on the shards (`loss_parallel()`; `Plan.loss_context` wraps forward and backward);
  the embedding is split over the vocabulary too (row-wise), as it is the same weight.

`c_attn`'s rows are [q; k; v]: a plain column split would give rank 0 all of q and half of k.
Each rank takes its heads' rows of each third instead (a strided shard), so its q, k and v are
the same heads; the global weight keeps GPT-2's layout (checkpoints, one-process resume).
Parameters that are not split (LayerNorms, positions) are replicated DTensors on the same mesh,
so that FSDP and gradient clipping see one kind of parameter. The model returns plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from model import GPT, GPTConfig
from opt.stage import Context, Stage
from recipe.distributed import Distributed, log, mesh_shape
from recipe.errors import ConfigError
from recipe.knobs import count


def check_tp_model(degree: int, config: GPTConfig) -> None:
    """Refuses a model whose heads or padded vocabulary do not split over `degree` ranks."""
    if config.n_head % degree:
        raise ConfigError(
            f"+opt=tp: model.n_head={config.n_head} does not split over opt.tp.degree={degree} "
            "ranks (each rank computes whole heads): choose a degree that divides n_head"
        )
    if config.padded_vocab_size % degree:
        raise ConfigError(
            f"+opt=tp: the padded vocabulary ({config.padded_vocab_size}) does not split over "
            f"opt.tp.degree={degree} ranks: set model.pad_vocab_to to a multiple of {degree}"
        )


class _StridedColwise(ColwiseParallel):
    """ColwiseParallel for a fused projection whose rows are `parts` stacked matrices ([q; k; v]):
    each rank holds its slice of every part (a strided shard), so that its output is
    [q_r; k_r; v_r]. DTensor's matmul does not compute on strided shards as they are laid out,
    so the forward multiplies by the local rows, seen as a plain row shard (the same bytes)."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        strided = [_StridedShard(0, split_factor=self.parts)]
        for param_name, param in module.named_parameters():
            shard = distribute_tensor(param, device_mesh, strided)
            module.register_parameter(param_name, nn.Parameter(shard, param.requires_grad))

        def forward(x: DTensor) -> torch.Tensor:
            rows = [
                None if p is None else DTensor.from_local(p.to_local(), device_mesh, [Shard(0)])
                for p in (module.weight, module.bias)  # differentiable: grads keep the strides
            ]
            return F.linear(x, *rows)

        module.forward = forward


def _replicate(module: nn.Module, mesh: DeviceMesh, input_fn: Any = None) -> None:
    """`module`'s parameters as replicated DTensors on `mesh` (no split: the same on every rank)."""
    distribute_module(module, mesh, input_fn=input_fn)


def _positions_as_dtensor(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)


def replicated(t: Any, mesh: DeviceMesh) -> Any:
    """A plain tensor `t` as a replicated DTensor on `mesh` (the loss on vocabulary-split logits
    needs its targets so; the whole batch's targets are on every rank of the group)."""
    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    return t


def plain(t: Any) -> Any:
    """The model's logits or loss as a plain tensor, the same on every rank of the group."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _replicated_targets(mesh: DeviceMesh) -> Any:
    """A forward pre-hook: the model's targets as a replicated DTensor (`replicated`)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) > 1:
            args = (args[0], replicated(args[1], mesh), *args[2:])
        if "targets" in kwargs:
            kwargs = {**kwargs, "targets": replicated(kwargs["targets"], mesh)}
        return args, kwargs

    return hook


def reduce_pending_grads(params: list[torch.Tensor]) -> None:
    """Lays out each gradient still pending a sum over the group (`Partial`: under sequence
    parallelism the LayerNorms' and the positions' gradients are each rank's share of the
    sequence) as its parameter, summed: before clipping, which on torch 2.11 scales no
    `Partial` gradient (measured: one was left 7.7x over the clipped norm; the LayerNorm biases
    of a tp run were 9% off the one-process run's after two steps), and before the optimizer."""
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(x.is_partial() for x in grad.placements):
            p.grad = grad.redistribute(placements=p.placements)  # type: ignore[attr-defined]


def _plain_outputs(module: nn.Module, inputs: Any, outputs: tuple) -> tuple:
    return tuple(plain(o) for o in outputs)


@dataclass(frozen=True)
class ResidualStream:
    """How the residual stream between blocks is laid out over a tp group: split over the
    sequence (sequence_parallel) or whole on every rank. A pipeline stage under +opt=tp sends
    the next stage (the same tp rank of the next pipeline rank) its rank's local part as a plain
    tensor, and the receiver rebuilds the DTensor: the schedule's buffers and shape inference
    know plain tensors only, and each pair of tp ranks exchanges exactly its own part."""

    mesh: DeviceMesh  # the tp dimension
    placement: Shard | Replicate

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """What a stage sends: this rank's part (its gradient comes back as the same part)."""
        return x.to_local() if isinstance(x, DTensor) else x

    def distributed(self, x: torch.Tensor) -> DTensor:
        """What a stage receives, as the DTensor the blocks take."""
        return DTensor.from_local(x, self.mesh, [self.placement], run_check=False)

    def targets(self, t: torch.Tensor) -> Any:
        return replicated(t, self.mesh)


def residual_stream(dist: Distributed, sequence_parallel: bool) -> ResidualStream:
    """The layout `apply_tp` gives the residual stream (Shard(1): over the sequence)."""
    assert dist.mesh is not None, "opt.plan's mesh (Distributed.with_mesh) comes first"
    return ResidualStream(dist.mesh["tp"], Shard(1) if sequence_parallel else Replicate())


def apply_tp(model: GPT, cfg: DictConfig, dist: Distributed) -> None:
    """Splits `model`'s matmuls over the mesh's "tp" dimension, in place (parameter names and
    the global weights unchanged)."""
    check_tp_model(cfg.degree, model.config)
    assert dist.mesh is not None, "opt.plan's mesh (Distributed.with_mesh) comes first"
    mesh = dist.mesh["tp"]
    # The residual stream between the sub-layers: split over the sequence, or whole.
    residual = residual_stream(dist, cfg.sequence_parallel).placement

    def norm(module: nn.Module) -> None:
        if cfg.sequence_parallel:
            parallelize_module(module, mesh, SequenceParallel())
        else:
            _replicate(module, mesh)

    t = model.transformer  # a ModuleDict: indexed, its entries are modules
    # The embedding split over the vocabulary like the head it is tied to; its partial sums
    # reduced (scattered over the sequence under sequence parallelism).
    parallelize_module(
        t["wte"], mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=residual, use_local_output=False),
    )  # fmt: skip
    _replicate(t["wpe"], mesh, input_fn=_positions_as_dtensor)
    for block in model.transformer.h:
        norm(block.ln_1)
        norm(block.ln_2)
        sublayer_input = PrepareModuleInput(
            input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        parallelize_module(block, mesh, {
            "attn": sublayer_input,
            "attn.c_attn": _StridedColwise(parts=3),
            "attn.c_proj": RowwiseParallel(output_layouts=residual, use_local_output=False),
            "mlp": sublayer_input,
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=residual, use_local_output=False),
        })  # fmt: skip
        block.attn.n_head //= cfg.degree  # the heads this rank computes
    norm(t["ln_f"])
    # The head multiplies the whole sequence by the vocabulary shards: gather it after ln_f.
    parallelize_module(
        t["ln_f"], mesh,
        PrepareModuleOutput(output_layouts=residual, desired_output_layouts=Replicate(),
                            use_local_output=False),
    )  # fmt: skip
    # Tied again: the split made a new parameter.
    model.lm_head.weight = t["wte"].weight  # type: ignore[assignment]
    model.vocab_pad_mask = distribute_tensor(model.vocab_pad_mask, mesh, [Shard(0)])
    model.register_forward_pre_hook(_replicated_targets(mesh), with_kwargs=True)
    model.register_forward_hook(_plain_outputs)
    log(
        f"[opt] tp: {cfg.degree} ranks per group x {dist.dp_size} data-parallel, heads "
        f"{model.config.n_head // cfg.degree} per rank, sequence_parallel="
        f"{cfg.sequence_parallel}, loss_parallel={cfg.loss_parallel}"
    )


@dataclass
class Knobs:
    degree: Annotated[int, count(1)]  # ranks per tensor-parallel group
    sequence_parallel: bool
    loss_parallel: bool


def _plan(ctx: Context) -> None:
    """The degree, checked against the process count and the model before any work (the
    trainer builds the mesh from it: `dist.with_mesh(tp=plan.tp_degree)`)."""
    degree = ctx.knobs.degree
    mesh_shape(ctx.dist.world_size, 1, degree)  # refuses a process count degree does not divide
    m = ctx.cfg.model  # a pretrained model's own shape is checked again by apply_tp
    shape = GPTConfig(n_head=m.n_head, n_embd=m.n_embd, vocab_size=m.vocab_size,
                      pad_vocab_to=m.pad_vocab_to)  # fmt: skip
    check_tp_model(degree, shape)
    ctx.plan.tp_degree, ctx.plan.vocab_parallel_loss = degree, ctx.knobs.loss_parallel
    if ctx.knobs.loss_parallel:  # a function: each call a fresh context manager, which runs once
        ctx.plan.loss_context = loss_parallel
    ctx.plan.tp_sequence_parallel = ctx.knobs.sequence_parallel


STAGE = Stage(
    "tp", "model", lambda ctx: apply_tp(ctx.model, ctx.knobs, ctx.dist), Knobs, plan=_plan,
    conflicts={
        "custom_op": "the fused head + cross-entropy has no vocabulary-parallel form",
        "offload": "offload runs in one process, tp over several",
        "opt_in_backward": "each parameter would step before its gradient is reduced over the "
        "tensor-parallel ranks",
    },
    processes=("several", "launch with `torchrun --nproc_per_node=N train.py ...` (N a "
               "multiple of opt.tp.degree)"),
)  # fmt: skip
