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
comm_buckets (DDP's gradient buckets, FSDP's gathered blocks and reduce-scatter inputs per rank)
and slack (a calibrated fraction for what the model leaves out: small tensors, per-op
workspaces, the allocator's 512-byte rounding).

Refused: a stage not in MODELLED, such as +opt=tp and +opt=pp (each rank holds a part of every
block, or some blocks, and a pipeline keeps several micro-batches in flight: not modelled, and
no measured row to check a model against yet). Not modelled: +opt=compile is planned as eager
(an upper bound: Inductor fuses elementwise ops and the loss, and saves less: the speed ladder's
compiled rows measure up to ~50% below it); torchao's and cuBLAS's workspaces beyond the slack;
the reserved-but-unallocated memory of the allocator (--fit allows for it with one measured
factor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

import opt
from base.distributed import Distributed
from base.errors import ConfigError
from model import GPT, GPTConfig
from opt.ac import apply_ac
from opt.custom_op import apply_custom_op

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
    """The model's parameter counts, from a GPT built on the meta device (no storage)."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab: int  # padded vocabulary: the head's rows
    dropout: float
    sizes: list[int]  # every parameter's number of values (the tied embedding once)
    block: int  # one transformer block's parameters
    root: int  # the parameters outside the blocks: wte (the tied head), wpe, ln_f
    matmul: int  # the weights autocast casts for a matmul: the blocks' Linear weights, the head

    @property
    def params(self) -> int:
        return sum(self.sizes)

    @property
    def head(self) -> int:
        return self.vocab * self.n_embd


def meta_model(cfg: DictConfig) -> GPT:
    """The configured GPT on the meta device: shapes without storage (`model.pretrained`
    presets carry their checkpoint's shape)."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    with torch.device("meta"):
        return GPT(GPTConfig(**{k: v for k, v in cfg.model.items() if k in fields}))


def model_shapes(model: GPT) -> Shapes:
    """The parameter counts the categories need."""
    config = model.config
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    sizes = [p.numel() for p in model.parameters()]
    linear = [m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return Shapes(
        n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head,
        vocab=config.padded_vocab_size, dropout=config.dropout, sizes=sizes, block=block,
        root=sum(sizes) - config.n_layer * block,
        matmul=sum(linear),  # the head is a Linear too (its weight is wte's)
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
    """What the stages decided that memory depends on."""

    stages: list[str]
    world: int  # processes (each planned alike: the peak is per rank)
    shards: int  # FSDP's: the processes, or under HSDP one replica's (opt.fsdp.replicas)
    tokens: int  # tokens per micro-batch on this rank
    micro_steps: int
    defer_reduce: bool
    compute: int  # bytes per value of the compute dtype: 2 under amp, else 4
    residual: int  # bytes per value of the residual stream
    autocast: bool  # autocast runs (amp without FSDP's pure mixed precision)
    weight_cache: bool
    step_in_backward: bool
    optimizer: str  # foreach | forloop | fused | lowbit8 | lowbit4
    ac: DictConfig | None  # the ac stage's knobs, None without checkpointing
    custom_op: DictConfig | None
    ddp: DictConfig | None  # DDP's knobs when several processes run without FSDP
    sharded: str = ""  # fsdp | offload | "" (not sharded)
    gathered: int = 4  # bytes per value of FSDP's all-gathered parameters
    stored: int = 4  # bytes per value of the weights and their gradients (opt.lowbit.weights)


# The stages this model covers, by what each changes of a step's memory. A stage not listed is
# refused, naming it, rather than planned as if it were absent: tp and pp (each rank holds a part
# of every block, or some blocks, and a pipeline keeps several micro-batches in flight), and any
# stage added to opt/ until its memory is modelled here.
MODELLED = frozenset({
    "bs", "accum",  # the micro-batch's tokens; the earlier micro-batches' gradients
    "workers", "non_blocking", "tf32",  # nothing of their own in the GPU's allocated memory
    "compile",  # planned as eager: an upper bound
    "amp", "ac", "custom_op",  # the compute dtype and autocast's casts; activations; the head
    "foreach", "forloop", "fused", "lowbit", "opt_in_backward",  # the optimizer's state and update
    "ddp", "fsdp", "offload",  # DDP's buckets; FSDP's shards and gathered blocks; the host's share
})  # fmt: skip


def plan_setup(cfg: DictConfig, nproc: int) -> Setup:
    """The stage plan, by `opt.plan` itself on a fake rank 0 of `nproc` (its log lines are kept
    out of the output)."""
    dist = Distributed(rank=0, local_rank=0, world_size=nproc, device=torch.device("cpu"))
    with contextlib.redirect_stdout(io.StringIO()):
        p = opt.plan(cfg, dist)
    o, stages = cfg.opt, p.stages
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
    return Setup(
        stages=stages, world=nproc, shards=nproc // p.parallel.dp_replicate,
        tokens=p.micro_batch_size * cfg.model.block_size,
        micro_steps=p.micro_steps, defer_reduce=p.defer_reduce,
        compute=2 if amp else 4,
        residual=p.residual_dtype.itemsize if p.residual_dtype else 2 if pure else 4,
        autocast=amp and not pure, weight_cache=p.amp_weight_cache,
        step_in_backward=p.step_in_backward, optimizer=optimizer,
        ac=o.ac if "ac" in stages else None,
        custom_op=o.custom_op if "custom_op" in stages else None,
        ddp=(o.get("ddp") or opt.ddp.default_knobs()) if nproc > 1 and not sharded else None,
        sharded=sharded, gathered=2 if pure else 4,
        stored=p.weights_dtype.itemsize if p.weights_dtype is not None else 4,
    )  # fmt: skip


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
    With accumulation they live through the later micro-batches' forward too. In backward's last
    block only the head's (wte: V x C) exist yet, all at its end. opt_in_backward frees a
    block's once the block has stepped: one block's at a time, the largest parameter (wte's) at
    the end. DDP's live in its buckets (comm_buckets). In the weights' dtype (`stored`)."""
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
    if u.sharded == "fsdp":  # sharded by each block's reduce-scatter; the root's whole to the end
        shard = everything / u.shards
        # earlier micro-batches' gradients: sharded, or whole when their reduction waits
        earlier = 0 if u.micro_steps == 1 else everything if u.defer_reduce else shard
        return moments(
            forward=earlier, loss_backward=earlier + head, backward=earlier + 4 * s.root,
            backward_end=shard + 4 * s.root, step=shard,
        )  # fmt: skip
    earlier = everything if u.micro_steps > 1 else 0
    return moments(
        forward=earlier, loss_backward=earlier + head, backward=max(earlier, head),
        backward_end=everything, step=everything,
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
    The residual adds save nothing (an add's backward needs no input)."""
    ln_in = c * (u.residual if not u.autocast else 4)
    mask = c if dropout > 0 else 0
    return {
        "attn": ln_in + c * u.compute * (1 + 3 + 1) + 4 * n_head + mask,
        "mlp": ln_in + c * u.compute * (1 + 4 + 4) + mask,
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
    plus ln_f's input (C, the residual) for the head, and in backward one block's working set:
    the gradient of the residual (C, float32, and its sum with the branch's) and of the widest
    activation (4C in the compute dtype)."""
    c, n, layers = s.n_embd, u.tokens, s.n_layer
    saved = block_saved(u, c, s.n_head, s.dropout)
    plain = saved["attn"] + saved["mlp"]
    block_input = c * u.residual
    mode = u.ac.mode if u.ac is not None else "none"
    if mode == "none":
        per_layer, recompute = [plain] * layers, 0.0
    elif mode == "full":
        per_layer, recompute = [block_input] * layers, plain
    elif mode == "op":
        kept = block_input + c * u.compute * 10 + 4 * s.n_head
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
    working = c * (2 * 4 + 4 * u.compute)
    head_input = c * u.residual
    total = n * (sum(per_layer) + head_input)
    return moments(
        forward=total,
        loss_backward=total,
        backward=total + n * (recompute + working),
        backward_end=n * (per_layer[0] + recompute + working),
        step=0,
    )


def logits_loss(s: Shapes, u: Setup) -> dict[str, float]:
    """The head (hidden @ wte^T) and the cross-entropy over N tokens x V (padded vocabulary).

    Plain head: forward holds the logits in the compute dtype, their float32 upcast and
    log_softmax's float32 output (kept for backward) at once; backward holds that output, the
    loss's gradient of it and log_softmax's gradient (float32 each), then the head's weight
    gradient (V x C, float32).
    custom_op: per chunk of `chunk_size` tokens a logits buffer (chunk x V, compute dtype); the
    operator returns the hidden states' gradient (N x C, compute dtype) and the weight's (V x C,
    float32), kept for backward, and takes autocast casts of hidden and the weight; its backward
    scales them: a float32 copy of each and the weight's cast back to its dtype."""
    c, n, v = s.n_embd, u.tokens, s.vocab
    casts = (n * c + v * c) * u.compute if u.autocast else 0
    if u.custom_op is not None:
        chunk = min(u.custom_op.chunk_size or n, n)
        saved = n * c * u.compute + 4 * v * c
        forward = saved + casts + chunk * v * u.compute + 4 * n
        backward = saved + 4 * n * c + v * c * (4 + u.compute)
        return moments(all=0, forward=forward, loss_backward=backward)
    upcast = 4 * n * v if u.compute != 4 else 0
    forward = n * v * (u.compute + 4) + upcast
    backward = 3 * 4 * n * v
    return moments(all=0, forward=forward, loss_backward=backward)


def autocast_copies(s: Shapes, u: Setup) -> dict[str, float]:
    """Autocast's low-precision casts of the weights (compute-dtype bytes per matmul weight).
    With its cache on, every cast lives to the end of the forward (the autocast region);
    without checkpointing the matmuls save their casts for backward anyway (cache or not),
    freed as backward passes each. The plain head saves its weight's cast for backward. Weights
    stored in the compute dtype need no cast."""
    if not u.autocast or u.stored == u.compute:
        return moments(all=0)
    every = u.compute * s.matmul
    head = u.compute * s.head if u.custom_op is None else 0
    blocks = every - u.compute * s.head
    checkpointed = u.ac is not None and u.ac.mode != "selective"
    if not checkpointed:
        return moments(all=0, forward=every, loss_backward=every, backward=blocks + head)
    forward = every if u.weight_cache else head
    return moments(all=0, forward=forward, loss_backward=head, backward=head)


def comm_buckets(s: Shapes, u: Setup) -> dict[str, float]:
    """Per rank. DDP: its gradient buckets (every gradient, float32) exist from construction on;
    with gradient_as_bucket_view the gradients are views into them (no second copy), else the
    gradients are copied in. FSDP and offload: the all-gathered (copied-in) block being run and
    the one prefetched (gathered dtype), and in backward a block's unsharded gradients for its
    reduce-scatter (float32)."""
    if u.ddp is not None:
        return moments(all=4 * s.params)
    if u.sharded:
        gathered = 2 * s.block * u.gathered
        reduce = 4 * s.block
        return moments(
            all=gathered, backward=gathered + reduce, backward_end=gathered + reduce, step=0
        )
    return moments(all=0)


PARTS = (
    weights, gradients, optimizer_state, activations, logits_loss, autocast_copies, comm_buckets,
)  # fmt: skip
CATEGORIES = (*(part.__name__ for part in PARTS), "slack")  # a prediction's, in this order


@dataclass
class Prediction:
    moment: str  # the moment of the peak
    categories: dict[str, float]  # bytes per category at the peak
    everything: dict[str, dict[str, float]] = field(default_factory=dict)  # per moment

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
    def sets_peak(self) -> str:
        """The largest category at the peak."""
        return max(self.categories, key=lambda k: self.categories[k])

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peak_gib": round(self.peak_gib, 3)}
        out |= {k: round(v / GIB, 3) for k, v in self.categories.items()}
        return out | {"phase": self.phase, "moment": self.moment, "sets_peak": self.sets_peak}


def predict(cfg: DictConfig, nproc: int = 1) -> Prediction:
    """The peak allocated memory of one rank of `python train.py` with `cfg`."""
    model, u = meta_model(cfg), plan_setup(cfg, nproc)
    check_model_stages(model, cfg, u.stages)
    s = model_shapes(model)
    parts = {part.__name__: part(s, u) for part in PARTS}
    table: dict[str, dict[str, float]] = {}
    for m in MOMENTS:
        row = {name: values[m] for name, values in parts.items()}
        row["slack"] = SLACK * sum(row.values())
        table[m] = row
    peak = max(MOMENTS, key=lambda m: sum(table[m].values()))
    return Prediction(peak, table[peak], table)
