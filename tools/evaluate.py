"""Validation loss and perplexity of a trained model, by the trainer's own evaluation code; or
its zero-shot HellaSwag accuracy (`task=hellaswag`, tasks/hellaswag.py, as the trainer's
`train.hellaswag=true` scores it), or its LAMBADA accuracy and perplexity (`task=lambada`,
tasks/lambada.py).

    python -m tools.evaluate run=outputs/<date>/<time>-<pid>        # the run's own corpus
    python -m tools.evaluate run=outputs/... data=text data.files='notes/*.txt' out=eval.json
    python -m tools.evaluate model.pretrained=exported/ eval_sequences=200
    python -m tools.evaluate run=outputs/... task=hellaswag task_file=hellaswag_val.jsonl
    python -m tools.evaluate model.pretrained=gpt2 task=lambada out=lambada.json
    python -m tools.evaluate --help                                     # conf/evaluate.yaml

The run's model comes from its checkpoint, its settings from its saved config: the corpus (or
`data=`), the seed that picks the fixed validation windows, and the stages that change the
numbers (amp's precision, the fused head). The loader and the loss are the trainer's
(recipe/evaluation.py: `build_loaders`, `evaluate`), so on the same checkpoint and data the loss
equals the run's last logged val/loss.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

import data
import opt
from base import distributed, errors
from model import GPT
from recipe import config
from recipe.evaluation import build_loaders, evaluate
from tasks import TASKS
from tools import loading

config.register_resolvers()  # --help: conf/evaluate.yaml with its comments


@errors.app(config_name="evaluate")  # @hydra.main, its errors in one line
def main(cfg: DictConfig) -> None:
    evaluate_model(cfg)


def run_config(cfg: DictConfig, saved: dict[str, Any] | None, model: GPT) -> DictConfig:
    """The trainer's config this evaluation runs under: the run's saved one (for Hugging Face
    weights, the trainer's defaults), with the model's real shape, and `data=`, `eval_sequences`,
    `block_size` and `device` on top; the stages an evaluation runs with (`opt.for_evaluation`)."""
    if saved is None:
        saved = cast(dict[str, Any], OmegaConf.to_container(config.compose([]), resolve=True))
    run_cfg = OmegaConf.create(config.resolved(OmegaConf.create(saved), model.config))
    if cfg.get("data") is not None:
        run_cfg.data = cfg.data
    if cfg.eval_sequences is not None:
        run_cfg.train.eval_sequences = cfg.eval_sequences
    if cfg.block_size is not None:
        if cfg.block_size > model.config.block_size:
            raise errors.ConfigError(
                f"block_size={cfg.block_size} exceeds the model's {model.config.block_size} "
                f"positions: use block_size<={model.config.block_size}"
            )
        run_cfg.model.block_size = cfg.block_size
    run_cfg.device = cfg.device
    run_cfg.opt = opt.for_evaluation(run_cfg.opt)  # one process, with the rest of the plan
    config.validate(run_cfg)
    return run_cfg


def evaluate_model(cfg: DictConfig) -> dict[str, Any]:
    """Prints the validation loss and perplexity, or the HellaSwag accuracies, or LAMBADA's
    accuracy and perplexity (and writes them to `out` as JSON)."""
    counts = ("eval_sequences", "block_size", "limit")
    config.check_numbers(cfg, {key: config.count(1, nullable=True) for key in counts})
    if cfg.task != "val_loss" and cfg.task not in TASKS:
        raise errors.ConfigError(f"task={cfg.task!r}: choose one of val_loss, {', '.join(TASKS)}")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise errors.ConfigError(
            "evaluate.py runs as one process: start it with python, not torchrun"
        )
    out = loading.output_file(cfg.out)  # checked before the evaluation
    model, saved = loading.load_model(cfg, distributed.resolve_device(cfg.device))
    run_cfg = run_config(cfg, saved, model)

    # As the trainer does: the plan and the model stages, then the task.
    dist = distributed.init(run_cfg.device)
    plan = opt.plan(run_cfg, dist)
    model = opt.apply_model_stages(model, run_cfg.opt, plan, dist)  # type: ignore[assignment]
    task = val_loss_task if cfg.task == "val_loss" else zero_shot_task
    result = task(cfg, run_cfg, model, plan, dist) | {
        "model": loading.source(cfg),
        "block_size": run_cfg.model.block_size,
        "stages": plan.stages,
        "device": str(dist.device),
    }
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def val_loss_task(
    cfg: DictConfig, run_cfg: DictConfig, model: GPT, plan: opt.Plan, dist: distributed.Distributed
) -> dict[str, Any]:
    """The loss over the trainer's fixed validation windows (its loader, its evaluate())."""
    data.prepare(run_cfg.data)
    _, val_loader = build_loaders(run_cfg, plan, dist)
    loss = evaluate(model, val_loader, plan, dist)
    sequences, block = run_cfg.train.eval_sequences, run_cfg.model.block_size
    print(
        f"[evaluate] val/loss {loss:.4f} | perplexity {math.exp(loss):.2f} | {sequences} windows "
        f"of {block} tokens of {run_cfg.data.name} | stages {'+'.join(plan.stages) or 'none'}"
    )
    return {
        "val/loss": loss,
        "val/perplexity": math.exp(loss),
        "data": run_cfg.data.name,
        "eval_sequences": sequences,
    }


def zero_shot_task(
    cfg: DictConfig, run_cfg: DictConfig, model: GPT, plan: opt.Plan, dist: distributed.Distributed
) -> dict[str, Any]:
    """A zero-shot task's metrics (tasks/: HellaSwag's three accuracies, LAMBADA's accuracy and
    perplexity) under the run's precision."""
    task = TASKS[cfg.task]
    items = task.load_items(cfg.task_file, run_cfg.data.cache_dir, cfg.limit, "task_file")
    scores = task.evaluate(
        model, items, block_size=run_cfg.model.block_size, dist=dist,
        autocast=plan.autocast(dist.device),
    )  # fmt: skip
    measured = " | ".join(f"{k} {v:.4f}" for k, v in scores.items() if k != "items")
    print(
        f"[evaluate] {task.name} {measured} | {len(items)} items | stages "
        f"{'+'.join(plan.stages) or 'none'}"
    )
    return {f"{task.name}/{k}": v for k, v in scores.items()} | {"task_file": cfg.task_file}


if __name__ == "__main__":
    main()
