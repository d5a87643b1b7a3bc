"""End-to-end CPU runs: metrics in all three places, checkpoints, exact resume, preemption."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import torch

import checkpointing
from base.distributed import Distributed
from helpers import ROOT, TINY, make_cfg, python, tiny_cfg, tiny_run, wandb_summary
from model import GPT, GPTConfig
from train import train

TRAIN_METRICS = {
    "step", "train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/mfu",
    "perf/hfu", "perf/step_ms", "mem/peak_allocated_gib", "mem/peak_reserved_gib",
    "train/skipped_steps", "perf/data_wait_ms", "perf/joules_per_token", "perf/gpu_busy",
}  # fmt: skip


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_short_run_logs_everywhere_and_saves(tmp_path, capsys, wandb_calls) -> None:
    summary = train(
        tiny_cfg("train.max_steps=6", "train.log_interval=2", "train.eval_interval=3"), tmp_path
    )
    rows = _rows(tmp_path)
    logged = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    assert all(set(r) == TRAIN_METRICS for r in logged)
    assert all(r["perf/tokens_per_sec"] > 0 and r["train/grad_norm"] > 0 for r in logged)
    assert logged[0]["perf/mfu"] is None and logged[0]["mem/peak_allocated_gib"] is None  # CPU
    assert logged[0]["perf/hfu"] is None
    val = {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}
    assert list(val) == [0, 3, 6] and val[6] < val[0]

    (init,) = wandb_calls.init  # wandb got the same numbers, and an offline run exists
    assert init["name"] == "tiny-baseline" and init["mode"] == "offline"
    assert init["config"]["train"]["max_steps"] == 6 and init["config"]["stages"] == []
    sent = [{"step": step, **metrics} for metrics, step in wandb_calls.logs if metrics]
    assert sent == rows  # (and an empty log that commits the last row before the summary)
    assert wandb_calls.finished == 1
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))

    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == 6 and "transformer.wte.weight" in state["model"]
    assert summary["completed"] and summary["val/loss"] == val[6]
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 6
    assert "[sample]" in capsys.readouterr().out


def test_a_run_ends_with_a_report_of_what_it_measured(tmp_path, capsys) -> None:
    """The last lines before 'finished': summary.json's val loss, median tokens/s, MFU, wall
    time and peak memory (n/a on a CPU), and the command that plots the run."""
    overrides = ("train.max_steps=4", "perf.warmup_steps=1", "sample.num_samples=0")
    summary = train(tiny_cfg(*overrides, "wandb.mode=disabled"), tmp_path)
    lines = capsys.readouterr().out.splitlines()
    finished = next(i for i, line in enumerate(lines) if line.startswith("[train] finished"))
    assert lines[finished - 3 : finished] == [
        f"[report] val loss {summary['val/loss']:.4f} | "
        f"{summary['perf/tokens_per_sec']:,.0f} tokens/s (median step) | mfu n/a on a cpu",
        f"[report] wall time {summary['wall_s'] / 60:.1f} min | peak memory n/a on a cpu",
        f"[report] plot: python scripts/plot.py {tmp_path}",
    ]


def test_wandbs_summary_is_summary_json(tmp_path) -> None:
    """wandb's final summary, read back from the offline run's file, holds summary.json's numbers
    (the run's median tokens/s), not the last logged window's, which a run's table would show."""
    overrides = ("train.max_steps=8", "train.log_interval=4", "perf.warmup_steps=2")
    train(tiny_cfg(*overrides), tmp_path)
    saved = json.loads((tmp_path / "summary.json").read_text())
    in_wandb = wandb_summary(tmp_path)
    assert {key: in_wandb.get(key) for key in saved} == saved


def _stop_after(steps: int) -> type[checkpointing.StopSignal]:
    """A stand-in for SIGTERM arriving during step `steps` (the loop reads the flag once a step)."""

    class StopAfter(checkpointing.StopSignal):
        reads = 0

        @property
        def requested(self) -> bool:
            StopAfter.reads += 1
            return StopAfter.reads >= steps

        @requested.setter
        def requested(self, value: bool) -> None:
            pass

    return StopAfter


def test_resume_gives_the_losses_of_the_uninterrupted_run(tmp_path, monkeypatch) -> None:
    args = (
        "train.max_steps=8", "train.log_interval=1", "train.eval_interval=4",
        "sample.num_samples=0", "wandb.mode=disabled",
    )  # fmt: skip
    tiny_run(tmp_path / "straight", *args)
    with monkeypatch.context() as patch:
        patch.setattr(checkpointing, "StopSignal", _stop_after(5))
        stopped = tiny_run(tmp_path / "resumed", *args)
    assert stopped["step"] == 5 and not stopped["completed"]
    # Only train.resume on the command line: the saved run supplies the rest (its schedule too).
    train(make_cfg("train.resume=true"), tmp_path / "resumed", overrides=["train.resume=true"])

    def losses(run: str) -> list:
        keys = ("train/loss", "train/grad_norm", "val/loss")
        return [(r["step"], [r.get(k) for k in keys]) for r in _rows(tmp_path / run)]

    assert losses("resumed") == losses("straight")  # bit for bit, steps 1..8


def test_a_stopped_runs_report_says_when_its_val_loss_was_measured(
    tmp_path, monkeypatch, capsys
) -> None:
    """Stopped at step 5, between evaluations: the report's val loss is step 4's and says so,
    as summary.json does; the resumed run's, measured at its last step, carries no step."""
    args = ("train.max_steps=8", "train.eval_interval=4", "sample.num_samples=0")
    with monkeypatch.context() as patch:
        patch.setattr(checkpointing, "StopSignal", _stop_after(5))
        stopped = tiny_run(tmp_path, *args, "wandb.mode=disabled")
    assert (stopped["step"], stopped["val/loss_step"]) == (5, 4)
    assert f"[report] val loss {stopped['val/loss']:.4f} (at step 4) | " in capsys.readouterr().out
    resumed = train(make_cfg("train.resume=true"), tmp_path, overrides=["train.resume=true"])
    assert (resumed["step"], resumed["val/loss_step"]) == (8, 8)
    assert f"[report] val loss {resumed['val/loss']:.4f} | " in capsys.readouterr().out


def test_a_killed_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch) -> None:
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16))
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    dist = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    checkpointing.save(tmp_path, dist, model, optimizer, scaler, step=1, run_state={})
    good = (tmp_path / "checkpoint.pt").read_bytes()

    def killed_midway(obj, f, *args, **kwargs) -> None:
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save(tmp_path, dist, model, optimizer, scaler, step=2, run_state={})
    assert (tmp_path / "checkpoint.pt").read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.pt",
        "checkpoint.pt.sha256.json",
    ]
    assert checkpointing.read(tmp_path)["step"] == 1


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no run to continue.*point hydra.run.dir"):
        train(tiny_cfg("train.resume=true"), tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without GPU")
def test_device_cuda_without_a_gpu_fails_before_any_work(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="device=cuda, but no CUDA GPU is visible.*device=auto"):
        train(tiny_cfg("device=cuda"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _launch(run_dir, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [python(), "train.py", *TINY, f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_cli_trains_and_writes_the_run_folder(tmp_path) -> None:
    proc = _launch(tmp_path, "train.max_steps=3", "train.log_interval=1")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert {"metrics.jsonl", "checkpoint.pt", "summary.json", "wandb"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert "[sample]" in out and "step      3/3" in out


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path) -> None:
    proc = _launch(
        tmp_path, "train.max_steps=100000", "train.log_interval=1", "wandb.mode=disabled"
    )
    lines = []
    deadline = time.time() + 120
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step      2/") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "SIGTERM: saving a checkpoint after this step" in out
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert 2 <= state["step"] < 100000
    assert json.loads((tmp_path / "summary.json").read_text())["completed"] is False


def test_prof_trace_records_the_asked_steps_once(tmp_path, capsys) -> None:
    overrides = ("train.max_steps=20", "wandb.mode=disabled", "+prof=trace", "prof.trace.wait=2")
    train(tiny_cfg(*overrides), tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    steps = sorted(name for name in names if name.startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#4", "ProfilerStep#5", "ProfilerStep#6"] and "aten::mm" in names
    assert capsys.readouterr().out.count("[prof] trace of") == 1  # then the profiler is off


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without GPU")
def test_prof_memory_needs_a_gpu(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"\+prof=memory records CUDA allocations"):
        train(tiny_cfg("train.max_steps=2", "wandb.mode=disabled", "+prof=memory"), tmp_path)


def test_memory_peak_reads_a_snapshot(tmp_path) -> None:
    from measure import memory_peak

    def event(action: str, addr: int, size: int, where: str) -> dict:
        frames = [{"filename": "torch/nn/functional.py", "line": 1, "name": "linear"},
                  {"filename": f"/x/{where}", "line": 7, "name": "forward"}]  # fmt: skip
        return {"action": action, "addr": addr, "size": size, "frames": frames}

    trace = [
        event("alloc", 1, 100, "model/gpt.py"),
        event("alloc", 2, 300, "train.py"),
        event("free_completed", 2, 300, "train.py"),
        event("alloc", 3, 250, "opt/ac.py"),  # 350 live: below the peak of 400 (1 and 2)
        event("free_completed", 3, 250, "opt/ac.py"),
    ]
    top, sites = memory_peak.peak({"device_traces": [trace], "segments": []})
    assert top == 400 and sites == {"gpt.py:7 forward": 100, "train.py:7 forward": 300}


def test_prof_trace_cpu_false_records_the_gpus_kernels_only(tmp_path, monkeypatch) -> None:
    """prof.trace.cpu=false: the profiler records CUDA activity alone (no CPU operators, whose
    recording would show as GPU idle in a host-bound step); on a CPU run that is refused."""
    from omegaconf import OmegaConf

    from recipe import profiling

    asked: dict = {}

    class Recorder:
        def __init__(self, **kwargs) -> None:
            asked.update(kwargs)

        def start(self) -> None:
            asked["started"] = True

    monkeypatch.setattr(profiling.torch.profiler, "profile", Recorder)
    prof = OmegaConf.create({"trace": {"wait": 1, "warmup": 1, "active": 2, "record_shapes": False,
                                       "with_stack": False, "cpu": False}})  # fmt: skip
    profiling.Profiler(prof, tmp_path, torch.device("cuda"), rank=0)
    assert asked["activities"] == [torch.profiler.ProfilerActivity.CUDA] and asked["started"]
    prof.trace.cpu = True
    profiling.Profiler(prof, tmp_path, torch.device("cuda"), rank=0)
    assert torch.profiler.ProfilerActivity.CPU in asked["activities"]
    prof.trace.cpu = False
    with pytest.raises(ValueError, match=r"prof.trace.cpu=false records the GPU's kernels only"):
        profiling.Profiler(prof, tmp_path, torch.device("cpu"), rank=0)
