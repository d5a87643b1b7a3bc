"""The run's state as one object (recipe/runstate.py): a checkpoint written as
before reads into it and it saves the same keys, its data position follows a change of batch,
its restore puts the checkpoint back and lets the host copy go, and its checks refuse in one
line."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

import checkpointing
import data
from base.distributed import Distributed
from base.errors import ConfigError
from helpers import tiny_cfg, tiny_run
from model import GPT, GPTConfig
from recipe.runstate import RunState

CPU = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
QUIET = ("sample.num_samples=0", "wandb.mode=disabled")
SHAPE = GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16)


def _tiny(seed: int = 0, n_embd: int = 8) -> tuple[GPT, torch.optim.AdamW, torch.amp.GradScaler]:
    torch.manual_seed(seed)
    model = GPT(replace(SHAPE, n_embd=n_embd))
    return model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False)


def _as_before(model: GPT) -> dict:
    """What train() saved beside the weights before the state was one object: every key of it."""
    return {
        "config": {"train": {"seed": 1}}, "model_config": asdict(model.config),
        "stages": ["amp"], "wandb_id": "abc123", "optimizer_class": "AdamW", "samples": 96,
        "corpus": {"sources": "plays", "sha256": "0" * 64, "tokenizer": "gpt2", "dtype": "uint16"},
    }  # fmt: skip


def test_a_checkpoint_written_as_before_reads_back_and_saves_the_same_keys(tmp_path) -> None:
    model, optimizer, scaler = _tiny()
    before = _as_before(model)
    checkpointing.save(tmp_path, CPU, model, optimizer, scaler, step=12, run_state=before)
    run = RunState.from_saved(checkpointing.read(tmp_path))
    assert (run.step, run.samples, run.wandb_id, run.stages) == (12, 96, "abc123", ["amp"])
    assert run.saved(run.step) == before  # the same keys and values on disk as before


def test_the_data_position_follows_this_runs_batch(tmp_path) -> None:
    model, optimizer, scaler = _tiny()
    checkpointing.save(
        tmp_path, CPU, model, optimizer, scaler, step=12, run_state=_as_before(model)
    )
    run = RunState.from_saved(checkpointing.read(tmp_path))
    run.begin({"now": 1}, model.config, [], optimizer, None, samples_per_step=4)  # a new batch
    assert run.samples_at(12) == 96 and run.samples_at(15) == 96 + 3 * 4
    saved = run.saved(15)
    assert saved["samples"] == 108 and saved["stages"] == [] and saved["config"] == {"now": 1}
    assert saved["wandb_id"] is None  # this run's: wandb off now


def test_restore_puts_the_checkpoint_back_and_lets_it_go(tmp_path) -> None:
    model, optimizer, scaler = _tiny(seed=1)
    checkpointing.save(tmp_path, CPU, model, optimizer, scaler, step=3, run_state=_as_before(model))
    rng = torch.get_rng_state()  # the saved RNG state
    other, other_optimizer, other_scaler = _tiny(seed=2)
    run = RunState.from_saved(checkpointing.read(tmp_path))
    run.check_shape(other.config)  # the same shape: accepted
    run.restore(other, other_optimizer, other_scaler, rank=0)
    torch.testing.assert_close(other.state_dict(), model.state_dict())
    assert torch.equal(torch.get_rng_state(), rng)
    assert run.checkpoint is None  # the host copy of the weights is gone
    run.restore(model, optimizer, scaler, rank=0)  # nothing left to restore: a no-op


def test_a_checkpoint_of_another_shape_is_refused_in_one_line(tmp_path) -> None:
    model, optimizer, scaler = _tiny()
    checkpointing.save(tmp_path, CPU, model, optimizer, scaler, step=3, run_state=_as_before(model))
    run = RunState.from_saved(checkpointing.read(tmp_path))
    with pytest.raises(ConfigError, match=r"n_embd=8, this run's has 16: set model.n_embd=8"):
        run.check_shape(_tiny(n_embd=16)[0].config)
    RunState().check_shape(_tiny(n_embd=16)[0].config)  # a new run: nothing to check


def test_a_new_run_starts_at_zero_with_its_corpus(tmp_path) -> None:
    cfg = tiny_cfg()
    run = RunState.start(tmp_path, cfg)
    assert (run.step, run.samples, run.checkpoint) == (0, 0, None)
    assert run.corpus == data.corpus_identity(cfg.data) and not run.finished(1)


def test_a_resume_with_another_batch_continues_the_data_position(tmp_path) -> None:
    tiny_run(tmp_path, "train.max_steps=2", "train.batch_size=4", *QUIET)
    assert checkpointing.read(tmp_path)["samples"] == 2 * 4
    tiny_run(tmp_path, "train.max_steps=3", "train.batch_size=8", "train.resume=true", *QUIET)
    assert checkpointing.read(tmp_path)["samples"] == 2 * 4 + 8
