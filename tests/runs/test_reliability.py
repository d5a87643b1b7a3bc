"""A run loses nothing: non-finite steps are skipped and never checkpointed, run folders are
never shared or clobbered, a signalled process group checkpoints, a resume may change the stages
but not the model, bad numbers are refused before any work, and no temporary file outlives its
writer. (Bad data and unsafe pickles: tests/unit/test_data_safety.py,
tests/harness/test_memory_peak.py.)"""

from __future__ import annotations

import copy
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpointing
import opt
from base import errors
from base.distributed import Distributed
from helpers import ROOT, TINY, make_cfg, python, tiny_cfg, tiny_run
from model import GPT, GPTConfig
from recipe import rundir
from recipe.guard import NonFiniteGuard, NonFiniteSteps
from train import build_optimizer, train, train_step

CPU = torch.device("cpu")
SINGLE = Distributed(rank=0, local_rank=0, world_size=1, device=CPU)

QUIET = ("sample.num_samples=0", "wandb.mode=disabled", "train.log_interval=1")


def _rows(run_dir) -> list[dict]:
    # json.loads accepts bare NaN; the files must be strict JSON, so refuse it here.
    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))

    return [strict(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _nan_loss_on_training_calls(monkeypatch, calls: set[int]) -> None:
    """The model's loss is NaN on the given training forward passes (1-based)."""
    forward, seen = GPT.forward, [0]

    def patched(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        if self.training and targets is not None:
            seen[0] += 1
            if seen[0] in calls:
                loss = loss * float("nan")  # type: ignore[assignment]
        return logits, loss

    monkeypatch.setattr(GPT, "forward", patched)


# ---- 1. non-finite steps


def test_a_nan_step_is_skipped_counted_and_never_checkpointed(tmp_path, monkeypatch) -> None:
    _nan_loss_on_training_calls(monkeypatch, {6})
    summary = tiny_run(tmp_path, "train.max_steps=10", "train.checkpoint_interval=4", *QUIET)
    rows = _rows(tmp_path)  # strict JSON: the NaN loss of step 6 is null
    by_step = {r["step"]: r for r in rows if "train/loss" in r}
    assert by_step[6]["train/loss"] is None and by_step[7]["train/loss"] is not None
    assert by_step[5]["train/skipped_steps"] == 0 and by_step[6]["train/skipped_steps"] == 1
    assert summary["completed"] and summary["train/skipped_steps"] == 1
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == 10 and all(t.isfinite().all() for t in state["model"].values())
    json.loads((tmp_path / "summary.json").read_text(), parse_constant=pytest.fail)


@pytest.mark.parametrize("impl", ["forloop", "foreach", "fused"])
def test_a_skipped_step_leaves_weights_and_optimizer_state_alone(monkeypatch, impl) -> None:
    cfg = tiny_cfg(f"+opt={impl}")
    plan = opt.plan(cfg, SINGLE)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64))
    optimizer = build_optimizer(model, cfg.train, plan.optimizer_kwargs)
    scaler, guard = plan.grad_scaler(CPU), NonFiniteGuard(CPU, SINGLE, max_bad_steps=3)
    stepper = opt.build_step(cfg.opt, plan, guard, model, model, optimizer, scaler)
    batch = torch.randint(0, 64, (4, 9))

    def step() -> None:
        train_step(stepper, batch[:, :-1], batch[:, 1:], 1.0)

    step()  # a good step: the optimizer has state now
    weights = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict()["state"])
    _nan_loss_on_training_calls(monkeypatch, {1})
    step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    after = optimizer.state_dict()["state"]
    assert all(torch.equal(state[i][k], after[i][k]) for i in state for k in state[i])
    assert int(guard.skipped) == 1 and int(guard.in_a_row) == 1
    step()  # good again: the run of bad steps is over
    assert int(guard.in_a_row) == 0 and not torch.equal(weights[0], model.parameters().__next__())


