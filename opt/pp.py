"""`+opt=pp`: pipeline parallelism with `torch.distributed.pipelining`. The model's blocks are
split into consecutive stages over `opt.pp.degree` processes (the embeddings with the first
stage, the final norm, the head and the loss with the last); each step's batch runs through
them as `opt.pp.microbatches` micro-batches, so that the ranks compute at once, in the order the
schedule gives: `gpipe` (every forward, then every backward), `1f1b` (one forward, one backward:
at most a stage's worth of micro-batches alive) or `interleaved_1f1b` (several stages per rank,
rank r holding stages r, r+degree, ...: a smaller bubble for more communication).

Each rank keeps only its own part of the GPT (`prune`), under the full model's names
(`transformer.h.<i>`), so that its checkpoint shards resume on any layout. GPT-2 ties the head
to the token embedding, which live on the first and the last stage: the last stage trains its
own copy, and the two gradients are summed over both before the step (`Pipeline`), so that
both copies take the same update, the one the single process takes for the tied weight.

With more processes than `opt.pp.degree`, the rest form the mesh's data-parallel dimension:
several pipelines, each reading its slice of the global batch, and FSDP (+opt=fsdp) or DDP's
replication (FSDP2's `replicate`, any other run) wrap each stage over that dimension
(`data_parallel_roots`); the schedule reduces their gradients at the last micro-batch.

With +opt=tp (applied before this stage) every stage's blocks are split over the mesh's tp
dimension, and each tp rank runs its own pipeline over its parts: a pp x dp x tp mesh. A stage
sends the next one its tp rank's part of the residual stream as a plain tensor (opt/tp.py's
`ResidualStream`), and the loss is computed on vocabulary shards under the trainer's
`Plan.loss_context`, as without pipelining.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

import torch
import torch.distributed as torch_dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor

from base.distributed import Distributed, ParallelDims, log, mesh_shape
from base.errors import ConfigError
from base.knobs import count
from model import GPT, GPTConfig
from opt.stage import Context, Plan, Stage
from opt.step import LoopStep
from opt.tp import ResidualStream, plain, residual_stream
from recipe.metrics import StepTimer

IGNORED = -100  # F.cross_entropy's ignore_index: the targets of evaluation's padding rows
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
AnySchedule = ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


def check_pp(
    cfg: DictConfig, *, batch_size: int, world_size: int, scale_loss: bool, tp_degree: int = 1
) -> None:
    """Refuses what cannot run, in one line each, before any work starts (opt.plan calls it)."""
    pp = cfg.opt.pp
    mesh_shape(world_size, pp.degree, tp_degree)  # refuses a count the degrees do not divide
    interleaved = pp.schedule == "interleaved_1f1b"
    if interleaved != (pp.stages_per_rank >= 2):
        raise ConfigError(
            f"opt.pp.stages_per_rank={pp.stages_per_rank} with opt.pp.schedule={pp.schedule}: "
            "interleaved_1f1b needs 2 or more stages per rank, gpipe and 1f1b exactly 1"
        )
    stages = pp.degree * pp.stages_per_rank
    if cfg.model.n_layer < stages:
        raise ConfigError(
            f"model.n_layer={cfg.model.n_layer} blocks cannot fill {stages} pipeline stages "
            "(opt.pp.degree x opt.pp.stages_per_rank): lower either"
        )
    _check_split(pp.split, stages, cfg.model.n_layer)
    _check_microbatches(pp, batch_size, stages)
    for refused, why in [
        (cfg.train.hellaswag, "train.hellaswag=true: HellaSwag scores the whole model on one "
         "rank; score the run's checkpoint with python -m tools.evaluate"),
        (scale_loss, "opt.amp.dtype=float16: the schedule runs backward itself, without the "
         "loss scaler; use opt.amp.dtype=bfloat16"),
    ]:  # fmt: skip
        if refused:
            raise ConfigError(f"+opt=pp with {why}")


def _check_microbatches(pp: DictConfig, batch_size: int, stages: int) -> None:
    m = pp.microbatches
    if batch_size % m:
        raise ConfigError(
            f"opt.pp.microbatches={m} must divide the batch size {batch_size} (train.batch_size, "
            "or opt.bs.batch_size with +opt=bs)"
        )
    if pp.schedule == "1f1b" and m < stages:
        raise ConfigError(f"opt.pp.microbatches={m}: 1f1b needs at least one per stage ({stages})")
    rounds = max(1, m // pp.degree)  # torch's interleaved schedule runs m in rounds of degree
    if pp.schedule == "interleaved_1f1b" and m % rounds:
        raise ConfigError(
            f"opt.pp.microbatches={m}: interleaved_1f1b needs a multiple of {rounds} (its rounds "
            f"of opt.pp.degree={pp.degree})"
        )


def check_resume(saved_stages: list[str]) -> None:
    """A pipeline resumes a pipeline's checkpoint, of any degree or schedule (each rank finds
    its stages' shards by name); one written without +opt=pp holds the tied head weight and the
    optimizer state in layouts the stages cannot read yet."""
    if "pp" not in saved_stages:
        raise ConfigError(
            "train.resume=true with +opt=pp: this checkpoint was written without +opt=pp, "
            "which a pipeline cannot resume yet: resume it without +opt=pp"
        )


def _check_split(split: list[int] | None, stages: int, n_layer: int) -> None:
    if split is None:
        return
    starts = list(split)
    if len(starts) != stages - 1 or starts != sorted(set(starts)) or starts[0] < 1:
        raise ConfigError(
            f"opt.pp.split={starts}: give the {stages - 1} increasing block indices where stages "
            f"1..{stages - 1} start (stage 0 starts at block 0), or null for as many blocks each"
        )
    if starts[-1] >= n_layer:
        raise ConfigError(f"opt.pp.split={starts}: model.n_layer={n_layer} blocks end before it")


def stage_starts(n_layer: int, split: list[int] | None, stages: int) -> list[int]:
    """The block where each stage starts, then n_layer: `split`'s, or as many blocks each (the
    first stages one more when they do not divide). Even blocks, not even FLOPs: on GPT-2 XL over
    2 H200s the even split (24/24) ran 1.12x a split that weighed the last stage's head as its
    2.5 blocks of forward FLOPs (25/23), in every run and with steadier steps
    (docs/results/nvidia-h200/model_parallel.md): the stages' time did not follow their FLOPs."""
    if split is not None:
        return [0, *split, n_layer]
    each, extra = divmod(n_layer, stages)
    counts = [each + (stage < extra) for stage in range(stages)]
    return list(itertools.accumulate([0, *counts]))


