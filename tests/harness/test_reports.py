"""The report scripts: the quality check (the recipe against nanoGPT:
tests/harness/test_vs_nanogpt.py)."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import ROOT, python


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
        [python(), "scripts/quality.py", "--out", str(tmp_path / "q"), "--seeds", "1", "--runs-dir",
         str(tmp_path / "runs"), "--reference", "+opt=[amp]", "--candidate",
         "+opt=[amp,custom_op] opt.amp.residual=compute", *tiny],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    result = json.loads((tmp_path / "q.json").read_text())
    assert list(result["runs"]["candidate"][0]["val_loss"]) == ["0", "2", "4"]
    assert result["passed"] == (abs(result["gap"]) <= 0.02) and out.returncode == (
        not result["passed"]
    )
    assert (tmp_path / "q.png").exists() and "gap" in (tmp_path / "q.md").read_text()
    # What measured it is recorded next to the numbers.
    assert result["environment"]["command"].startswith("python scripts/quality.py --out")
    assert result["environment"]["device"].startswith("CPU") and result["environment"]["git_commit"]