def test_consecutive_bad_steps_stop_the_run_and_keep_the_last_good_checkpoint(
    tmp_path, monkeypatch
) -> None:
    _nan_loss_on_training_calls(monkeypatch, set(range(5, 100)))
    with pytest.raises(NonFiniteSteps, match=r"step 7: the last 3 steps .*train.max_bad_steps=3"):
        tiny_run(tmp_path, "train.max_steps=20", "train.checkpoint_interval=2",
                 "train.max_bad_steps=3", *QUIET)  # fmt: skip
    # Steps 5 and 6 were skipped, so step 6's checkpoint holds step 4's (finite) weights.
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == 6 and all(t.isfinite().all() for t in state["model"].values())


def test_a_huge_learning_rate_ends_with_an_error_not_with_nan_checkpoints(tmp_path) -> None:
    with pytest.raises(errors.Reported, match="train.lr"):  # the guard, or a save refused
        tiny_run(tmp_path, "train.lr=1e3", "train.min_lr=0", "train.max_steps=40",
                 "train.checkpoint_interval=5", "train.max_bad_steps=5", *QUIET)  # fmt: skip
    if (tmp_path / "checkpoint.pt").exists():
        state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
        assert all(t.isfinite().all() for t in state["model"].values())
    _rows(tmp_path)  # still strict JSON


def test_float16_steps_skipped_by_the_scaler_are_reported(tmp_path) -> None:
    with pytest.raises(NonFiniteSteps, match="float16 loss scale now"):
        tiny_run(tmp_path, "+opt=amp", "opt.amp.dtype=float16", "train.lr=1e3", "train.min_lr=0",
                 "train.max_steps=60", "train.max_bad_steps=4", "train.checkpoint_interval=0",
                 *QUIET)  # fmt: skip
    assert any(r.get("train/skipped_steps") for r in _rows(tmp_path))


# ---- 2. run folders