# +opt=amp's autocast (Plan.autocast), entered around each forward: not around the schedule's
# step, whose backward autocast must not see.
Autocast = Callable[[], contextlib.AbstractContextManager]


class StageModule(nn.Module):
    """One pipeline stage's module: the embeddings (first stage), its blocks in order. It holds
    exactly its parameters (the schedule scales their gradients); the last stage also holds the
    final norm and the head, which the schedule's loss function runs (`GPT.head`). Under +opt=tp its
    blocks compute on DTensors, and it sends and receives its tp rank's part of the residual
    stream as a plain tensor (`stream`)."""

    def __init__(
        self,
        model: GPT,
        blocks: range,
        first: bool,
        last: bool,
        autocast: Autocast,
        stream: ResidualStream | None = None,
    ) -> None:
        super().__init__()
        self.autocast, self.stream = autocast, stream
        t: Any = model.transformer
        self.blocks = nn.ModuleList(t.h[str(i)] for i in blocks)
        self.embeddings = nn.ModuleList([t.wte, t.wpe]) if first else None
        self.head = nn.ModuleList([t.ln_f, model.lm_head]) if last else None
        self.embed = model.embed  # a bound method: GPT's own code (compiled under +opt=compile)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            if self.embeddings is not None:
                x = self.embed(x)
            elif self.stream is not None:
                x = self.stream.distributed(x)
            for block in self.blocks:
                x = block(x)
        return x if self.stream is None else self.stream.local(x)


