"""Train GPT-2. Reads top to bottom: setup, data, model and stages, optimizer, the loop
(forward, backward, clip, step; log, evaluate, checkpoint), then a final save and samples.

    python train.py                                   # tiny model on the bundled plays
    python train.py model=gpt2 '+opt=[amp,compile]'   # GPT-2 124M, mixed precision, compiled
    python -m launch.torchrun --standalone --nproc_per_node=4 train.py model=gpt2-large \
        '+opt=[fsdp,amp]'                             # torchrun whose Ctrl-C exits 0
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import checkpointing
import data
import opt
import tasks
from base import distributed, errors
from launch import torchrun
from model import GPT, GPTConfig
from recipe import config, rundir
from recipe.evaluation import build_loaders, validation
from recipe.guard import NonFiniteGuard
from recipe.hardware import cap_memory, matmul_ceiling, peak_flops
from recipe.metrics import LoopMeter, LossWindow, MetricLogger, memory_gib, reset_memory_peaks
from recipe.profiling import Profiler
from recipe.runstate import RunState
from recipe.schedule import learning_rate, set_learning_rate
from tools import generate

config.register_resolvers()  # ${launch:} names the run folder; --help shows conf/ with comments


DROPPED: list[str] = []  # this command line's '~opt=<stage>': a resume drops a saved stage


@errors.app(config_name="config")  # @hydra.main, its errors in one line
def main(cfg: DictConfig) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:  # a sweep's job: its wandb name and group
        from launch import sweep  # Hydra's sweeper, imported by a sweep's jobs only

        name = default_name(cfg, opt.selected(cfg.opt))
        named = sweep.job_wandb(
            cfg.wandb, list(hydra_cfg.overrides.task), name, hydra_cfg.sweep.dir
        )
        for key, value in named.items():
            cfg.wandb[key] = value
    with rundir.removed_on_failure(run_dir):  # a failed launch leaves no empty run folder
        return train(cfg, run_dir, overrides=[*hydra_cfg.overrides.task, *DROPPED])


def build_model(cfg: DictConfig) -> GPT:
    """A GPT-2 from a preset, or from Hugging Face weights (`model.pretrained`)."""
    if cfg.pretrained is None:
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        return GPT(GPTConfig(**{k: v for k, v in cfg.items() if k in fields}))
    model = GPT.from_pretrained(cfg.pretrained, dropout=cfg.dropout)
    positions = model.config.block_size
    if cfg.block_size > positions:
        raise errors.ConfigError(
            f"model.block_size={cfg.block_size} exceeds the {positions} positions of "
            f"{cfg.pretrained}: use model.block_size<={positions}"
        )
    return model


def build_optimizer(
    model: torch.nn.Module,
    cfg: DictConfig,
    impl: dict,
    optimizer_class: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
) -> torch.optim.Optimizer:
    """AdamW (or +opt=lowbit's) with weight decay on the 2-D weights (matmuls, embeddings) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return optimizer_class(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **impl)


def train_step(
    step: opt.Step, inputs: torch.Tensor, targets: torch.Tensor, grad_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's batch, as the stages run it (opt/step.py): forward and
    backward per micro-batch (under +opt=pp the pipeline's schedule runs them), unscale and clip
    by the global norm, then the update unless the loss or the gradients are not finite
    (recipe/guard.py; under +opt=opt_in_backward each block stepped in backward already).
    Returns the sum of the micro-batch losses and the gradient norm, both left on the device
    (no sync)."""
    losses = step.forward_backward(inputs, targets)
    grad_norm = step.clip_grad_norm_(grad_clip)  # over every rank, every pipeline stage
    step.optimizer_step(losses, grad_norm)
    return losses, grad_norm


def train(cfg: DictConfig, run_dir: Path, overrides: list[str] | tuple = ()) -> dict[str, Any]:
    """Runs one training job; returns its summary (also `summary.json`). `overrides`, the command
    line that built `cfg`, is saved with the run: a resume needs only `train.resume=true`."""
    started = time.perf_counter()  # goodput's wall time counts from here
    # ---- setup: the config (on resume the saved run's, these overrides on top), checked first
    overrides = list(overrides)
    cfg, overrides = config.for_resume(run_dir, overrides) if cfg.train.resume else (cfg, overrides)
    config.validate(cfg, overrides)
    dist = distributed.init(cfg.device)
    config.check_device(cfg, dist.device)  # a preset sized for a GPU, on a CPU
    cap_memory(dist.device, cfg.perf.memory_cap_gib)  # before anything is allocated on the GPU
    ceiling = matmul_ceiling(dist.device) if cfg.perf.matmul_ceiling else {}  # logged at step 0
    reset_memory_peaks(dist.device)
    plan = opt.plan(cfg, dist)
    dist = dist.with_parallel(plan.parallel)  # the pp x dp x tp mesh (HSDP: dp twice), if any
    folder = rundir.RunFolder(run_dir, resume=cfg.train.resume) if dist.is_main else None
    run = RunState.start(run_dir, cfg)  # step 0, or the checkpoint's: config and corpus checked
    opt.check_resume(plan, saved_stages=run.stages if cfg.train.resume else None)
    t, max_steps = cfg.train, cfg.train.max_steps
    if run.finished(max_steps):
        return finished_already(run_dir, run.step, dist)
    profiler = Profiler(cfg.prof, run_dir, dist.device, dist.rank)  # memory: from here
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank

    # ---- data: prepared once per machine by its first process (atomic); the others wait on
    # the CPU group. Each rank reads its slice of every global batch, from the run's position.
    if dist.is_local_main:
        data.prepare(cfg.data)
    dist.host_barrier()
    train_loader, val_loader = build_loaders(cfg, plan, dist, run.samples)
    zero_shot = tasks.for_training(cfg.train, cfg.data.cache_dir)  # train.hellaswag
    batches = data.DeviceBatches(train_loader, dist.device, plan.loader.non_blocking)

    # ---- model, then the model stages in their fixed order (AC -> compile -> DDP/FSDP)
    with torch.device(dist.device):  # initialised in place: no host copy of the weights
        model = build_model(cfg.model)
    run.check_shape(model.config)
    whole = model.num_params(exclude_positions=False), model.flops_per_token(cfg.model.block_size)
    train_model = opt.apply_model_stages(model, cfg.opt, plan, dist)  # pp: this rank's stages

    # ---- optimizer, loss scaler (a no-op unless amp runs in float16), non-finite guard, the
    # state a resume continues from; then the step the loop runs, as the stages arrange it
    # (opt_in_backward: in backward, after the restore, which may step it once to shape its
    # state; pp: the pipeline's schedule), and what the evaluation runs through
    optimizer = build_optimizer(model, cfg.train, plan.optimizer_kwargs, plan.optimizer_class)
    scaler = plan.grad_scaler(dist.device)
    guard = NonFiniteGuard(dist.device, dist, cfg.train.max_bad_steps)
    layouts = opt.checkpoint_layouts(plan)  # how a stage's parameters look saved (tp's QKV)
    run.restore(model, optimizer, scaler, dist.rank, layouts)  # resume: weights, optimizer, RNG
    stepper = opt.build_step(cfg.opt, plan, guard, model, train_model, optimizer, scaler)
    validate = functools.partial(validation, stepper.evaluated, val_loader, zero_shot, plan, dist)

    # ---- the run folder (config, metrics so far, logger); what this run's checkpoints save
    resolved = config.resolved(cfg, model.config)
    logger = open_run_folder(run_dir, folder, cfg, resolved, overrides, plan, dist, run)
    run.begin(resolved, model.config, plan.stages, optimizer, logger.wandb_id,
              samples_per_step=plan.batch_size * dist.dp_size)  # fmt: skip
    distributed.log(opening_line(cfg, run_dir, whole[0], plan, dist, run.step))

    # ---- the loop. Nothing in it waits for the GPU except at log, eval and checkpoint steps.
    meter = LoopMeter(
        dist.device, batches, perf_args(cfg, whole[1], model, plan, dist), started=started,
        warmup_steps=cfg.perf.warmup_steps, compiled=plan.compiled,
    )  # fmt: skip
    losses = LossWindow(dist.device)  # summed on the device: no .item() per step
    step = run.step
    saver = checkpointing.Saver.for_run(run_dir, dist, t, layouts)  # checkpoint_interval, keep_*
    with checkpointing.StopSignal() as stop:  # from the first evaluation on: it may take minutes
        if step == 0:
            validated(logger, step, validate)
        if ceiling:  # perf.matmul_ceiling
            logger.log(ceiling, step)
        meter.start()
        while step < max_steps:
            lr = learning_rate(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                               max_steps=max_steps)  # fmt: skip
            set_learning_rate(optimizer, lr)
            inputs, targets = next(batches)
            step_losses, grad_norm = train_step(stepper, inputs, targets, t.grad_clip)
            losses.add(step_losses, plan.micro_steps)
            meter.step()
            profiler.step()
            step += 1

            if step % t.log_interval == 0 or step == max_steps:
                with meter.paused():  # the step times are read: waits for the GPU
                    metrics = train_metrics(meter, losses, lr, grad_norm, guard, scaler, step, dist)
                    logger.log(metrics | stepper.metrics(), step)  # pp: the bubble
            val_loss = None  # this step's, when evaluated: keep_best's measure of a checkpoint
            if step % t.eval_interval == 0 or step == max_steps:
                with meter.paused():
                    val_loss = validated(logger, step, validate)
            stopping = dist.any_one_step_late(stop.requested)  # no barrier: agreed a step later
            if saver.due(step, stopping):
                with meter.paused():
                    saver.save(model, optimizer, scaler, step, run.saved(step), val_loss)
                    if cfg.perf.checkpoint_time:  # how long the save held the loop (README)
                        logger.log({"perf/checkpoint_s": saver.held_s}, step)
            if stopping:
                saver.wait()  # async_save: on disk before saying so
                torchrun.mark_saved_on_stop(dist.rank)  # for launch/torchrun.py's exit code
                break

    saver.close()  # the last save is on disk (async_save: waits; raises its failure)
    profiler.close()

    # ---- summary and samples
    summary: dict[str, Any] = {"step": step, "stages": plan.stages, "completed": step == max_steps,
                               "stopped_by": stop.signal,  # SIGTERM/SIGINT: a sweep then stops
                               "attention_kernel": plan.attention_kernel,  # opt/attention.py
                               **meter.summary(), **memory_gib(dist)}  # fmt: skip
    # Every rank samples (FSDP needs them all); not under pp: sample.py reads its checkpoint.
    if step == max_steps and cfg.sample.num_samples and not dist.parallel.pp_enabled:
        final_samples(model, cfg, plan, dist, run_dir, step)
    summary = logger.finish(summary, run_dir)
    distributed.log(report(summary, run_dir, dist.device))
    distributed.log(closing_line(run_dir, step, max_steps))
    let_go(folder)
    return summary


def let_go(folder: rundir.RunFolder | None) -> None:
    """The run is over: the process group is shut down, and rank 0's lock on the run folder
    released, so that a later run of this process (a resume, a test) may take the folder at
    once instead of waiting for the collector to free this run."""
    distributed.shutdown()
    if folder:
        folder.release()


def validated(
    logger: MetricLogger, step: int, validate: Callable[[], dict[str, float | None]]
) -> float | None:
    """Logs `validate()` (recipe/evaluation.py's validation: the val loss, HellaSwag) at `step`;
    returns the val loss."""
    metrics = validate()
    logger.log(metrics, step)
    return metrics["val/loss"]


def tokens_per_step(cfg: DictConfig, plan: opt.Plan, dist: distributed.Distributed) -> int:
    """Tokens in one optimizer step over all ranks."""
    return plan.batch_size * dist.dp_size * cfg.model.block_size  # a tp group reads one batch


def perf_args(
    cfg: DictConfig,
    flops_per_token: float,
    model: GPT,
    plan: opt.Plan,
    dist: distributed.Distributed,
) -> dict[str, Any]:
    """What turns step times into throughput, MFU and HFU (recipe/metrics.py's `throughput`)."""
    recomputed = model.recompute_flops_per_token(cfg.model.block_size)  # +opt=ac: HFU's only
    return dict(
        tokens_per_step=tokens_per_step(cfg, plan, dist),
        flops_per_token=flops_per_token,
        hardware_flops_per_token=flops_per_token + recomputed,
        peak_flops=peak_flops(
            dist.device, cfg.perf.peak_tflops, plan.amp_dtype or plan.weights_dtype
        ),
        world_size=dist.world_size,
    )


def run_name(cfg: DictConfig, plan: opt.Plan) -> str:
    """The run's name on the console and in wandb: `wandb.name`, else the model and stages."""
    return cfg.wandb.name or default_name(cfg, plan.stages)


def default_name(cfg: DictConfig, stages: list[str]) -> str:
    return f"{cfg.model.name}-{'+'.join(stages) or 'baseline'}"


def open_run_folder(
    run_dir: Path,
    folder: rundir.RunFolder | None,
    cfg: DictConfig,
    resolved: dict[str, Any],
    overrides: list[str],
    plan: opt.Plan,
    dist: distributed.Distributed,
    run: RunState,
) -> MetricLogger:
    """Writes the run's config (rank 0 holds the `folder`) and returns the metric logger; on
    resume it continues the metrics kept up to the checkpoint's step, in the same wandb run."""
    history = folder.cut_metrics(run.step) if folder and cfg.train.resume else []
    if folder:
        config.save(run_dir, resolved, overrides)
    return MetricLogger(
        run_dir, enabled=dist.is_main, max_steps=cfg.train.max_steps, wandb_cfg=cfg.wandb,
        run_name=run_name(cfg, plan), history=history, wandb_id=run.wandb_id,
        config={**resolved, "stages": plan.stages, "world_size": dist.world_size,
                "tokens_per_step": tokens_per_step(cfg, plan, dist),
                "attention_kernel": plan.attention_kernel},
    )  # fmt: skip


def opening_line(
    cfg: DictConfig,
    run_dir: Path,
    num_params: int,
    plan: opt.Plan,
    dist: distributed.Distributed,
    start_step: int,
) -> str:
    """The run's first console line: its name, size, processes, batch, steps and folder."""
    return (
        f"[train] {run_name(cfg, plan)}: {num_params / 1e6:.1f}M "
        f"parameters on {dist.world_size} x {dist.device.type}, "
        f"{tokens_per_step(cfg, plan, dist):,} tokens per step, steps "
        f"{start_step}..{cfg.train.max_steps}, run folder {run_dir}"
    )


def train_metrics(
    meter: LoopMeter,
    losses: LossWindow,
    lr: float,
    grad_norm: torch.Tensor,
    guard: NonFiniteGuard,
    scaler: torch.amp.GradScaler,
    step: int,
    dist: distributed.Distributed,
) -> dict[str, float | None]:
    """A log step's metrics: the steps since the last log (their mean loss, throughput, data
    wait, energy), this step's learning rate and gradient norm, the skipped steps, memory."""
    perf = meter.window()  # waits for the GPU to finish the logged steps
    scale = scaler.get_scale() if scaler.is_enabled() else None
    return {
        "train/loss": losses.mean(dist),
        "train/lr": lr,
        "train/grad_norm": grad_norm.item(),
        **guard.check(step, scale),  # stops the run after too many bad steps
        **perf,
        **memory_gib(dist),
    }


def final_samples(
    model: GPT,
    cfg: DictConfig,
    plan: opt.Plan,
    dist: distributed.Distributed,
    run_dir: Path,
    step: int,
) -> None:
    """The finished run's samples (`sample.*`) into `samples.txt`; every rank generates."""
    s = cfg.sample
    texts = generate.sample(
        model, s.prompt, num_samples=s.num_samples, max_new_tokens=s.max_new_tokens,
        temperature=s.temperature, top_k=s.top_k, seed=cfg.train.seed, device=dist.device,
        autocast=plan.autocast(dist.device),
    )  # fmt: skip
    if dist.is_main:
        generate.write_samples(run_dir / "samples.txt", s.prompt, texts, f"step {step}")


def report(summary: dict[str, Any], run_dir: Path, device: torch.device) -> str:
    """The run's last measurements (summary.json's numbers) and the command that draws them."""
    val, val_step, speed, mfu, wall_s, memory = (
        summary.get(key)
        for key in ("val/loss", "val/loss_step", "perf/tokens_per_sec", "perf/mfu", "wall_s",
                    "mem/peak_allocated_gib")
    )  # fmt: skip
    on_cpu = f"n/a on a {device.type}" if device.type != "cuda" else None
    # A run stopped between evaluations last measured its val loss steps ago (at step 0 perhaps).
    older = f" (at step {val_step})" if val_step is not None and val_step != summary["step"] else ""
    return "\n".join([
        f"[report] val loss {'not evaluated' if val is None else f'{val:.4f}{older}'} | "
        f"{'no step measured' if speed is None else f'{speed:,.0f} tokens/s (median step)'} | "
        f"mfu {on_cpu or 'n/a: set perf.peak_tflops' if mfu is None else f'{mfu:.1f}%'}",
        f"[report] wall time {'n/a' if wall_s is None else f'{wall_s / 60:.1f} min'} | "
        f"peak memory {on_cpu if memory is None else f'{memory:.2f} GiB allocated per GPU'}",
        f"[report] plot: {rundir.command('python', 'scripts/plot.py', str(run_dir))}",
    ])  # fmt: skip


def closing_line(run_dir: Path, step: int, max_steps: int) -> str:
    state = "finished" if step == max_steps else "stopped"
    # A finished run continues only with more steps: a number, so that the line pastes as printed.
    more = [] if step < max_steps else [f"train.max_steps={2 * max_steps}"]
    return (
        f"[train] {state} at step {step}/{max_steps}; run folder {run_dir}\n"
        f"  continue: {rundir.resume_command(run_dir, *more)}\n"
        f"  sample:   {rundir.command('python', 'sample.py', f'run={run_dir}')}"
    )


def finished_already(run_dir: Path, step: int, dist: distributed.Distributed) -> dict[str, Any]:
    """Resuming a run that reached its last step: nothing to do, nothing is written."""
    distributed.log(
        f"[train] {run_dir} already finished at step {step}: nothing to do (raise "
        "train.max_steps to train it further)"
    )
    distributed.shutdown()
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else {"step": step}


if __name__ == "__main__":
    DROPPED += config.take_drops(sys.argv)  # before Hydra, which would not find the stage here
    main()
