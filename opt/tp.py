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
- async_tp: Inductor's micro-pipelined tensor parallelism rewrites each compiled all-gather that
  feeds a matmul (sequence parallelism's, before c_attn and c_fc) into one fused op that
  multiplies each rank's chunk as it arrives through symmetric memory: the transfer overlaps
  the multiply instead of preceding it (the collectives a GPT-2 large tp step left exposed).

`c_attn`'s rows are [q; k; v]: a plain column split would give rank 0 all of q and half of k.
Each rank takes its heads' rows of each third instead (a strided shard), so its q, k and v are
the same heads; the global weight keeps GPT-2's layout (checkpoints, one-process resume).
Parameters that are not split (LayerNorms, positions) are replicated DTensors on the same mesh,
so that FSDP and gradient clipping see one kind of parameter. The model returns plain tensors.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.distributed._symmetric_memory import enable_symm_mem_for_group
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

from base.distributed import Distributed, log, mesh_shape
from base.errors import ConfigError
from base.knobs import count
from model import GPT, GPTConfig
from opt.compile import CUDA_GRAPH_MODES
from opt.stage import Context, Plan, Stage


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
    mesh = dist.parallel.mesh
    assert mesh is not None, "the plan's mesh (Distributed.with_parallel) comes first"
    return ResidualStream(mesh["tp"], Shard(1) if sequence_parallel else Replicate())


def apply_tp(model: GPT, cfg: DictConfig, dist: Distributed) -> None:
    """Splits `model`'s matmuls over the mesh's "tp" dimension, in place (parameter names and
    the global weights unchanged)."""
    check_tp_model(cfg.degree, model.config)
    if cfg.async_tp and dist.device.type != "cuda":
        raise ConfigError(
            f"opt.tp.async_tp=true runs its fused ops over symmetric memory, on CUDA GPUs only, "
            f"not on {dist.device.type}: drop it"
        )
    # The residual stream between the sub-layers: split over the sequence, or whole.
    stream = residual_stream(dist, cfg.sequence_parallel)
    mesh, residual = stream.mesh, stream.placement
    enable_async_tp(mesh, cfg.async_tp)

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
        # Gathered as a DTensor into the first matmul: its input's gradient (a partial sum on each
        # rank) then goes back to the residual's layout in one reduce-scatter. A plain tensor
        # there would make the matmul sum that gradient whole (an all-reduce: twice the bytes),
        # and the gather's backward then keep only this rank's part of it.
        sublayer_input = PrepareModuleInput(
            input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=False
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
        f"{cfg.sequence_parallel}, loss_parallel={cfg.loss_parallel}, async_tp={cfg.async_tp}"
    )


class StridedLayout:
    """+opt=tp's checkpoint layout (its `checkpoint_layout`): the strided DTensors (`c_attn`'s
    fused QKV, and its optimizer state) saved gathered, in GPT-2's layout, so that DCP can write
    and reshard them and a one-process run can read them; split back as the model holds them on
    every load."""

    def saved(self, tree: Any) -> Any:
        """`tree` with its strided DTensors replicated (gathered: saved once)."""
        return _map_strided(tree, lambda t, _: _replicated(t))

    def own(self, tree: Any, like: Any) -> Any:
        """`tree` (loaded as `saved` laid it out) with the placements of `like`."""
        return _map_strided(tree, lambda t, own: _split_as(t, own), like)

    def restore_whole(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optim_state: dict[str, Any] | None,
    ) -> Callable[[], None]:
        """A whole (one-process) checkpoint's strided parameters and their optimizer state,
        taken before `set_state_dict` splits them (wrongly: `_split_strided`), put in place
        after it."""
        strided = _whole_strided(model, model_state, optim_state)
        return functools.partial(_split_strided, model, optimizer, strided)


def _strided(value: Any) -> bool:
    """A DTensor split in strides (+opt=tp's fused QKV: each rank a slice of q, of k and of v),
    which DCP cannot describe: its shards are not one block each."""
    return isinstance(value, DTensor) and any(
        isinstance(p, _StridedShard) for p in value.placements
    )


def _map_strided(tree: Any, fn: Callable[[DTensor, Any], Any], like: Any = None) -> Any:
    """`tree` with `fn(tensor, its counterpart in like)` in place of each strided DTensor."""
    if isinstance(tree, dict):
        return {k: _map_strided(v, fn, like.get(k) if like else None) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(
            _map_strided(v, fn, like[i] if like else None) for i, v in enumerate(tree)
        )
    return fn(tree, like) if _strided(like if like is not None else tree) else tree


def _replicated(t: DTensor) -> DTensor:
    """`t` gathered whole on every rank, its rows gathered as they were split, one mesh
    dimension at a time from the outermost: over a data-parallel dimension FSDP took chunks of
    each tp rank's rows (in rank order: concatenated back), over tp each rank took its share of
    every third of the fused QKV rows (`_StridedShard`'s split factor: the thirds rebuilt).
    Not torch's redistribute: torch 2.11 refuses a strided source outright, and 2.13 gathers
    the strided pair of +opt=[tp,fsdp] ((_StridedShard(0, sf=tp), _StridedShard(0, sf=3))
    over (dp, tp)) in one go, or by `full_tensor()`, into rows in the wrong order (measured)."""
    mesh, local = t.device_mesh, t.to_local()
    for dim, placement in enumerate(t.placements):
        if placement.is_replicate():
            continue
        parts = _gathered_rows(local, mesh.get_group(dim))
        innermost = all(p.is_replicate() for p in t.placements[dim + 1 :])
        if isinstance(placement, _StridedShard) and innermost:  # tp's share of each third
            pieces = int(placement.split_factor)
            local = torch.cat([p.chunk(pieces)[j] for j in range(pieces) for p in parts])
        else:  # FSDP's chunks of the rows below it
            local = torch.cat(parts)
    return DTensor.from_local(
        local, mesh, [Replicate()] * mesh.ndim, shape=t.shape, stride=t.stride(), run_check=False
    )


def _gathered_rows(local: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's `local` rows (their counts may differ: FSDP's last chunk), in rank order."""
    world = torch.distributed.get_world_size(group)
    count = torch.tensor([local.shape[0]], device=local.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    torch.distributed.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    padded = local.new_zeros((max(sizes), *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded, group=group)
    return [part[:size] for part, size in zip(parts, sizes, strict=True)]


def _split_as(full: DTensor, own: DTensor) -> DTensor:
    """`full` (replicated) laid out as `own`: this rank takes the rows that `_replicated` gathers
    from it. torch's split into a strided pair is as wrong as its gather in one go, and the
    rows' order is the pair's semantics: so each rank's row numbers are gathered, and read."""
    mesh, rows = own.device_mesh, own.shape[0]
    local_rows = own.to_local().shape[0]
    first = mesh.get_rank() * rows  # unique row ids: rank * rows + the local row
    ids = torch.arange(first, first + local_rows, device=own.device)
    where = _replicated(
        DTensor.from_local(
            ids, mesh, own.placements, shape=torch.Size([rows]), stride=(1,), run_check=False
        )
    ).to_local()  # global row -> the id of the rank's row that holds it
    mine = ((where >= first) & (where < first + local_rows)).nonzero().flatten()
    order = torch.empty_like(mine)
    order[where[mine] - first] = mine  # local row i is global row order[i]
    local = full.to_local().index_select(0, order.to(full.device))
    return DTensor.from_local(
        local, mesh, own.placements, shape=own.shape, stride=own.stride(), run_check=False
    )


def _whole_strided(
    model: torch.nn.Module, model_state: dict[str, Any], optim_state: dict[str, Any] | None
) -> dict[str, dict[str, torch.Tensor]]:
    """A whole (one-process) checkpoint's tensors of the model's strided parameters: each
    parameter's name -> {"param": its weight, and its optimizer state's tensors by key}."""
    saved_state = optim_state["state"] if optim_state is not None else {}
    return {
        name: {"param": model_state[name], **saved_state.get(name, {})}
        for name, param in model.named_parameters()
        if _strided(param)
    }


def _split_strided(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    strided: dict[str, dict[str, torch.Tensor]],
) -> None:
    """Puts the strided parameters of a whole checkpoint (`_whole_strided`), and their optimizer
    state, in place again by `_split_as`: `set_state_dict` splits a whole tensor into a strided
    pair (+opt=[tp,fsdp]) as wrongly as torch's one-go redistribute gathers it (`_replicated`)."""
    params = dict(model.named_parameters())
    for name, wholes in strided.items():
        param = params[name]
        owns = {"param": param, **optimizer.state.get(param, {})}
        for key, whole in wholes.items():
            own = owns.get(key)
            if not isinstance(own, DTensor) or not _strided(own):  # the step count; none
                continue
            whole = DTensor.from_local(
                whole.to(own.device, own.dtype), own.device_mesh,
                [Replicate()] * own.device_mesh.ndim, run_check=False,
            )  # fmt: skip
            with torch.no_grad():
                own.to_local().copy_(_split_as(whole, own).to_local())


def enable_async_tp(mesh: DeviceMesh | None, on: bool) -> None:
    """Inductor's micro-pipelined tp for the collectives over `mesh` (a process-wide Inductor
    setting: set by every tp run, reset by every other, as compile's are): the pass fuses the
    collectives of a group registered for symmetric memory only (torch 2.11 and 2.13 check it),
    although the registration call is marked deprecated."""
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = on
    if on and mesh is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable_symm_mem_for_group(mesh.get_group().group_name)


def check_with_plan(knobs: Any, plan: Plan) -> None:
    """Refuses async_tp where its fusion cannot happen, before any work starts."""
    if knobs.async_tp and not plan.compiled:
        raise ConfigError(
            "opt.tp.async_tp=true fuses collectives with matmuls inside compiled graphs: add "
            "+opt=compile, or drop it"
        )
    if knobs.async_tp and not knobs.sequence_parallel:
        raise ConfigError(
            "opt.tp.async_tp=true overlaps sequence parallelism's all-gathers, which "
            "opt.tp.sequence_parallel=false does not have: set it to true, or drop async_tp"
        )


def cuda_graphs_hint(plan: Plan, compile_mode: str | None, device: torch.device) -> str | None:
    """The line that tells a GPU run of plain tp (no pipeline, no data parallelism) how to
    replay its step as CUDA graphs, when it does not: without them its ranks wait on each
    other's host, DTensor dispatching every op from Python. None where that does not apply."""
    layout = plan.parallel
    if device.type != "cuda" or layout.tp != layout.world_size or layout.pp > 1:
        return None
    if plan.compiled and compile_mode in CUDA_GRAPH_MODES:
        return None
    missing = "opt.compile.mode=reduce-overhead" if plan.compiled else (
        "+opt=compile opt.compile.mode=reduce-overhead")  # fmt: skip
    return (
        f"[opt] tp: its step waits on the host on GPUs; {missing} replays it as CUDA graphs "
        "(GPT-2 large, 2 H200s: 1.24x one GPU instead of 0.83x; docs/distributed.md)"
    )


def _check_plan(ctx: Context) -> None:
    check_with_plan(ctx.knobs, ctx.plan)
    compile_mode = ctx.cfg.opt.compile.mode if ctx.plan.compiled else None
    hint = cuda_graphs_hint(ctx.plan, compile_mode, ctx.dist.device)
    if hint:
        log(hint)


@dataclass
class Knobs:
    degree: Annotated[int, count(1)]  # ranks per tensor-parallel group
    sequence_parallel: bool
    loss_parallel: bool
    async_tp: bool


def _plan(ctx: Context) -> None:
    """The degree, checked against the process count and the model before any work (the
    trainer builds the mesh from it: `Distributed.with_parallel`)."""
    degree = ctx.knobs.degree
    mesh_shape(ctx.dist.world_size, 1, degree)  # refuses a process count degree does not divide
    m = ctx.cfg.model  # a pretrained model's own shape is checked again by apply_tp
    shape = GPTConfig(n_head=m.n_head, n_embd=m.n_embd, vocab_size=m.vocab_size,
                      pad_vocab_to=m.pad_vocab_to)  # fmt: skip
    check_tp_model(degree, shape)
    ctx.plan.parallel.tp, ctx.plan.vocab_parallel_loss = degree, ctx.knobs.loss_parallel
    if ctx.knobs.loss_parallel:  # a function: each call a fresh context manager, which runs once
        ctx.plan.loss_context = loss_parallel
    ctx.plan.tp_sequence_parallel = ctx.knobs.sequence_parallel


STAGE = Stage(
    "tp", "model", lambda ctx: apply_tp(ctx.model, ctx.knobs, ctx.dist), Knobs, plan=_plan,
    check_plan=_check_plan,
    unselected=lambda ctx: enable_async_tp(None, False),
    conflicts={
        "custom_op": "the fused head + cross-entropy has no vocabulary-parallel form",
        "offload": "offload runs in one process, tp over several",
        "opt_in_backward": "each parameter would step before its gradient is reduced over the "
        "tensor-parallel ranks",
    },
    checkpoint_layout=StridedLayout(),
    processes=("several", "launch with `torchrun --nproc_per_node=N train.py ...` (N a "
               "multiple of opt.tp.degree)"),
)  # fmt: skip
