"""A run's state besides its weights, as one object: where it stands (steps done, samples
consumed) and what rebuilds and checks it without its command line (the resolved config, the
model's real shape, the stages, the corpus, the optimizer's kind, the wandb run).

Every checkpoint saves it beside the weights (`saved()`: the keys of checkpointing/saver.py's
state, unchanged on disk) and a resume reads it back (`RunState.start`), checks it against the
new config, and puts the weights, optimizer, scaler and every rank's RNG states back (`restore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

import checkpointing
import data
from checkpointing import StateLayout
from recipe import config


@dataclass
class RunState:
    """The run's state besides its weights. `step` and `samples` say where this run starts; the
    rest is the saved run's when read from a checkpoint (what a resume checks), then this run's
    once `begin` records it (what its checkpoints save)."""

    step: int = 0  # optimizer steps done when this run starts
    samples: int = 0  # the data position then: training samples consumed, over all ranks
    samples_per_step: int = 0  # this run's: a resume may change the batch or the process count
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config
    model_config: dict[str, Any] | None = None  # the model's real shape (a pretrained one's too)
    stages: list[str] = field(default_factory=list)
    corpus: dict[str, str] | None = None  # data.corpus_identity: a resume reads the same corpus
    optimizer_class: str | None = None  # AdamW, AdamW8bit...: another's state starts afresh
    wandb_id: str | None = None  # the wandb run that a resume continues
    # The checkpoint it was read from (weights, optimizer, scaler, RNG states), until `restore`.
    checkpoint: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def start(cls, run_dir: Path, cfg: DictConfig) -> RunState:
        """Where the run starts: step 0, or under `train.resume` the checkpoint in `run_dir`,
        refused in one line if `cfg` or the corpus (its sources' content, tokenizer and dtype)
        changed what a resume cannot change. Its corpus is then `cfg.data`'s."""
        corpus = data.corpus_identity(cfg.data)
        if not cfg.train.resume:
            return cls(corpus=corpus)
        run = cls.from_saved(checkpointing.read(run_dir))
        config.check_resume(run.config, cfg)
        data.check_corpus(run.corpus, corpus)
        run.corpus = corpus
        return run

    @classmethod
    def from_saved(cls, state: dict[str, Any]) -> RunState:
        """A checkpoint's state (`checkpointing.read`); older ones lack some keys, taken as
        unknown."""
        return cls(
            step=state["step"], samples=state["samples"], config=state["config"],
            model_config=state.get("model_config"), stages=state.get("stages", []),
            corpus=state.get("corpus"), optimizer_class=state.get("optimizer_class"),
            wandb_id=state.get("wandb_id"), checkpoint=state,
        )  # fmt: skip

    def finished(self, max_steps: int) -> bool:
        """Whether the run has no step left to train (a resume of a finished run)."""
        return self.step >= max_steps

    def check_shape(self, model_config: Any) -> None:
        """Refuses a checkpoint whose model differs from this run's (a GPTConfig)."""
        if self.checkpoint is not None:
            checkpointing.check_shape(self.checkpoint, model_config)

    def restore(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        rank: int,
        layouts: Sequence[StateLayout] = (),
    ) -> None:
        """Puts the checkpoint's weights, optimizer, scaler and this rank's RNG states back
        (nothing on a new run), then lets its host copy go. `layouts`: the selected stages'."""
        if self.checkpoint is not None:
            checkpointing.restore(self.checkpoint, model, optimizer, scaler, rank, layouts)
            self.checkpoint = None

    def begin(
        self,
        resolved: dict[str, Any],
        model_config: Any,
        stages: list[str],
        optimizer: torch.optim.Optimizer,
        wandb_id: str | None,
        *,
        samples_per_step: int,
    ) -> None:
        """Records this run's own config, shape (a GPTConfig), stages, optimizer, wandb run and
        batch: what its checkpoints save from here."""
        self.config, self.stages = resolved, stages
        self.model_config = asdict(model_config)
        self.optimizer_class = type(optimizer).__name__
        self.wandb_id, self.samples_per_step = wandb_id, samples_per_step

    def samples_at(self, step: int) -> int:
        """The data position after `step` steps: the samples consumed by then."""
        return self.samples + (step - self.step) * self.samples_per_step

    def saved(self, step: int) -> dict[str, Any]:
        """What a checkpoint of step `step` saves beside the weights, the step, the scaler and
        the RNG states (checkpointing/saver.py adds those): the keys it has always had."""
        return {
            "config": self.config, "model_config": self.model_config, "stages": self.stages,
            "wandb_id": self.wandb_id, "corpus": self.corpus,
            "optimizer_class": self.optimizer_class, "samples": self.samples_at(step),
        }  # fmt: skip
