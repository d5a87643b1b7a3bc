"""The ablation harness: ladders accumulate as configured, and a CPU-sized ladder writes its
table, CSV, JSON and chart, recording a failed or out-of-memory step and going on."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess

import pytest

from conftest import CONF, ROOT, python

spec = importlib.util.spec_from_file_location("ablate", ROOT / "scripts/ablate.py")
ablate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablate)


def _ladder(name: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("ablate", overrides=[f"ladder={name}"]).ladder


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "ladder").glob("*.yaml")))
def test_every_ladder_composes_into_valid_train_configs(name: str) -> None:
    from conftest import make_cfg

    ladder = _ladder(name)
    for plan in ablate.step_plans(ladder):
        stages = [f"+opt=[{','.join(plan['stages'])}]"] if plan["stages"] else []
        cfg = make_cfg(*ladder.workload, *stages, *plan["overrides"])  # fails on a bad override
        assert list(cfg.opt) == plan["stages"]


def test_cumulative_ladders_keep_earlier_steps() -> None:
    plans = ablate.step_plans(_ladder("speed"))
    assert plans[0]["stages"] == [] and plans[1]["stages"] == ["bs"]
    last = plans[-1]
    assert last["stages"] == ["bs", "workers", "non_blocking", "compile", "amp", "tf32", "fused"]
    assert last["overrides"][-2:] == ["data.loader=memmap", "opt.compile.mode=default"]
    assert "opt.amp.dtype=bfloat16" in last["overrides"]
    alone = ablate.step_plans(_ladder("stages"))
    assert all(len(p["stages"]) <= 1 for p in alone)


def _harness(tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [python(), "scripts/ablate.py", "ladder=quick", f"out_dir={tmp_path / 'results'}",
               f"runs_dir={tmp_path / 'runs'}", "extra=['wandb.mode=disabled']", *args]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_quick_ladder_publishes_and_survives_failed_steps(tmp_path) -> None:
    _harness(
        tmp_path,
        "ladder.cumulative=false",  # so that the injected failures stay in their own steps
        "ladder.steps.2.overrides=['model.n_embd=4000000','model.n_head=1']",  # 0.8 TB of embedding
        "+ladder.steps.3.overrides=['model.n_head=3']",  # 128 wide is not divisible by 3 heads
    )
    folder = tmp_path / "results" / ablate.slug(ablate.device_name())
    result = json.loads((folder / "quick.json").read_text())
    statuses = [row["status"] for row in result["steps"]]
    assert statuses == ["ok", "ok", "oom", "failed", "ok", "ok"]
    ok = [row for row in result["steps"] if row["status"] == "ok"]
    assert all(row["tokens_per_sec"] > 0 and row["measured_steps"] == 12 for row in ok)
    assert "not divisible" in result["steps"][3]["error"]
    assert result["environment"]["git_commit"] and result["environment"]["torch"]

    table = (folder / "quick.md").read_text()
    assert table.count("\n| ") == 7 and "**oom**" in table and "**failed**" in table
    assert "python scripts/ablate.py ladder=quick" in table
    with open(folder / "quick.csv") as f:
        assert [row["status"] for row in csv.DictReader(f)] == statuses
    assert (folder / "quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Rerunning some steps updates their rows and keeps the others.
    _harness(tmp_path, "ladder.cumulative=false", "steps=[bs]")
    again = json.loads((folder / "quick.json").read_text())["steps"]
    assert [row["status"] for row in again] == statuses
    assert again[1]["wall_s"] != result["steps"][1]["wall_s"] and again[0] == result["steps"][0]