def test_launches_get_their_own_folder_and_ranks_of_one_launch_share_it(monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    mine = rundir.launch_stamp()
    assert mine.endswith(f"-{os.getpid()}")  # another process launched in this second differs
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")  # a torchrun worker: the agent's stamp
    assert rundir.launch_stamp().endswith(f"-{os.getppid()}")
    assert rundir.launch_stamp() == rundir.launch_stamp()


def test_a_folder_holding_a_run_is_refused_and_left_untouched(tmp_path) -> None:
    tiny_run(tmp_path, "train.max_steps=2", *QUIET)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(FileExistsError, match=r"already holds a run .*train.resume=true"):
        tiny_run(tmp_path, "train.max_steps=4", *QUIET)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_one_run_at_a_time_holds_a_folder(tmp_path) -> None:
    holder = rundir.RunFolder(tmp_path, resume=False)
    code = f"import pathlib, recipe.rundir as r; r.RunFolder(pathlib.Path('{tmp_path}'), True)"
    other = subprocess.run([python(), "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert other.returncode != 0 and "another run is using" in other.stderr
    del holder


def test_a_run_of_this_process_that_died_unreleased_gives_its_folder_back(tmp_path) -> None:
    # A crashed run's folder stays locked while its traceback's reference cycles wait for the
    # collector: a resume in the same process (a test, a notebook) collects them and takes it.
    gc.disable()  # the collector must not run on its own between the two lines below
    try:
        crashed = rundir.RunFolder(tmp_path, resume=False)
        cycle: list = [crashed]
        cycle.append(cycle)  # only the collector frees it, as a traceback's frames would
        del crashed, cycle
        rundir.RunFolder(tmp_path, resume=False).release()  # no run files yet: no resume
    finally:
        gc.enable()


def test_resuming_a_finished_run_changes_nothing_and_says_so(tmp_path, capsys) -> None:
    tiny_run(tmp_path, "train.max_steps=3", *QUIET)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    summary = train(make_cfg("train.resume=true"), tmp_path, overrides=["train.resume=true"])
    assert "already finished at step 3: nothing to do" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert summary["step"] == 3 and "val/loss" in summary


def test_a_resume_after_a_crash_logs_each_step_once_in_the_same_wandb_run(
    tmp_path, monkeypatch, wandb_calls
) -> None:
    args = ("train.max_steps=8", "train.checkpoint_interval=4", "sample.num_samples=0",
            "train.log_interval=1", "wandb.mode=offline")  # fmt: skip
    calls, forward = [0], GPT.forward

    def dying(self, idx, targets=None):  # the run dies in step 7, after step 4's checkpoint
        if self.training and targets is not None:
            calls[0] += 1
            if calls[0] == 7:
                raise KeyboardInterrupt("killed")
        return forward(self, idx, targets)

    monkeypatch.setattr(GPT, "forward", dying)
    with pytest.raises(KeyboardInterrupt):
        tiny_run(tmp_path, *args)
    assert [r["step"] for r in _rows(tmp_path) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    monkeypatch.setattr(GPT, "forward", forward)
    train(make_cfg("train.resume=true"), tmp_path, overrides=["train.resume=true"])
    steps = [r["step"] for r in _rows(tmp_path) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # 5 and 6 once: cut back to the checkpoint, rerun
    first, second = wandb_calls.init
    saved_id = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["wandb_id"]
    assert first["id"] is None and second["id"] == saved_id and second["resume"] == "allow"


# ---- 3. signals to the whole process group


def _group_launch(run_dir, *command: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*command, *TINY, f"hydra.run.dir={run_dir}", "train.max_steps=100000",
         "train.log_interval=1", "wandb.mode=disabled", "+opt=workers",
         "opt.workers.num_workers=2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, as a scheduler's job step
    )  # fmt: skip


def _signal_group_at_step(
    proc: subprocess.Popen, step: int, timeout: float = 240, sig: int = signal.SIGTERM
) -> str:
    lines, deadline = [], time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if f"step {step:>6}/" in line or time.time() > deadline:
            break
    os.killpg(proc.pid, sig)
    return "".join(lines) + proc.communicate(timeout=120)[0]


@pytest.mark.slow
def test_sigterm_to_the_process_group_with_workers_checkpoints_and_exits_0(tmp_path) -> None:
    proc = _group_launch(tmp_path, python(), "train.py")
    out = _signal_group_at_step(proc, 2)
    assert proc.returncode == 0, out[-3000:]
    assert "killed by signal" not in out
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] >= 2


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_a_launcher_group_checkpoints_and_exits_0(tmp_path) -> None:
    launcher = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc_per_node=2",
                "train.py"]  # fmt: skip
    proc = _group_launch(tmp_path, *launcher)
    out = _signal_group_at_step(proc, 2)
    assert proc.returncode == 0, out[-3000:]
    assert "all 2 trainers saved a checkpoint" in out
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] >= 2


@pytest.mark.slow
@pytest.mark.distributed
def test_ctrl_c_on_the_printed_torchrun_command_saves_and_exits_0_without_a_traceback(
    tmp_path,
) -> None:
    # The launcher the trainer's `continue:` line prints (base/distributed.py's launcher):
    # stock torchrun would end a Ctrl-C in its SignalException traceback, exit 1.
    launcher = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc_per_node=1",
                "train.py"]  # fmt: skip
    proc = _group_launch(tmp_path, *launcher)
    out = _signal_group_at_step(proc, 2, sig=signal.SIGINT)  # a terminal's Ctrl-C: the group
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "all 1 trainers saved a checkpoint" in out
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] >= 2


# ---- 4. resume with other stages, or another model


def test_a_plain_checkpoint_resumes_with_float16_amp(tmp_path) -> None:
    tiny_run(tmp_path, "train.max_steps=2", *QUIET)
    amp = ("+opt=amp", "opt.amp.dtype=float16")
    summary = tiny_run(tmp_path, "train.max_steps=3", "train.resume=true", *amp, *QUIET)
    assert summary["step"] == 3 and summary["completed"]


