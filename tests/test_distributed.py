"""Multi-process runs on CPU (2 processes, gloo) through torchrun: DDP equals one process with
twice the batch, FSDP equals DDP and shards. Each launch costs ~10 s, so they are batched into
a few module-scoped runs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY, logged, python, tiny_cfg
from train import train

pytestmark = pytest.mark.distributed

# A constant learning rate, so that a run of 2 steps resumed to 4 is the 4-step run.
RUN = (
    "train.max_steps=4", "train.log_interval=1", "train.eval_interval=2", "wandb.mode=disabled",
    "train.warmup_steps=0", "train.min_lr=${train.lr}",
)  # fmt: skip


def _torchrun(script: str, *args: str) -> str:
    command = [
        python(),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        script,
    ]
    out = subprocess.run(
        command + list(args), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


# Gradients are averaged in another order across processes: float rounding, amplified a little
# by Adam in the gradient norm.
RTOL = {"train/loss": 1e-5, "val/loss": 1e-5, "train/grad_norm": 1e-3}


def _metrics(run_dir: Path) -> dict[str, list[float]]:
    return {key: logged(run_dir, key) for key in RTOL}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distributed")
    train(tiny_cfg(*RUN, "train.batch_size=4"), root / "single")
    out = {"single": root / "single"}
    launches = [
        ("ddp", []),
        ("fsdp", ["+opt=fsdp"]),
        ("ddp_accum", ["+opt=[ddp,accum]"]),
        ("fsdp_accum", ["+opt=[fsdp,accum]"]),
        ("fsdp_custom_op", ["+opt=[fsdp,custom_op]", "opt.custom_op.chunk_size=48"]),
    ]
    for name, stages in launches:
        stdout = _torchrun(
            "train.py", *TINY, *RUN, "train.batch_size=2", *stages, f"hydra.run.dir={root / name}"
        )
        (root / name / "stdout.txt").write_text(stdout)
        out[name] = root / name
    resumed = root / "fsdp_resumed"
    for steps, resume in [(2, "false"), (4, "true")]:
        overrides = (
            f"train.max_steps={steps}",
            f"train.resume={resume}",
            f"hydra.run.dir={resumed}",
        )
        _torchrun("train.py", *TINY, *RUN, "train.batch_size=2", "+opt=fsdp", *overrides)
    out["fsdp_resumed"] = resumed
    return out


def test_ddp_matches_one_process_with_twice_the_batch(runs) -> None:
    single, ddp = _metrics(runs["single"]), _metrics(runs["ddp"])
    assert len(ddp["train/loss"]) == 4 and len(ddp["val/loss"]) == 3
    for key in single:
        torch.testing.assert_close(ddp[key], single[key], rtol=RTOL[key], atol=0)
    assert "[opt] ddp: 2 processes" in (runs["ddp"] / "stdout.txt").read_text()


@pytest.mark.parametrize("name", ["ddp_accum", "fsdp_accum"])
def test_accumulation_across_processes_matches_too(runs, name: str) -> None:
    for key, values in _metrics(runs["single"]).items():
        torch.testing.assert_close(_metrics(runs[name])[key], values, rtol=RTOL[key], atol=0)


def test_fsdp_with_the_fused_head_matches_one_process(runs) -> None:
    for key, values in _metrics(runs["single"]).items():
        torch.testing.assert_close(
            _metrics(runs["fsdp_custom_op"])[key], values, rtol=RTOL[key], atol=0
        )
    assert "[opt] custom_op" in (runs["fsdp_custom_op"] / "stdout.txt").read_text()


def test_fsdp_matches_ddp(runs) -> None:
    ddp, fsdp = _metrics(runs["ddp"]), _metrics(runs["fsdp"])
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], rtol=RTOL[key], atol=0)
    stdout = (runs["fsdp"] / "stdout.txt").read_text()
    assert stdout.count("[opt] fsdp: 2 shards") == 1  # stages are announced by rank 0 only


def test_fsdp_checkpoint_is_a_full_state_dict(runs) -> None:
    fsdp = torch.load(runs["fsdp"] / "checkpoint.pt", weights_only=True)
    ddp = torch.load(runs["ddp"] / "checkpoint.pt", weights_only=True)
    assert fsdp["model"].keys() == ddp["model"].keys()
    for name, tensor in ddp["model"].items():
        assert fsdp["model"][name].shape == tensor.shape, name


def test_fsdp_shards_accumulates_and_agrees_on_overflow(tmp_path) -> None:
    _torchrun("tests/distributed_probe.py", str(tmp_path))
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["local_fraction"] == pytest.approx(0.5, abs=0.05)  # ~1/W of the parameters
        assert found["grads_after_unsynced_micro_step"] == 0  # no reduce-scatter yet
        assert found["grads_after_last_micro_step"] > 0
        assert found["params_unchanged"] and found["scale_after"] == 32768.0  # both ranks skipped
        assert found["scaler"] == "ShardedGradScaler"


def test_fsdp_resumes_exactly(runs) -> None:
    assert _metrics(runs["fsdp_resumed"]) == _metrics(runs["fsdp"])
