"""The memory planner's model: a training run's peak GPU memory from the model's shapes and the
chosen stages alone, for `python scripts/plan_memory.py` (measure/plan_memory.py). The model is
built on the meta device (shapes only) and the stages are planned by `opt.plan`.

The peak is the largest of five moments of a steady-state step (the optimizer state exists),
each a sum of categories, all in bytes of the caching allocator's *allocated* memory:

    forward        the loss just computed: every saved activation, the loss's buffers, autocast's
                   weight copies (alive to the end of the autocast region)
    loss_backward  the loss's backward: its gradient buffers beside every saved activation
    backward       the last block's backward (under checkpointing: recomputed first)
    backward_end   the first block's backward: every gradient exists, activations are gone
    step           the optimizer update over the complete gradients

Categories: weights, gradients, optimizer_state (with the update's temporaries), activations
(saved for backward, per AC mode and policy, plus one block's backward working set), logits_loss
(the head's logits and the loss's buffers), autocast_copies (low-precision weight casts),
comm_buckets (DDP's gradient buckets, FSDP's gathered blocks and reduce-scatter inputs per rank,
a pipeline's receive buffers) and slack (a calibrated fraction for what the model leaves out:
small tensors, per-op workspaces, the allocator's 512-byte rounding).

Parallel layouts are planned rank by rank, and the peak is the worst rank's (Prediction.rank):
  +opt=tp  each rank holds 1/degree of what opt/tp.py splits (c_attn and c_fc by columns, both
           c_proj by rows, their biases alike except the row-split c_proj's, and the
           vocabulary-split embedding that is the head); LayerNorms and wpe whole. In a block's
           saved tensors, what the matmuls make (q, k, v, attention's output, the MLP's hidden
           units) is 1/degree; a matmul's input is whole on every rank (sequence_parallel
           all-gathers it; DTensor saves the gathered copy); the residual stream, LayerNorms'
           inputs and dropout masks are 1/degree under sequence_parallel, whole without.
           loss_parallel keeps the logits and the loss's buffers 1/degree; without it they are
           gathered: one GPU's.
  +opt=pp  rank r holds the blocks of stages r, r+degree, ... as opt/pp.py's `stage_starts`
           splits them; the first stage the embeddings, the last ln_f and its own copy of the
           tied embedding as the head (with its gradient and AdamW state: two ranks hold one).
           Tokens are a micro-batch's (the step's batch / opt.pp.microbatches). The schedule sets
           how many micro-batches' activations a rank keeps at once (`in_flight`): gpipe all of
           them, 1f1b at most degree - r (rank 0 the most), interleaved_1f1b torch's warmup plus
           one, in chunks of its stages; at most one micro-batch is in backward at a time, and
           without checkpointing each keeps its own autocast casts. Gradients exist at the peak
           when a backward ran before it (1f1b's and interleaved's steady state; not gpipe's).
           The pipeline's receive buffers (one per micro-batch, of the residual stream, forward
           on every stage but the first, backward on every stage but the last) are comm_buckets.
           Under FSDP the schedule defers the reduction to the last micro-batch and keeps the
           blocks it ran backward through unsharded (torch's pipelining sets
           reshard_after_backward=False): whole gradients and gathered blocks until then.
Data parallelism on a mesh (tp or pp with more processes, without +opt=fsdp) is FSDP2's
replicate: each root (the model, or a stage) reduces its gradients through one flat float32 copy
at the end of backward. These are derived from the code, not yet measured: --validate checks them
against the scaling ladder's tp and pp rows once they exist.

Refused: a stage not in MODELLED (one added to opt/ until its memory is modelled here). Not
modelled: +opt=compile is planned as eager (an upper bound: Inductor fuses elementwise ops and
the loss, and saves less: the speed ladder's compiled rows measure up to ~50% below it);
torchao's and cuBLAS's workspaces beyond the slack; the reserved-but-unallocated memory of the
allocator (--fit allows for it with one measured factor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from omegaconf import DictConfig

import opt
from base.distributed import Distributed
from base.errors import ConfigError
from model import GPT, GPTConfig
from opt.ac import apply_ac
from opt.custom_op import apply_custom_op
from opt.pp import stage_starts

GIB = 2**30
# The one calibrated constant of the prediction: what the category model leaves out (LayerNorm
# statistics, attention's log-sum-exp, bias casts, cuBLAS/attention workspaces, per-op
# temporaries, 512-byte rounding), as a fraction of the modelled bytes. Fitted once against the
# measured rows: the median of measured / modelled - 1 over the --validate rows (1.8%).
SLACK = 0.018
MOMENTS = ("forward", "loss_backward", "backward", "backward_end", "step")

# ---- the inputs: the stage plan, the model's shapes


@dataclass
class Shapes:
    """The parameter counts of what one rank holds, from a GPT built on the meta device (no
    storage): the whole model, or its part under +opt=tp and +opt=pp (`Part`)."""

    n_layer: int  # the blocks this rank runs
    n_embd: int
    n_head: int  # the model's (each of +opt=tp's ranks computes 1/degree of them)
    vocab: (
        int  # the logits' width on this rank: the padded vocabulary, 1/degree under loss_parallel
    )
    dropout: float
    sizes: list[int]  # every parameter's number of values on this rank (a tied weight once)
    block: int  # one transformer block's parameters
    root: int  # the parameters outside the blocks: wte (the tied head), wpe, ln_f
    matmul: int  # the weights autocast casts for a matmul: the blocks' Linear weights, the head
    head: int  # the head's weight (the tied embedding): V x C, none off a pipeline's last stage

    @property
    def params(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class Part:
    """The part of the model one rank holds: its blocks, the embeddings (a pipeline's first
    stage), ln_f and the head (its last), each split over `tp` ranks as opt/tp.py splits it."""

    blocks: list[int]
    first: bool = True
    last: bool = True
    tp: int = 1
    loss_parallel: bool = False


# The parameters +opt=tp splits over its ranks (opt/tp.py): the column-split matmuls with their
# biases, the row-split projections without theirs (added after the reduction: whole), the
# vocabulary-split embedding. The others (LayerNorms, wpe, c_proj's biases) are replicated.
TP_SPLIT = ("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias", "c_proj.weight",
            "wte.weight")  # fmt: skip


def meta_model(cfg: DictConfig) -> GPT:
    """The configured GPT on the meta device: shapes without storage (`model.pretrained`
    presets carry their checkpoint's shape)."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    with torch.device("meta"):
        return GPT(GPTConfig(**{k: v for k, v in cfg.model.items() if k in fields}))


def model_shapes(model: GPT, part: Part | None = None) -> Shapes:
    """The parameter counts the categories need, of `part` (None: the whole model)."""
    config, t = model.config, cast(Any, model.transformer)  # a ModuleDict: untyped attributes
    part = part or Part(list(range(config.n_layer)))

    def local(name: str, p: torch.Tensor) -> int:
        return p.numel() // part.tp if name.endswith(TP_SPLIT) else p.numel()

    def block_sizes(i: int) -> list[int]:
        return [local(n, p) for n, p in t.h[i].named_parameters()]

    wte = local("wte.weight", t.wte.weight)
    head = wte if part.last else 0
    embeddings = [wte, t.wpe.weight.numel()] if part.first else []
    ending = [p.numel() for p in t.ln_f.parameters()] if part.last else []
    if part.last and not part.first:  # its own copy of the tied embedding (opt/pp.py's prune)
        ending.append(head)
    sizes = [n for i in part.blocks for n in block_sizes(i)] + embeddings + ending
    block = sum(block_sizes(part.blocks[0]))
    linear = sum(
        local(f"{name}.weight", m.weight)
        for name, m in t.h[part.blocks[0]].named_modules()
        if isinstance(m, torch.nn.Linear)
    )
    padded = config.padded_vocab_size
    return Shapes(
        n_layer=len(part.blocks), n_embd=config.n_embd, n_head=config.n_head,
        vocab=padded // part.tp if part.loss_parallel else padded, dropout=config.dropout,
        sizes=sizes, block=block, root=sum(sizes) - len(part.blocks) * block,
        matmul=len(part.blocks) * linear + head,  # the head is a Linear too (its weight is wte's)
        head=head,
    )  # fmt: skip


def check_model_stages(model: GPT, cfg: DictConfig, stages: list[str]) -> None:
    """The model stages' own checks of their knobs (custom_op, ac), applied to the meta model as
    train.py applies them, so that a bad knob is refused here too."""
    with contextlib.redirect_stdout(io.StringIO()):
        if "custom_op" in stages:
            apply_custom_op(model, cfg.opt.custom_op)
        if "ac" in stages:
            apply_ac(model, cfg.opt.ac)


@dataclass
class Setup:
    """What the stages decided that memory depends on (`in_flight` fills the last four for each
    of a pipeline's ranks)."""

    stages: list[str]
    world: int  # processes
    shards: int  # FSDP's: its data-parallel processes, or under HSDP one replica's
    tokens: int  # tokens per micro-batch on this rank (a pipeline's micro-batch under +opt=pp)
    defer_reduce: bool
    compute: int  # bytes per value of the compute dtype: 2 under amp, else 4
    residual: int  # bytes per value of the residual stream
    autocast: bool  # autocast runs (amp without FSDP's pure mixed precision)
    weight_cache: bool
    step_in_backward: bool
    optimizer: str  # foreach | forloop | fused | lowbit8 | lowbit4
    ac: DictConfig | None  # the ac stage's knobs, None without checkpointing
    custom_op: DictConfig | None
    ddp: DictConfig | None  # DDP's knobs when several processes run without FSDP or a mesh
    sharded: str = ""  # fsdp | offload | "" (not sharded)
    gathered: int = 4  # bytes per value of FSDP's all-gathered parameters
    unit_blocks: int = 1  # blocks FSDP gathers as one unit (opt.fsdp.blocks_per_unit)
    stored: int = 4  # bytes per value of the weights and their gradients (opt.lowbit.weights)
    replicated: bool = False  # FSDP2's replicate: data parallelism on a mesh, without FSDP
    tp: int = 1  # +opt=tp's degree
    sequence_parallel: bool = False  # +opt=tp's residual stream split over the sequence
    pp: DictConfig | None = None  # +opt=pp's knobs, None without a pipeline
    # Earlier micro-batches' gradients exist at the peak (accumulation, a pipeline's steady state)
    accumulated: bool = False
    flight: float = 1.0  # micro-batches of this rank's blocks whose activations are kept at once
    loss_flight: int = 1  # micro-batches whose loss buffers the last stage keeps at once
    pipe_buffers: int = 0  # the pipeline's receive buffers (each a step's residual stream)


# The stages this model covers, by what each changes of a step's memory. A stage not listed is
# refused, naming it, rather than planned as if it were absent: any stage added to opt/ until its
# memory is modelled here.
MODELLED = frozenset({
    "bs", "accum",  # the micro-batch's tokens; the earlier micro-batches' gradients
    "workers", "non_blocking", "tf32",  # nothing of their own in the GPU's allocated memory
    "compile",  # planned as eager: an upper bound
    "amp", "ac", "custom_op",  # the compute dtype and autocast's casts; activations; the head
    "foreach", "forloop", "fused", "lowbit", "opt_in_backward",  # the optimizer's state and update
    "ddp", "fsdp", "offload",  # DDP's buckets; FSDP's shards and gathered blocks; the host's share
    "tp", "pp",  # each rank's part of the model; a pipeline's micro-batches in flight
})  # fmt: skip


def plan_setup(cfg: DictConfig, nproc: int) -> Setup:
    """The stage plan, by `opt.plan` itself on a fake rank 0 of `nproc` (its log lines are kept
    out of the output)."""
    dist = Distributed(rank=0, local_rank=0, world_size=nproc, device=torch.device("cpu"))
    with contextlib.redirect_stdout(io.StringIO()):
        p = opt.plan(cfg, dist)
    o, stages, parallel = cfg.opt, p.stages, p.parallel
    unmodelled = [s for s in stages if s not in MODELLED]
    if unmodelled:
        raise ConfigError(
            f"+opt={unmodelled[0]} is not modelled by the memory planner (it models "
            f"{', '.join(s for s in opt.ORDER if s in MODELLED)}): measure it, or plan the run "
            "without it"
        )
    amp = p.amp_dtype is not None
    pure = amp and p.pure_low_precision
    if "lowbit" in stages:
        optimizer = f"lowbit{o.lowbit.bits}"
    else:
        # PyTorch's default on a GPU is foreach (multi-tensor)
        optimizer = next((s for s in ("forloop", "foreach", "fused") if s in stages), "foreach")
    # The planned run is on a GPU, where offload acts (opt.offload.offloads)
    sharded = "fsdp" if "fsdp" in stages else "offload" if "offload" in stages else ""
    data_parallel = parallel.dp_size > 1 and not sharded
    pp = o.pp if parallel.pp_enabled else None
    return Setup(
        stages=stages, world=nproc, shards=parallel.dp_shard,
        tokens=p.micro_batch_size // (pp.microbatches if pp else 1) * cfg.model.block_size,
        # the pipeline reduces over the data-parallel ranks after its last micro-batch only
        defer_reduce=p.defer_reduce or pp is not None,
        compute=2 if amp else 4,
        residual=p.residual_dtype.itemsize if p.residual_dtype else 2 if pure else 4,
        autocast=amp and not pure, weight_cache=p.amp_weight_cache,
        step_in_backward=p.step_in_backward, optimizer=optimizer,
        ac=o.ac if "ac" in stages else None,
        custom_op=o.custom_op if "custom_op" in stages else None,
        ddp=(o.get("ddp") or opt.ddp.default_knobs())
        if data_parallel and not parallel.meshed else None,
        sharded=sharded, gathered=2 if pure else 4,
        unit_blocks=o.fsdp.blocks_per_unit if sharded == "fsdp" else 1,
        stored=p.weights_dtype.itemsize if p.weights_dtype is not None else 4,
        replicated=data_parallel and parallel.meshed, tp=parallel.tp,
        sequence_parallel=parallel.tp_enabled and p.tp_sequence_parallel, pp=pp,
        accumulated=p.micro_steps > 1,
    )  # fmt: skip


def in_flight(pp: DictConfig, rank: int, stage_blocks: list[int]) -> tuple[float, int, bool]:
    """A pipeline rank's micro-batches in flight at its peak, from the schedule's order (torch's
    `torch.distributed.pipelining` schedules): its blocks' activations kept at once, counted in
    micro-batches of all its blocks; the last stage's loss buffers kept at once (meaningful on
    the rank holding it); whether a backward ran before (its gradients exist).

      gpipe             every micro-batch's forward, then every backward: all of them
      1f1b              min(microbatches, degree - rank) forwards before the first backward,
                        then one forward, one backward
      interleaved_1f1b  torch's warmup, (stages_per_rank - 1) x micro-batches per round + 2 per
                        rank after this one, then one more forward; chunk k runs local stage
                        (k // per round) mod stages_per_rank"""
    m, degree, local = pp.microbatches, pp.degree, len(stage_blocks)
    if pp.schedule == "gpipe":
        chunks = [0] * m
    elif pp.schedule == "1f1b":
        chunks = [0] * min(m, degree - rank)
    else:
        per_round = m // max(1, m // degree)
        warmup = (local - 1) * per_round + 2 * (degree - 1 - rank)
        chunks = [(k // per_round) % local for k in range(min(warmup + 1, m * local))]
    flight = sum(stage_blocks[i] for i in chunks) / sum(stage_blocks)
    accumulated = pp.schedule != "gpipe" and len(chunks) < m * local
    return flight, chunks.count(local - 1), accumulated


def rank_parts(model: GPT, cfg: DictConfig, u: Setup) -> list[tuple[Shapes, Setup]]:
    """Each distinct rank's shapes and setup: one for a run whose ranks are alike, one per
    pipeline rank under +opt=pp (its blocks as opt/pp.py's `stage_starts` splits them)."""
    loss_parallel = u.tp > 1 and cfg.opt.tp.loss_parallel
    if u.pp is None:
        blocks = list(range(model.config.n_layer))
        return [(model_shapes(model, Part(blocks, tp=u.tp, loss_parallel=loss_parallel)), u)]
    n_stages = u.pp.degree * u.pp.stages_per_rank
    starts = stage_starts(model.config.n_layer, u.pp.split, n_stages)
    parts = []
    for rank in range(u.pp.degree):
        mine = list(range(rank, n_stages, u.pp.degree))
        blocks = [i for s in mine for i in range(starts[s], starts[s + 1])]
        first, last = mine[0] == 0, mine[-1] == n_stages - 1
        part = Part(blocks, first, last, tp=u.tp, loss_parallel=loss_parallel)
        flight, loss_flight, accumulated = in_flight(
            u.pp, rank, [starts[s + 1] - starts[s] for s in mine]
        )
        buffers = sum(s != 0 for s in mine) + sum(s != n_stages - 1 for s in mine)
        setup = dataclasses.replace(
            u, flight=flight, loss_flight=loss_flight, accumulated=accumulated,
            pipe_buffers=buffers,
        )  # fmt: skip
        parts.append((model_shapes(model, part), setup))
    return parts


# ---- the categories, each as bytes at every moment (derivations in the comments)


def moments(**values: float) -> dict[str, float]:
    """A category's bytes per moment: `all=x` for every one, then per-moment values."""
    everywhere = values.pop("all", 0.0)
    return {m: values.get(m, everywhere) for m in MOMENTS}


def weights(s: Shapes, u: Setup) -> dict[str, float]:
    """float32 master weights, 4 bytes per parameter (2 with opt.lowbit.weights=bfloat16: the
    vectors' float32, 0.1% of GPT-2's parameters, is not modelled). FSDP keeps 1/W of them per
    rank, and the root (wte, wpe, ln_f: reshard_after_forward=False) whole from forward to
    backward's end. Offload keeps none on the GPU but the root, unsharded during forward and
    backward (its gathered blocks are comm_buckets)."""
    if u.sharded == "offload":
        return moments(all=4 * s.root, step=0)
    if u.sharded == "fsdp":
        shard = 4 * s.params / u.shards
        root = u.gathered * s.root * (u.shards - 1) / u.shards
        return moments(all=shard + root, step=shard)
    return moments(all=u.stored * s.params)


def gradients(s: Shapes, u: Setup) -> dict[str, float]:
    """float32 gradients, 4 bytes per parameter, from backward to the step (set to None after).
    With accumulation (or in a pipeline's steady state) they live through the later
    micro-batches' forward too. In backward's last block only the head's (wte: V x C) exist yet,
    all at its end. opt_in_backward frees a block's once the block has stepped: one block's at a
    time, the largest parameter (wte's) at the end. DDP's live in its buckets (comm_buckets). In
    the weights' dtype (`stored`)."""
    everything, head = u.stored * s.params, u.stored * s.head
    if u.step_in_backward:
        return moments(
            all=0, loss_backward=head, backward=u.stored * s.block,
            backward_end=u.stored * max(s.sizes),
        )  # fmt: skip
    if u.ddp is not None and u.ddp.gradient_as_bucket_view:
        return moments(all=0)
    if u.sharded == "offload":  # copied to the host as produced: the root's and one block's
        return moments(all=0, backward=4 * s.root, backward_end=4 * (s.root + s.block))
    shard = everything / u.shards if u.sharded == "fsdp" else everything
    if u.sharded == "fsdp" and u.pp is None:  # reduce-scattered block by block; the root's whole
        # earlier micro-batches' gradients: sharded, or whole when their reduction waits
        earlier = 0 if not u.accumulated else everything if u.defer_reduce else shard
        return moments(
            forward=earlier, loss_backward=earlier + head, backward=earlier + 4 * s.root,
            backward_end=shard + 4 * s.root, step=shard,
        )  # fmt: skip
    # whole until the step; a pipeline's FSDP reduce-scatters them after its last micro-batch
    earlier = everything if u.accumulated else 0
    return moments(
        forward=earlier, loss_backward=earlier + head, backward=max(earlier, head),
        backward_end=everything, step=shard,
    )  # fmt: skip


def lowbit_state(sizes: list[int], bits: int) -> float:
    """torchao's AdamW8bit/4bit: for a tensor of >= 4096 values each moment is `bits` per value
    plus a float32 scale per block of 256 (8-bit) or 128 (4-bit) values; smaller tensors keep
    float32 moments (opt/lowbit.py)."""
    block = 256 if bits == 8 else 128
    total = 0.0
    for n in sizes:
        per_moment = n * bits / 8 + 4 * math.ceil(n / block) if n >= 4096 else 4 * n
        total += 2 * per_moment
    return total


def optimizer_state(s: Shapes, u: Setup) -> dict[str, float]:
    """AdamW's two float32 moments (8 bytes per parameter; 1/W under FSDP, none on the GPU with
    offload) or torchao's low-bit ones, present in every moment of a steady-state step; plus the
    update's temporaries: foreach's `_foreach_sqrt` of every exp_avg_sq (4 bytes per parameter),
    the for-loop's of one parameter (the largest), none for the fused kernel or torchao's
    compiled update (one fused kernel per parameter)."""
    if u.sharded == "offload":
        return moments(all=0)
    bits = {"lowbit8": 8, "lowbit4": 4}.get(u.optimizer)
    state = lowbit_state(s.sizes, bits) if bits else 8 * s.params
    temporary = {"foreach": 4 * s.params, "forloop": 4 * max(s.sizes)}.get(u.optimizer, 0)
    shard = u.shards if u.sharded == "fsdp" else 1
    if u.step_in_backward:  # each update in backward: one block's temporaries at a time
        one = {"foreach": 4 * s.block, "forloop": 4 * max(s.sizes)}.get(u.optimizer, 0)
        return moments(all=state, backward_end=state + one)
    return moments(all=state / shard, step=(state + temporary) / shard)


def block_saved(u: Setup, c: int, n_head: int, dropout: float) -> dict[str, float]:
    """Bytes per token that one block saves for backward, without checkpointing, by sub-layer
    (pre-LayerNorm GPT-2 block, model/gpt.py):

      attn: ln_1's input x (the residual; LayerNorm runs in float32 under autocast, so its
            saved input is float32 unless FSDP's pure mode) + c_attn's input (ln_1's output,
            cast to the compute dtype) + qkv (3C, SDPA's q, k, v are views of it) + SDPA's
            output (C; flash/efficient attention lay it out (B, T, H, D), so the transpose's
            .contiguous() is free and c_proj's input is the same tensor) + its log-sum-exp
            (float32 per head)
      mlp:  ln_2's input (the residual after attention) + c_fc's input (ln_2's output, cast) +
            c_fc's output (4C, GELU's input) + GELU's output (4C, c_proj's input)
      dropout > 0: a bool mask (1 byte per value) per residual dropout.
    The residual adds save nothing (an add's backward needs no input). Under +opt=tp the
    matmuls' outputs are 1/degree (this rank's heads and hidden units), their inputs whole, and
    the residual stream's tensors 1/degree under sequence_parallel (`split`)."""
    split = u.tp if u.sequence_parallel else 1
    ln_in = c * (u.residual if not u.autocast else 4) / split
    mask = (c if dropout > 0 else 0) / split
    return {
        "attn": ln_in + c * u.compute * (1 + (3 + 1) / u.tp) + 4 * n_head / u.tp + mask,
        "mlp": ln_in + c * u.compute * (1 + (4 + 4) / u.tp) + mask,
    }


def activations(s: Shapes, u: Setup) -> dict[str, float]:
    """What forward saves for backward, for this rank's micro-batch of N tokens, per AC mode:

      none:      every block's saved tensors (block_saved)
      full:      each block keeps only its input (the residual stream, C values); backward
                 recomputes one block at a time, its saved tensors alive while it runs
      op:        the block's input plus the outputs of its matmuls (c_attn 3C, attn c_proj C,
                 c_fc 4C, mlp c_proj C) and of SDPA (C, its log-sum-exp): 10C in the compute
                 dtype; the elementwise ops are recomputed
      selective: every `every`-th block checkpointed as `full` (target=block) or only its attn
                 or mlp sub-layer, which then keeps its input (a LayerNorm output, float32)
    plus ln_f's input (C, the residual) for the head (a pipeline stage's output, kept for its
    backward), and in backward one block's working set: the gradient of the residual (C,
    float32, and its sum with the branch's) and of the widest activation (4C in the compute
    dtype). A pipeline keeps the other micro-batches in flight (`flight`) all along."""
    c, n, layers = s.n_embd, u.tokens, s.n_layer
    split = u.tp if u.sequence_parallel else 1  # the residual stream's share on this rank
    saved = block_saved(u, c, s.n_head, s.dropout)
    plain = saved["attn"] + saved["mlp"]
    block_input = c * u.residual / split
    mode = u.ac.mode if u.ac is not None else "none"
    if mode == "none":
        per_layer, recompute = [plain] * layers, 0.0
    elif mode == "full":
        per_layer, recompute = [block_input] * layers, plain
    elif mode == "op":  # the projections' outputs are reduced to the residual's layout
        kept = block_input + c * u.compute * (8 / u.tp + 2 / split) + 4 * s.n_head / u.tp
        per_layer, recompute = [kept] * layers, plain - kept
    else:  # selective
        every, target = u.ac.every, u.ac.target
        region_input = 4 * c  # the sub-layer's input: a LayerNorm output (float32)
        checkpointed = {
            "block": block_input,
            "attn": region_input + saved["mlp"],
            "mlp": saved["attn"] + region_input,
        }[target]
        per_layer = [checkpointed if i % every == 0 else plain for i in range(layers)]
        recompute = plain - checkpointed + block_input
    working = c * (2 * 4 / split + 4 * u.compute / u.tp)
    head_input = c * u.residual / split
    total = n * (sum(per_layer) + head_input)
    others = max(u.flight - 1, 0) * total
    return moments(
        forward=total + others,
        loss_backward=total + others,
        backward=total + others + n * (recompute + working),
        backward_end=n * (per_layer[0] + recompute + working) + others,
        step=0,
    )


def logits_loss(s: Shapes, u: Setup) -> dict[str, float]:
    """The head (hidden @ wte^T) and the cross-entropy over N tokens x V (padded vocabulary;
    this rank's share under loss_parallel), on the rank that holds the head.

    Plain head: forward holds the logits in the compute dtype, their float32 upcast and
    log_softmax's float32 output (kept for backward) at once; backward holds that output, the
    loss's gradient of it and log_softmax's gradient (float32 each), then the head's weight
    gradient (V x C, float32). A pipeline's last stage keeps each micro-batch in flight's
    log_softmax output until its backward (`loss_flight`).
    custom_op: per chunk of `chunk_size` tokens a logits buffer (chunk x V, compute dtype); the
    operator returns the hidden states' gradient (N x C, compute dtype) and the weight's (V x C,
    float32), kept for backward, and takes autocast casts of hidden and the weight; its backward
    scales them: a float32 copy of each and the weight's cast back to its dtype."""
    if not s.head:
        return moments(all=0)
    c, n, v = s.n_embd, u.tokens, s.vocab
    casts = (n * c + v * c) * u.compute if u.autocast else 0
    if u.custom_op is not None:
        chunk = min(u.custom_op.chunk_size or n, n)
        saved = n * c * u.compute + 4 * v * c
        forward = saved + casts + chunk * v * u.compute + 4 * n
        backward = saved + 4 * n * c + v * c * (4 + u.compute)
        return moments(all=0, forward=forward, loss_backward=backward)
    upcast = 4 * n * v if u.compute != 4 else 0
    held = (u.loss_flight - 1) * 4 * n * v  # the other micro-batches' log_softmax outputs
    forward = n * v * (u.compute + 4) + upcast
    backward = 3 * 4 * n * v
    return moments(all=held, forward=held + forward, loss_backward=held + backward, step=0)


def autocast_copies(s: Shapes, u: Setup) -> dict[str, float]:
    """Autocast's low-precision casts of the weights (compute-dtype bytes per matmul weight).
    With its cache on, every cast lives to the end of the forward (the autocast region);
    without checkpointing the matmuls save their casts for backward anyway (cache or not),
    freed as backward passes each, and each micro-batch a pipeline keeps in flight holds its
    own. The plain head saves its weight's cast for backward. Weights stored in the compute
    dtype need no cast."""
    if not u.autocast or u.stored == u.compute:
        return moments(all=0)
    every = u.compute * s.matmul
    head = u.compute * s.head if u.custom_op is None else 0
    blocks = every - u.compute * s.head
    checkpointed = u.ac is not None and u.ac.mode != "selective"
    if not checkpointed:
        others = max(u.flight - 1, 0) * blocks + (u.loss_flight - 1) * head
        return moments(
            all=0, forward=every + others, loss_backward=every + others,
            backward=blocks + head + others, backward_end=others,
        )  # fmt: skip
    forward = every if u.weight_cache else head
    return moments(all=0, forward=forward, loss_backward=head, backward=head)


def comm_buckets(s: Shapes, u: Setup) -> dict[str, float]:
    """Per rank. DDP: its gradient buckets (every gradient, float32) exist from construction on;
    with gradient_as_bucket_view the gradients are views into them (no second copy), else the
    gradients are copied in. FSDP and offload: the all-gathered (copied-in) unit being run and
    the one prefetched (gathered dtype; a unit is opt.fsdp.blocks_per_unit blocks), and in
    backward a unit's unsharded gradients for its reduce-scatter (float32); in a pipeline every
    block this rank ran backward through stays gathered until its last micro-batch. FSDP2's
    replicate: one flat float32 copy of the root's gradients for the all-reduce, at backward's
    end. A pipeline's receive buffers: the step's residual stream (this rank's share) per
    buffer, from the first step on."""
    split = u.tp if u.sequence_parallel else 1
    pipe = (
        u.pipe_buffers * u.tokens * u.pp.microbatches * s.n_embd * u.residual / split
        if (u.pp is not None)
        else 0
    )
    if u.ddp is not None:
        return moments(all=4 * s.params + pipe)
    if u.replicated:
        return moments(all=pipe, backward_end=pipe + 4 * s.params)
    if u.sharded:
        gathered = 2 * s.block * u.unit_blocks * u.gathered
        reduce = 4 * s.block * u.unit_blocks
        kept = u.gathered * (s.params - s.root) if u.pp is not None else gathered
        return moments(
            all=gathered + pipe, backward=kept + reduce + pipe, backward_end=kept + reduce + pipe,
            step=pipe,
        )  # fmt: skip
    return moments(all=pipe)


PARTS = (
    weights, gradients, optimizer_state, activations, logits_loss, autocast_copies, comm_buckets,
)  # fmt: skip
CATEGORIES = (*(part.__name__ for part in PARTS), "slack")  # a prediction's, in this order


@dataclass
class Prediction:
    moment: str  # the moment of the peak
    categories: dict[str, float]  # bytes per category at the peak
    everything: dict[str, dict[str, float]] = field(default_factory=dict)  # per moment
    rank: int = 0  # the pipeline rank predicted (+opt=pp's ranks differ; other ranks are alike)
    ranks: int = 1  # the pipeline's ranks: +opt=pp's degree

    @property
    def peak_gib(self) -> float:
        return sum(self.categories.values()) / GIB

    @property
    def phase(self) -> str:
        """forward, backward or step."""
        return "backward" if "backward" in self.moment else self.moment

    @property
    def when(self) -> str:
        """The phase, and the moment where it says more."""
        return self.phase if self.phase == self.moment else f"{self.phase} ({self.moment})"

    @property
    def on_rank(self) -> str:
        """Which rank's peak it is, where the ranks differ (a pipeline's)."""
        return f", pipeline rank {self.rank} of {self.ranks}" if self.ranks > 1 else ""

    @property
    def sets_peak(self) -> str:
        """The largest category at the peak."""
        return max(self.categories, key=lambda k: self.categories[k])

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peak_gib": round(self.peak_gib, 3)}
        out |= {k: round(v / GIB, 3) for k, v in self.categories.items()}
        out |= {"phase": self.phase, "moment": self.moment, "sets_peak": self.sets_peak}
        return out | {"rank": self.rank}


def predict_ranks(cfg: DictConfig, nproc: int = 1) -> list[Prediction]:
    """The peak allocated memory of each distinct rank of `python train.py` with `cfg`: one
    prediction, or one per pipeline rank under +opt=pp."""
    model, u = meta_model(cfg), plan_setup(cfg, nproc)
    check_model_stages(model, cfg, u.stages)
    parts = rank_parts(model, cfg, u)
    return [predict_part(s, r, rank, len(parts)) for rank, (s, r) in enumerate(parts)]


def predict_part(s: Shapes, u: Setup, rank: int = 0, ranks: int = 1) -> Prediction:
    """The peak of the rank holding `s`, with `u`: the largest moment's sum of categories."""
    parts = {part.__name__: part(s, u) for part in PARTS}
    table: dict[str, dict[str, float]] = {}
    for m in MOMENTS:
        row = {name: values[m] for name, values in parts.items()}
        row["slack"] = SLACK * sum(row.values())
        table[m] = row
    peak = max(MOMENTS, key=lambda m: sum(table[m].values()))
    return Prediction(peak, table[peak], table, rank, ranks)


def predict(cfg: DictConfig, nproc: int = 1) -> Prediction:
    """The peak allocated memory of the worst rank of `python train.py` with `cfg` (a pipeline's
    ranks differ: the first keeps the most micro-batches in flight, the last the head)."""
    return max(predict_ranks(cfg, nproc), key=lambda p: p.peak_gib)