def test_a_resume_with_another_model_shape_is_refused_in_one_line(tmp_path) -> None:
    tiny_run(tmp_path, "train.max_steps=2", *QUIET)
    with pytest.raises(ValueError, match=r"model.n_layer was 2 in the saved run and is 3 now"):
        tiny_run(tmp_path, "train.resume=true", "model.n_layer=3", *QUIET)


def test_a_resume_may_change_the_schedule_and_says_so(tmp_path, capsys) -> None:
    tiny_run(tmp_path, "train.max_steps=2", *QUIET)
    train(make_cfg("train.resume=true", "train.max_steps=4"), tmp_path,
          overrides=["train.resume=true", "train.max_steps=4"])  # fmt: skip
    assert "[resume] train.max_steps: 2 -> 4" in capsys.readouterr().out
    assert [r["step"] for r in _rows(tmp_path) if "train/loss" in r] == [1, 2, 3, 4]


# ---- 5. bad numbers, refused before any work


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.max_steps=0", r"train.max_steps must be an integer >= 1, got 0"),
        ("train.max_steps=-5", r"train.max_steps must be an integer >= 1, got -5"),
        ("train.max_steps=2.5", r"train.max_steps must be an integer >= 1, got 2.5"),
        ("train.log_interval=0", r"train.log_interval must be an integer >= 1"),
        ("train.eval_interval=0", r"train.eval_interval must be an integer >= 1"),
        ("model.block_size=0", r"model.block_size must be an integer >= 1"),
        ("train.batch_size=0", r"train.batch_size must be an integer >= 1"),
        ("train.lr=abc", r"train.lr must be a number > 0, got 'abc'"),
        ("train.lr=inf", r"train.lr must be a number > 0, got inf"),
        ("train.lr=nan", r"train.lr must be a number > 0, got nan"),
        ("sample.temperature=1e-45", r"sample.temperature must be a number >= 1e-06, got 1e-45"),
        ("train.min_lr=1.0", r"train.min_lr=1.0 exceeds train.lr"),
        ("device=tpu", r"device must be one of auto, cpu, cuda, got 'tpu'"),
    ],
)
def test_bad_numbers_are_refused_naming_the_key_before_any_work(
    tmp_path, override, message
) -> None:
    with pytest.raises(ValueError, match=message):
        train(tiny_cfg(*QUIET, override), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---- 8. temporary files


def test_a_killed_writers_temporary_checkpoint_is_removed_at_the_next_save(tmp_path) -> None:
    dead = subprocess.run([python(), "-c", "import os; print(os.getpid())"], capture_output=True)
    stale = tmp_path / f"checkpoint.tmp-{int(dead.stdout)}"
    stale.write_bytes(b"half a checkpoint")
    live = tmp_path / f"checkpoint.tmp-{os.getppid()}"  # a process still saving: kept
    live.write_bytes(b"in progress")
    checkpointing.saver._remove_stale_temporaries(tmp_path)
    assert not stale.exists() and live.exists()


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_full_disk_names_the_cause_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch, async_save
) -> None:
    tiny_run(tmp_path, "train.max_steps=2", *QUIET)
    good = (tmp_path / "checkpoint.pt").read_bytes()

    def full(obj, f, *args, **kwargs):
        f.write(b"x" * 10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    more = ("train.max_steps=3", "train.resume=true", f"train.async_save={async_save}", *QUIET)
    # A user's error, one line and exit 2, whether the save ran in the loop or in the background.
    with pytest.raises(errors.Unusable, match=r"could not write .*No space left on device.*unch"):
        tiny_run(tmp_path, *more)
    assert (tmp_path / "checkpoint.pt").read_bytes() == good
    assert not list(tmp_path.glob("checkpoint.pt.tmp-*"))


def _tiny_model_and_optimizer() -> tuple[GPT, torch.optim.Optimizer, torch.amp.GradScaler]:
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16))
    return model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False)