def prune(model: GPT, blocks: list[int], first: bool, last: bool) -> None:
    """Keeps only this rank's parts of `model`, in place, under the full model's names: the
    blocks become a ModuleDict keyed by their index (`transformer.h.<i>` as before). The last
    stage's head gets its own copy of the tied embedding (same values: every rank built the
    same model from the same seed), unless this rank holds the first stage too (one rank)."""
    t: Any = model.transformer
    if last and not first:
        model.lm_head.weight = nn.Parameter(t.wte.weight.detach().clone())
    t.h = nn.ModuleDict({str(i): t.h[i] for i in blocks})
    if not first:
        del t["wte"], t["wpe"]
    if not last:
        del t["ln_f"], model.lm_head


class ComputeClock:
    """This rank's time computing (its stages' forward and backward chunks, the loss) within
    the training steps, and the steps' time: the rest of a step is its measured bubble, the
    waits for other stages, the sends and receives and the schedule's own work. Evaluation's
    chunks are not counted. CUDA events on a GPU, read at log steps (recipe/metrics.py)."""

    def __init__(self, device: torch.device) -> None:
        self.busy, self.wall = StepTimer(device), StepTimer(device)
        self.measuring = False  # inside a training step

    def time_chunks(self, stages: list[PipelineStage]) -> None:
        """Times every forward and backward chunk the schedule runs on `stages`."""
        for one in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(one, name, self.timed(getattr(one, name)))

    def timed(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        """`compute`, its time inside a training step counted as busy."""

        @functools.wraps(compute)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.measuring:  # outside a training step, or inside a timed call already
                return compute(*args, **kwargs)
            self.measuring = False
            self.busy.start()
            try:
                return compute(*args, **kwargs)
            finally:
                self.busy.step()
                self.measuring = True

        return timed

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around a training step: its time, and its compute counted."""
        self.wall.start()
        self.measuring = True
        try:
            yield
        finally:
            self.measuring = False
            self.wall.step()

    def idle(self) -> float:
        """The idle fraction of the steps since the last call (NaN: none ran)."""
        wall, busy = sum(self.wall.read_ms()), sum(self.busy.read_ms())
        return 1 - busy / wall if wall else float("nan")


class Pipeline(nn.Module):
    """This rank's stages and the schedule that runs them: the trainer's forward and backward
    over the micro-batches of a step (`forward_backward`), the global gradient norm and its
    clipping (`clip_grad_norm_`) and the evaluation loss (`forward`). Losses are known on the
    last stage only: they are broadcast over the pipeline, so that every rank logs and guards
    (recipe/guard.py) the same number."""

    def __init__(
        self,
        stages: list[StageModule],
        schedules: tuple[AnySchedule, AnySchedule],
        config: GPTConfig,
        dist: Distributed,
        tied: tuple[nn.Embedding | nn.Linear | None, torch_dist.ProcessGroup | None],
        batch_size: int,
        microbatches: int,
        clock: ComputeClock,
    ) -> None:
        super().__init__()
        # The step's batch: the schedule's buffers have the shapes of its micro-batches.
        self.batch_size, self.microbatches = batch_size, microbatches
        self.stages = nn.ModuleList(stages)
        # Training's schedule and evaluation's (apply_pp says why two).
        (self.schedule, self.eval_schedule), self.config = schedules, config
        # The batch goes to the rank holding the first stage only (the one with embeddings):
        # torch 2.11 refuses inputs given to a stage that receives them from another rank
        # (torch-workaround(<2.13): 2.13 takes them).
        self.holds_first = stages[0].embeddings is not None
        pp_mesh = _mesh(dist)["pp"]
        self.group = pp_mesh.get_group()
        self.last_rank = pp_mesh.size() - 1  # holds the last stage under every schedule
        # The module holding this rank's copy of the tied weight, and its pair's group. The
        # weight is read from it when used: FSDP and replicate replace the parameters.
        self.tied_module, self.tied_group = tied
        # The last stage's copy: its gradient, once summed, is the first stage's too.
        self.holds_head_copy = self.tied_module is not None and stages[-1].head is not None
        # The measured bubble (`clock`), and the theory's for comparison.
        self.dist, self.clock = dist, clock
        self.theory = bubble(pp_mesh.size(), microbatches, len(stages))

    def tied(self) -> torch.Tensor | None:
        """This rank's copy of the tied embedding/head weight (None between the two)."""
        return None if self.tied_module is None else self.tied_module.weight

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward through the schedule (gradients averaged over the
        micro-batches); returns the step's loss (the micro-batches' mean) on every rank."""
        losses: list[torch.Tensor] = []
        with self.clock.step():
            self.schedule.step(
                *self._inputs(inputs), target=targets, losses=losses, return_outputs=False
            )
        tied = self.tied()
        if tied is not None and tied.grad is not None:  # the embedding's + the head's
            tied.grad = _laid_out_as(tied.grad, tied)
            torch_dist.all_reduce(_local(tied.grad), group=self.tied_group)  # same shards
        return self._broadcast(torch.stack(losses).mean() if losses else None)

    def bubble_metrics(self) -> dict[str, float]:
        """`perf/pp_bubble`: the idle fraction of the training steps since the last call, 1 -
        compute time / step time, per rank, averaged over all ranks (a collective: every rank
        calls it); `perf/pp_bubble_theory`: the schedule's (`bubble`), for comparison."""
        return {
            "perf/pp_bubble": statistics.fmean(self.dist.gather(self.clock.idle())),
            "perf/pp_bubble_theory": self.theory,
        }

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[None, torch.Tensor]:
        """The evaluation loss, as `GPT.forward` gives it (forward only, every rank). The
        schedule's buffers have the step's shapes: a shorter (last) batch is padded with rows
        whose targets the loss ignores, and each micro-batch's mean counts its real rows."""
        real, pad = len(inputs), self.batch_size - len(inputs)
        if pad:
            inputs = torch.cat([inputs, inputs[-1:].expand(pad, -1)])
            targets = torch.cat([targets, torch.full_like(targets[-1:], IGNORED).expand(pad, -1)])
        losses: list[torch.Tensor] = []
        self.eval_schedule.eval(*self._inputs(inputs), target=targets, losses=losses)
        size = self.batch_size // self.microbatches
        rows = [min(max(real - i * size, 0), size) for i in range(self.microbatches)]
        total = sum(loss * n / real for loss, n in zip(losses, rows, strict=False) if n)
        return None, self._broadcast(total if losses else None)

    def _inputs(self, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The schedule's positional inputs on this rank: the batch where the first stage is,
        laid out contiguously (torch 2.11 checks every call's strides against its first's: the
        loader's batches are views of longer rows, evaluation's padded one is not;
        torch-workaround(<2.13))."""
        return (inputs.contiguous(),) if self.holds_first else ()

    def _broadcast(self, loss: torch.Tensor | float | None) -> torch.Tensor:
        """The last stage's `loss` (None elsewhere), on every rank."""
        device = next(self.parameters()).device
        value = torch.zeros((), device=device) if loss is None else torch.as_tensor(loss)
        value = value.detach().to(device)
        torch_dist.broadcast(value, group=self.group, group_src=self.last_rank)
        return value

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clips every stage's gradients by their global norm (squares summed over the
        pipeline, and over the data-parallel shards under FSDP; the last stage's copy of the
        tied weight counted once, on the first); returns that norm, the same on every rank."""
        params = [p for p in self.parameters() if p.grad is not None]
        head_copy = self.tied() if self.holds_head_copy else None
        counted = [p.grad for p in params if p is not head_copy and p.grad is not None]
        norm = torch.nn.utils.get_total_norm(counted)
        if isinstance(norm, DTensor):  # FSDP's shards: the norm over the dp dimension
            norm = norm.full_tensor()
        square = norm.square()
        torch_dist.all_reduce(square, group=self.group)
        norm = square.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


def apply_pp(
    model: GPT,
    cfg: DictConfig,
    dist: Distributed,
    plan: Plan,
) -> Pipeline:
    """Splits `model` (pruned in place to this rank's stages) into a pipeline; returns it.
    Under +opt=tp (applied before: its blocks are split over the mesh's tp dimension already)
    each tp rank runs its part of every stage, and its own pipeline carries that part."""

    def autocast() -> contextlib.AbstractContextManager:
        return plan.autocast(dist.device)

    tp_enabled = dist.parallel.tp_enabled
    stream = residual_stream(dist, plan.tp_sequence_parallel) if tp_enabled else None
    pp_mesh = _mesh(dist)["pp"]
    rank, degree = pp_mesh.get_local_rank(), cfg.degree
    n_stages = degree * cfg.stages_per_rank
    starts = stage_starts(model.config.n_layer, cfg.split, n_stages)
    mine = list(range(rank, n_stages, degree))  # looped: rank r holds r, r+degree, ...
    first, last = mine[0] == 0, mine[-1] == n_stages - 1
    blocks = [i for s in mine for i in range(starts[s], starts[s + 1])]
    prune(model, blocks, first, last)
    group = pp_mesh.get_group()
    stages = [
        StageModule(
            model, range(starts[s], starts[s + 1]), s == 0, s == n_stages - 1, autocast, stream
        )
        for s in mine
    ]
    clock = ComputeClock(dist.device)

    @clock.timed  # the last stage's head and loss: compute outside its chunks' forward
    def loss_fn(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if stream is not None:  # as +opt=tp's hooks give GPT.forward its inputs and output
            hidden, targets = stream.distributed(hidden), stream.targets(targets)
        with autocast():
            return plain(model.head(hidden, targets)[1])  # given targets: the loss

    schedule_class = SCHEDULES[cfg.schedule]

    def schedule(timed: bool) -> AnySchedule:
        """The schedule over this rank's stages, in pipeline wrappers of its own. Training and
        evaluation get one each: torch 2.11's schedules set their wrappers' receive buffers up
        once, at the first call, for that call's mode, so an evaluation first (the loop's step
        0) left buffers that take no gradient for every training step after it
        (torch-workaround(<2.13))."""
        wrapped = [
            PipelineStage(stage, s, n_stages, dist.device, group=group)
            for stage, s in zip(stages, mine, strict=True)
        ]
        if timed:
            clock.time_chunks(wrapped)
        held = wrapped if schedule_class is ScheduleInterleaved1F1B else wrapped[0]
        return schedule_class(held, n_microbatches=cfg.microbatches, loss_fn=loss_fn)

    tied = _tied_pair(model, dist, first, last)
    layout = ", ".join(f"{starts[s]}-{starts[s + 1] - 1}" for s in range(n_stages))
    log(
        f"[opt] pp: {degree} ranks x {cfg.stages_per_rank} stage(s), blocks {layout}, "
        f"{cfg.schedule} over {cfg.microbatches} micro-batches, idle in theory "
        f"{bubble(degree, cfg.microbatches, cfg.stages_per_rank):.0%} of the step (the bubble)"
    )
    return Pipeline(
        stages, (schedule(timed=True), schedule(timed=False)), model.config, dist, tied,
        plan.batch_size, cfg.microbatches, clock,
    )  # fmt: skip


class PipelineStep(LoopStep):
    """The loop's step under +opt=pp: the schedule runs the micro-batches' forward and backward
    (under the plan's loss context: +opt=tp's loss_parallel), the norm is the whole pipeline's,
    evaluation runs through the pipeline (every rank holds a part of the model), and the log
    steps get its bubble."""

    @property
    def pipeline(self) -> Pipeline:
        return cast(Pipeline, self.module)  # pp's apply, wrapped in place by dp's

    @property
    def evaluated(self) -> nn.Module:
        return self.pipeline

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.plan.loss_context():  # the step's loss, the same on every stage
            return self.pipeline.forward_backward(inputs, targets)

    def _clipped(self, max_norm: float) -> torch.Tensor:
        return self.pipeline.clip_grad_norm_(max_norm)

    def metrics(self) -> dict[str, float]:
        return self.pipeline.bubble_metrics()


def bubble(degree: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The schedule's idle fraction per rank in theory, (p-1)/(v·m + p-1): filling and draining
    the pipeline takes p-1 stage-times of the v·m each rank computes (Megatron-LM's
    interleaving divides a stage-time by v). Even stages and free communication assumed."""
    idle = degree - 1
    return idle / (stages_per_rank * microbatches + idle)


def _tied_pair(
    model: GPT, dist: Distributed, first: bool, last: bool
) -> tuple[nn.Embedding | nn.Linear | None, torch_dist.ProcessGroup | None]:
    """The module holding this rank's copy of the tied embedding/head weight (the first stage's
    embedding, the last stage's head; None in between) and the group of the two ranks holding
    it in this pipeline, where their gradients are summed. A collective: every rank makes every
    pipeline's pair (one per data-parallel rank)."""
    if first and last:  # a pipeline of one rank: the weight is still tied
        return None, None
    ends = _mesh(dist).mesh  # every rank as (pp, dp, tp): each pipeline's first and last stage
    firsts, lasts = ends[0].flatten().tolist(), ends[-1].flatten().tolist()
    pairs = [list(pair) for pair in zip(firsts, lasts, strict=True)]
    pair, _ = torch_dist.new_subgroups_by_enumeration(pairs)
    t: Any = model.transformer
    if first:
        return t.wte, pair
    if last:
        return model.lm_head, pair
    return None, None


def _mesh(dist: Distributed) -> DeviceMesh:
    """The processes' mesh, whose "pp" dimension says which stages a rank holds."""
    mesh = dist.parallel.mesh
    assert mesh is not None, "+opt=pp runs on the meshed processes (Distributed.with_parallel)"
    return mesh


def _laid_out_as(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` in `param`'s DTensor layout: under +opt=tp the embedding's backward gives the
    whole gradient of its vocabulary-split weight on every tp rank (Replicate), the head's copy
    its rank's rows (Shard(0)); the pair sums the same rows."""
    if not isinstance(grad, DTensor) or not isinstance(param, DTensor):
        return grad
    if grad.placements == param.placements:
        return grad
    return grad.redistribute(placements=param.placements)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP's), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def data_parallel_roots(module: nn.Module, parallel: ParallelDims) -> list[nn.Module]:
    """What a data-parallel wrapper (FSDP, replicate) wraps as its roots: each pipeline stage
    (which the schedule finds wrapped, to reduce its gradients at the last micro-batch), or the
    module itself outside a pipeline."""
    return list(cast(Pipeline, module).stages) if parallel.pp_enabled else [module]


@dataclass
class Knobs:
    degree: Annotated[int, count(2)]  # pipeline ranks
    microbatches: Annotated[int, count(1)]
    schedule: Schedule
    stages_per_rank: Annotated[int, count(1)]
    split: list | None  # block indices where stages start: checked by check_pp


def _plan(ctx: Context) -> None:
    p = ctx.plan
    # +opt=tp's plan ran first (ORDER): its degree is known.
    check_pp(ctx.cfg, batch_size=p.batch_size, world_size=ctx.dist.world_size,
             scale_loss=p.scale_loss, tp_degree=p.parallel.tp)  # fmt: skip
    p.parallel.pp = ctx.knobs.degree


def _apply(ctx: Context) -> torch.nn.Module:
    """Each rank keeps its stages of the model; the pipeline runs them, each compiled whole
    where +opt=compile left it that (`Plan.compile_later`)."""
    pipeline = apply_pp(ctx.model, ctx.knobs, ctx.dist, ctx.plan)
    if ctx.plan.compile_later is not None:
        for stage in pipeline.stages:
            ctx.plan.compile_later(stage)
    return pipeline


STAGE = Stage(
    "pp", "model", _apply, Knobs, plan=_plan, check_resume=check_resume, step=PipelineStep,
    conflicts={
        "accum": "opt.pp.microbatches is the pipeline's own gradient accumulation",
        "custom_op": "the fused head + loss has no ignored targets, which the pipeline's "
        "evaluation pads a short batch with",
        "offload": "offload runs in one process, pp over several",
        "opt_in_backward": "the pipeline's tied weights and global clipping need every "
        "gradient before the step",
    },
)  # fmt: skip
