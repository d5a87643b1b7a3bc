"""The report scripts: the recipe against nanoGPT from one device call, and the quality check."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest

from conftest import ROOT, python


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)
    return module


NANOGPT = """nanoGPT bench.py batch 32 bias=False: 482,065 tokens/s (67.97 ms/step)
nanoGPT bench.py batch 32 bias=True: 462,971 tokens/s (70.78 ms/step)
"""


def test_vs_nanogpt_compares_a_ladder_row_with_bench_py() -> None:
    vs = _script("vs_nanogpt")
    env = {"device": "NVIDIA H100 80GB HBM3", "git_commit": "abc", "date": "d", "torch": "2.11"}
    row = {"name": "bs64", "status": "ok", "tokens_per_sec": 530_271.5, "mfu": 45.8,
           "peak_allocated_gib": 26.3, "command": "python train.py ..."}  # fmt: skip
    result = vs.compare(NANOGPT, {"environment": env, "steps": [row]}, "bs64")
    assert result["nanogpt_tokens_per_sec"] == 482_065 and result["ratio"] == pytest.approx(1.1)
    assert result["nanogpt_bias_tokens_per_sec"] == 462_971 and result["commit"] == "abc"
    assert "**1.100**" in vs.markdown(result)
    with pytest.raises(SystemExit, match="no bench.py number without biases"):
        vs.compare("nanoGPT bench.py batch 32 bias=False: failed", {"steps": []}, "bs64")
    with pytest.raises(SystemExit, match="'memmap' is not an ok row"):
        vs.compare(NANOGPT, {"environment": env, "steps": [row]}, "memmap")


@pytest.mark.slow
def test_quality_runs_both_configurations_and_reports_the_gap(tmp_path) -> None:
    tiny = [
        "model=tiny",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "train.batch_size=2",
        "train.max_steps=4",
        "train.eval_interval=2",
        "train.eval_sequences=4",
        "device=cpu",
        "wandb.mode=disabled",
    ]
    out = subprocess.run(
        [python(), "scripts/quality.py", "--out", str(tmp_path / "q"), "--runs-dir",
         str(tmp_path / "runs"), "--reference", "+opt=[amp]", "--candidate",
         "+opt=[amp,custom_op] opt.amp.residual=compute", *tiny],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    result = json.loads((tmp_path / "q.json").read_text())
    assert list(result["runs"]["candidate"]["val_loss"]) == ["0", "2", "4"]
    assert result["passed"] == (abs(result["gap"]) <= 0.02) and out.returncode == (
        not result["passed"]
    )
    assert (tmp_path / "q.png").exists() and "gap" in (tmp_path / "q.md").read_text()
    # What measured it is recorded next to the numbers.
    assert result["environment"]["command"].startswith("python scripts/quality.py --out")
    assert result["environment"]["device"].startswith("CPU") and result["environment"]["git_commit"]
