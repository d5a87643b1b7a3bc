"""The validation loss over the fixed validation set, and the loaders that hold it: the trainer's
(train.py) and the evaluation tool's (tools/evaluate.py) alike, so that on the same checkpoint and
data the tool's loss equals the run's logged val/loss.

The plan it reads is opt.Plan; `EvalPlan` names the part of it read here (opt/ sits above this
room: the stages import the trainer's plumbing, not the other way round)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
from omegaconf import DictConfig

import data
from base import distributed
from model import GPTConfig


class EvalPlan(Protocol):
    """What the loaders and the evaluation read of opt.Plan."""

    batch_size: int  # sequences per optimizer step per rank
    loader: data.LoaderOptions

    @property
    def micro_batch_size(self) -> int: ...

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager: ...

    def loss_context(self) -> contextlib.AbstractContextManager: ...


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    val_loader: torch.utils.data.DataLoader,
    plan: EvalPlan,
    dist: distributed.Distributed,
) -> float:
    """The mean loss over the fixed validation set (`train.eval_sequences`, over all ranks).

    Eager even under +opt=compile: an inference graph (and its last, shorter batch) would cost a
    compilation longer than the evaluation itself."""
    model.eval()
    total, count = torch.zeros((), device=dist.device), 0
    for inputs, targets in data.DeviceBatches(val_loader, dist.device, plan.loader.non_blocking):
        with (
            torch.compiler.set_stance("force_eager"),
            plan.autocast(dist.device),
            plan.loss_context(),
        ):
            total += model(inputs, targets)[1] * len(inputs)
        count += len(inputs)
    model.train()
    return dist.mean(total / count).item()  # every rank holds the same number of sequences


class ZeroShotTask(Protocol):
    """What validation reads of a zero-shot task (tasks/task.py's Task, a room above)."""

    @property
    def name(self) -> str: ...

    def evaluate(
        self,
        model: torch.nn.Module,
        items: list[dict],
        *,
        block_size: int,
        dist: distributed.Distributed,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> dict[str, Any]: ...


def validation(
    model: torch.nn.Module,
    val_loader: torch.utils.data.DataLoader,
    zero_shot: Sequence[tuple[ZeroShotTask, list[dict]]],
    plan: EvalPlan,
    dist: distributed.Distributed,
) -> dict[str, float | None]:
    """`val/loss`, and each zero-shot task's metrics over its items as `val/<task>_<metric>`
    (`train.hellaswag=true`: HellaSwag's accuracies; every rank scores its share of the items).
    `model` is the GPT, or under +opt=pp the pipeline that runs it (no zero-shot task there:
    opt/pp.py refuses HellaSwag)."""
    metrics: dict[str, float | None] = {"val/loss": evaluate(model, val_loader, plan, dist)}
    for task, items in zero_shot:
        scores = task.evaluate(
            model, items, block_size=cast(GPTConfig, model.config).block_size, dist=dist,
            autocast=plan.autocast(dist.device),
        )  # fmt: skip
        metrics |= {f"val/{task.name}_{k}": v for k, v in scores.items() if k != "items"}
    return metrics


def build_loaders(
    cfg: DictConfig, plan: EvalPlan, dist: distributed.Distributed, start_sample: int = 0
) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    """This rank's training batches from the data stream's `start_sample` on, and its share of
    the fixed validation set (tools/evaluate.py builds the same one)."""
    splits = data.load_splits(
        cfg.data, block_size=cfg.model.block_size, seed=cfg.train.seed,
        vocab_size=cfg.model.vocab_size,
    )  # fmt: skip
    loader_args = dict(
        rank=dist.dp_rank, world_size=dist.dp_size, seed=cfg.train.seed, options=plan.loader
    )
    train_loader = data.build_loader(
        splits["train"], plan.batch_size, start_sample=start_sample, **loader_args
    )
    val_loader = data.build_eval_loader(
        splits["val"], cfg.train.eval_sequences, plan.micro_batch_size, **loader_args
    )
    return train_loader, val_loader
