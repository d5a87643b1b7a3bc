"""What train() leaves to its parts, done by them: the loop meter leaves out the work under
`paused()` by itself, the saver says which steps save and how long a save held the loop, the loss
window sums on the device."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import checkpointing
from base.distributed import Distributed
from helpers import PERF_ARGS, FakeBatches, FakeClock, logged, tiny_cfg, tiny_run
from recipe.metrics import LoopMeter, LossWindow

CPU = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_work_under_paused_is_left_out_of_the_step_times() -> None:
    clock, batches = FakeClock(), FakeBatches()
    meter = LoopMeter(
        torch.device("cpu"), batches, PERF_ARGS, warmup_steps=1, compiled=False, started=0.0,
        clock=clock,
    )  # fmt: skip
    meter.start()
    for seconds in (0.3, 0.1):
        clock.now += seconds
        meter.step()
    with meter.paused():  # a log: reads the window, then writes for a while
        assert meter.window()["perf/step_ms"] == pytest.approx(200)
        clock.now += 5.0
    clock.now += 0.1
    meter.step()
    with meter.paused():  # an evaluation, then a checkpoint
        clock.now += 3.0
    clock.now += 0.1
    meter.step()
    assert meter.window()["perf/step_ms"] == pytest.approx(100)
    assert meter.summary()["perf/measured_steps"] == 3  # the warm-up step is the meter's to drop


def test_the_saver_says_which_steps_save() -> None:
    every3 = checkpointing.Saver.for_run(Path("unused"), CPU, tiny_cfg(
        "train.checkpoint_interval=3", "train.max_steps=8", "train.keep_checkpoints=2",
    ).train)  # fmt: skip
    assert [s for s in range(1, 9) if every3.due(s, stopping=False)] == [3, 6, 8]
    assert every3.due(4, stopping=True) and every3.keep == 2
    never = checkpointing.Saver(Path("unused"), CPU, every=0, max_steps=8)
    assert not any(never.due(s, stopping=False) for s in range(1, 9))
    assert never.due(5, stopping=True)  # a stop always saves


def test_the_loss_window_is_the_mean_micro_batch_loss_since_the_last_read() -> None:
    window = LossWindow(torch.device("cpu"))
    window.add(torch.tensor(6.0), micro_steps=2)  # two micro-batches' losses, summed
    window.add(torch.tensor(2.0), micro_steps=2)
    assert window.mean(CPU) == pytest.approx(2.0)
    window.add(torch.tensor(3.0), micro_steps=1)
    assert window.mean(CPU) == pytest.approx(3.0)  # started anew


def test_a_slow_save_is_logged_and_left_out_of_the_step_times(tmp_path, monkeypatch) -> None:
    write = checkpointing.write_atomically

    def slow_write(*args, **kwargs) -> None:  # a slow disk
        time.sleep(3.0)
        write(*args, **kwargs)

    monkeypatch.setattr(checkpointing.saver, "write_atomically", slow_write)
    tiny_run(
        tmp_path, "train.max_steps=3", "train.log_interval=1", "train.checkpoint_interval=2",
        "perf.checkpoint_time=true", "sample.num_samples=0", "wandb.mode=disabled",
    )  # fmt: skip
    assert [s >= 3.0 for s in logged(tmp_path, "perf/checkpoint_s")] == [True, True]  # 2 and 3
    assert logged(tmp_path, "perf/step_ms")[2] < 3000  # step 3, after step 2's save