def test_a_second_ctrl_c_during_a_save_is_an_interruption_not_a_full_disk(
    tmp_path, monkeypatch, capsys
) -> None:
    model, optimizer, scaler = _tiny_model_and_optimizer()
    checkpointing.save(tmp_path, SINGLE, model, optimizer, scaler, step=1, run_state={})
    good = (tmp_path / "checkpoint.pt").read_bytes()

    def interrupted(obj, f, *args, **kwargs):  # as torch.save fails when Ctrl-C unwinds it
        f.write(b"half a checkpoint")
        try:
            raise KeyboardInterrupt("a second Ctrl-C")
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4")

    monkeypatch.setattr(torch, "save", interrupted)
    monkeypatch.setattr("sys.argv", ["train.py"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    save = lambda: checkpointing.save(tmp_path, SINGLE, model, optimizer, scaler, 2, {})  # noqa: E731
    with pytest.raises(errors.ReportedExit) as ended:
        errors.main(save)
    assert ended.value.code == errors.INTERRUPTED
    assert capsys.readouterr().err == "train.py: interrupted (a second Ctrl-C)\n"
    assert (tmp_path / "checkpoint.pt").read_bytes() == good


def test_weights_that_are_not_finite_at_a_save_end_the_run_in_one_line(tmp_path, capsys) -> None:
    """The settings made them (a learning rate, the data, the start): the user's error, exit 2,
    with what to lower or check."""
    model, optimizer, scaler = _tiny_model_and_optimizer()
    with torch.no_grad():
        next(model.parameters())[0] = float("inf")
    with pytest.raises(errors.ReportedExit) as exit_:
        errors.main(
            lambda: checkpointing.save(
                tmp_path, SINGLE, model, optimizer, scaler, step=3, run_state={}
            )
        )
    assert exit_.value.code == 2
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert re.match(
        r"^\S+: error: step 3: the weights are not finite, .* none\)\. Lower train.lr", said
    )
    assert "check the data" in said and not (tmp_path / "checkpoint.pt").exists()


def test_a_stop_signal_during_the_first_evaluation_stops_the_run_as_any_stop(
    tmp_path, monkeypatch
) -> None:
    import train as trainer

    evaluations, validation = [0], trainer.validation

    def signalled(*args, **kwargs):  # SIGTERM arrives while step 0 is being evaluated
        evaluations[0] += 1
        if evaluations[0] == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return validation(*args, **kwargs)

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the process's own handler")

    monkeypatch.setattr(trainer, "validation", signalled)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        summary = tiny_run(tmp_path, "train.max_steps=50", *QUIET)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert summary["stopped_by"] == "SIGTERM" and not summary["completed"]
    assert checkpointing.read(tmp_path)["step"] == summary["step"] < 50


def test_wandb_auto_falls_back_to_offline_when_the_server_is_silent(
    tmp_path, monkeypatch, wandb_calls
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    started = time.time()
    tiny_run(tmp_path, "train.max_steps=1", "wandb.mode=auto", "wandb.init_timeout_s=5",
             "sample.num_samples=0")  # fmt: skip
    assert time.time() - started < 60
    assert [call["mode"] for call in wandb_calls.init][-1] == "offline"
    assert list(tmp_path.glob("wandb/offline-run-*"))


def test_a_finished_run_gives_its_folder_up_without_the_collector(tmp_path) -> None:
    """train() releases the run folder's lock when it returns: a resume in the same process
    takes the folder at once, even where the collector has not freed the finished run (its
    hooks and optimizer form reference cycles that only it frees)."""
    import gc

    args = ("train.checkpoint_interval=2", "sample.num_samples=0", "wandb.mode=disabled")
    gc.disable()
    try:
        tiny_run(tmp_path, "train.max_steps=2", *args)
        tiny_run(tmp_path, "train.max_steps=4", "train.resume=true")
    finally:
        gc.enable()
