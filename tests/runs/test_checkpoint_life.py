"""The checkpoints a long run wants: the last N kept (`train.keep_checkpoints`), the
best by validation loss (`train.keep_best`) readable by the tools, and saves written in the
background (`train.async_save`) that give the same file, resume exactly and never lose a
failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import checkpointing
from base.distributed import Distributed
from helpers import make_cfg, tiny_run
from model import GPT, GPTConfig
from tools import loading
from train import train

QUIET = ("sample.num_samples=0", "wandb.mode=disabled")
CPU = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _tiny() -> tuple[GPT, torch.optim.Optimizer, torch.amp.GradScaler]:
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    optimizer.step()  # an optimizer state to save
    return model, optimizer, torch.amp.GradScaler("cpu", enabled=False)


def _run_state(model: GPT) -> dict:
    import dataclasses

    return {"model_config": dataclasses.asdict(model.config), "config": {}}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_keep_checkpoints_keeps_the_last_n_and_read_gives_the_latest(tmp_path) -> None:
    run = tmp_path / "run"
    tiny_run(run, "train.max_steps=8", "train.checkpoint_interval=2",
             "train.keep_checkpoints=3", "perf.checkpoint_time=true", *QUIET)  # fmt: skip
    kept = sorted(p.name for p in (run / checkpointing.HISTORY).iterdir())
    assert kept == ["step-00000004", "step-00000006", "step-00000008"]
    assert checkpointing.read(run)["step"] == 8
    for step in (4, 6, 8, "step-6"):
        assert checkpointing.read(run, which=step)["step"] == int(str(step).removeprefix("step-"))
    with pytest.raises(FileNotFoundError, match="keeps no checkpoint of that step.*4, 6, 8"):
        checkpointing.read(run, which=2)
    saves = [r["step"] for r in _rows(run) if "perf/checkpoint_s" in r]
    assert saves == [2, 4, 6, 8]  # how long each save held the loop
    # The kept files are the latest's own (hard links): no copy of the weights.
    latest = run / checkpointing.FILENAME
    assert (run / checkpointing.HISTORY / "step-00000008" / latest.name).samefile(latest)


def test_keep_one_is_the_single_checkpoint_of_before(tmp_path) -> None:
    run = tmp_path / "run"
    tiny_run(run, "train.max_steps=4", "train.checkpoint_interval=2", *QUIET)
    assert not (run / checkpointing.HISTORY).exists() and not (run / checkpointing.BEST).exists()
    assert checkpointing.read(run)["step"] == 4


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_dcp_keeps_the_last_n_step_folders(tmp_path, background, group_of_one) -> None:
    from opt.fsdp import apply_fsdp

    dist = group_of_one
    model, _, scaler = _tiny()
    apply_fsdp(model, make_cfg("+opt=fsdp").opt.fsdp, dist, None)
    optimizer = torch.optim.AdamW(model.parameters())
    saver = checkpointing.Saver(tmp_path, dist, keep=2, keep_best=True, async_save=background)
    for step, loss in ((1, 3.0), (2, 2.0), (3, 2.5)):
        saver.save(model, optimizer, scaler, step, _run_state(model), val_loss=loss)
    saver.close()
    root = tmp_path / checkpointing.SHARDED
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert checkpointing.read(tmp_path)["step"] == 3
    assert checkpointing.read(tmp_path, which="best")["step"] == 2  # its step folder is gone
    best, _ = checkpointing.load_model(tmp_path, which="best")  # read whole, in one process
    assert isinstance(best, GPT)


def test_an_fsdp_checkpoint_after_an_evaluation_is_still_sharded(tmp_path, group_of_one) -> None:
    """FSDP keeps its root and last unit gathered after a forward; after an evaluation's forward
    (no backward to free them) with every block in that unit, no parameter is a shard, yet the
    checkpoint is written from the shards, each rank its own."""
    from torch.distributed.tensor import DTensor

    from opt.fsdp import apply_fsdp

    model, _, scaler = _tiny()
    knobs = make_cfg("+opt=fsdp").opt.fsdp
    knobs.blocks_per_unit = model.config.n_layer  # one unit: the last, kept gathered
    apply_fsdp(model, knobs, group_of_one, None)
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    checkpointing.Saver(tmp_path, group_of_one).save(model, optimizer, scaler, 1, _run_state(model))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert (tmp_path / checkpointing.SHARDED / "LATEST").exists()
    assert not (tmp_path / checkpointing.FILENAME).exists()


def test_keep_best_keeps_the_lowest_val_loss(tmp_path) -> None:
    model, optimizer, scaler = _tiny()
    saver = checkpointing.Saver(tmp_path, CPU, keep_best=True)
    weights = {}
    for step, loss in ((1, 3.0), (2, 2.0), (3, None), (4, 2.5)):
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)  # each step's weights differ
        weights[step] = model.state_dict()["lm_head.weight"].clone()
        saver.save(model, optimizer, scaler, step, _run_state(model), val_loss=loss)
    saver.close()
    assert checkpointing.best_record(tmp_path) == {"step": 2, "val_loss": 2.0, "measured": {}}
    assert [p.name for p in (tmp_path / "best").glob("step-*")] == ["step-00000002"]
    assert checkpointing.read(tmp_path)["step"] == 4  # the latest stays where readers look
    # The tools load it: checkpoint=best.
    cfg = OmegaConf.create({"run": str(tmp_path), "model": {}, "verify": True,
                            "checkpoint": "best"})  # fmt: skip
    loaded, _ = loading.load_model(cfg, torch.device("cpu"))
    torch.testing.assert_close(loaded.lm_head.weight, weights[2], rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="checkpoint=best: .* keeps no best"):
        checkpointing.read(tmp_path / "nothing", which="best")


def test_keep_best_in_a_run_is_its_lowest_val_loss_at_a_save(tmp_path) -> None:
    run = tmp_path / "run"
    tiny_run(run, "train.max_steps=6", "train.checkpoint_interval=2", "train.eval_interval=2",
             "train.keep_best=true", *QUIET)  # fmt: skip
    evaluated = {r["step"]: r["val/loss"] for r in _rows(run) if "val/loss" in r and r["step"]}
    best = min(evaluated, key=evaluated.__getitem__)
    measured = {"eval_sequences": 8}
    assert checkpointing.best_record(run) == {
        "step": best, "val_loss": evaluated[best], "measured": measured
    }  # fmt: skip
    assert checkpointing.read(run, which="best")["step"] == best


def test_keep_best_restarts_when_a_resume_changes_what_the_losses_measure(tmp_path, capsys):
    run, every = tmp_path / "run", ("train.checkpoint_interval=2", "train.eval_interval=2")
    tiny_run(run, "train.max_steps=4", *every, "train.keep_best=true", *QUIET)
    before = checkpointing.best_record(run)
    assert before is not None and before["measured"] == {"eval_sequences": 8}
    tiny_run(run, "train.max_steps=6", "train.resume=true", "train.eval_sequences=4")
    # Step 6's loss is over 4 sequences: it is not compared with a loss over 8, it starts anew.
    assert checkpointing.best_record(run) == {
        "step": 6, "val_loss": _rows(run)[-1]["val/loss"], "measured": {"eval_sequences": 4}
    }  # fmt: skip
    said = capsys.readouterr().out
    assert f"the best so far (step {before['step']}, val/loss" in said
    assert "the comparison restarts from step 6" in said


def test_async_save_writes_the_same_file_as_a_sync_save(tmp_path) -> None:
    model, optimizer, scaler = _tiny()
    for run in ("sync", "async"):
        (tmp_path / run).mkdir()
    torch.manual_seed(0)
    checkpointing.save(tmp_path / "sync", CPU, model, optimizer, scaler, 1, _run_state(model))
    torch.manual_seed(0)  # the same RNG state saved
    saver = checkpointing.Saver(tmp_path / "async", CPU, async_save=True)
    saver.save(model, optimizer, scaler, 1, _run_state(model))
    with torch.no_grad():  # the training goes on while it writes: the snapshot is unaffected
        for p in model.parameters():
            p.add_(1.0)
    saver.close()
    name = checkpointing.FILENAME
    assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes()


def test_snapshot_keeps_tied_weights_one_storage() -> None:
    model, optimizer, _ = _tiny()
    state = checkpointing.snapshot({"model": model.state_dict()})["model"]
    assert state["lm_head.weight"].untyped_storage().data_ptr() == (
        state["transformer.wte.weight"].untyped_storage().data_ptr()
    )
    assert state["lm_head.weight"].data_ptr() != model.lm_head.weight.data_ptr()


class _StopAt(checkpointing.StopSignal):
    """Asks to stop (checkpoint and exit) at step 5, as a SIGTERM would."""

    reads = 0

    @property
    def requested(self) -> bool:
        _StopAt.reads += 1
        return _StopAt.reads >= 5

    @requested.setter
    def requested(self, value: bool) -> None:
        pass


def test_resume_from_an_async_save_is_exact(tmp_path, monkeypatch) -> None:
    args = ("train.max_steps=8", "train.log_interval=1", "train.eval_interval=4", *QUIET)
    tiny_run(tmp_path / "straight", *args)
    with monkeypatch.context() as patch:
        patch.setattr(checkpointing, "StopSignal", _StopAt)
        stopped = tiny_run(tmp_path / "resumed", *args, "train.async_save=true")
    assert stopped["step"] == 5
    train(make_cfg("train.resume=true"), tmp_path / "resumed", overrides=["train.resume=true"])

    def losses(run: str) -> list:
        keys = ("train/loss", "train/grad_norm", "val/loss")
        return [(r["step"], [r.get(k) for k in keys]) for r in _rows(tmp_path / run)]

    assert losses("resumed") == losses("straight")


def test_a_failed_background_save_surfaces_at_the_next_save_and_at_the_end(
    tmp_path, monkeypatch
) -> None:
    model, optimizer, scaler = _tiny()
    saver = checkpointing.Saver(tmp_path, CPU, async_save=True)

    def disk_full(path, state, **kwargs) -> None:
        raise RuntimeError(f"could not write {path} (No space left on device)")

    monkeypatch.setattr(checkpointing.saver, "write_atomically", disk_full)
    saver.save(model, optimizer, scaler, 1, _run_state(model))  # returns: the write is later
    with pytest.raises(RuntimeError, match="background checkpoint save failed.*No space left"):
        saver.save(model, optimizer, scaler, 2, _run_state(model))
    saver.save(model, optimizer, scaler, 3, _run_state(model))  # fails in the background too
    with pytest.raises(RuntimeError, match="background checkpoint save failed.*No space left"):
        saver.close()  # the run's end
    saver.close()  # raised once, not again


def test_the_tools_configs_choose_a_kept_checkpoint(tmp_path) -> None:
    from hydra import compose, initialize_config_dir

    from helpers import CONF
    from tools import sample as sample_app

    run = tmp_path / "run"
    tiny_run(run, "train.max_steps=4", "train.checkpoint_interval=2", "train.eval_interval=2",
             "train.keep_checkpoints=2", "train.keep_best=true", *QUIET)  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for name in ("sample", "evaluate", "export_hf"):
            assert compose(name).checkpoint == "latest"
        for which in ("best", "2", "step-4"):
            cfg = compose("sample", overrides=[f"run={run}", f"checkpoint={which}", "device=cpu",
                                               "num_samples=1", "max_new_tokens=2"])  # fmt: skip
            assert len(sample_app.sample(cfg)) == 1
        cfg = compose("sample", overrides=[f"run={run}", "checkpoint=3", "device=cpu"])
        with pytest.raises(FileNotFoundError, match="checkpoint=3: .* keeps steps 2, 4"):
            sample_app.sample(cfg)
