"""scripts/save_stall.py: how long a save holds the loop, sync against async. The
committed GPU result must equal a fresh summary of the runs' metrics kept beside it."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import ROOT, python
from measure import save_stall

H100 = ROOT / "docs/results/nvidia-h100-80gb-hbm3"


def test_the_committed_result_is_the_summary_of_its_kept_metrics() -> None:
    result = json.loads((H100 / "checkpoint_save.json").read_text())
    for mode, run in result["runs"].items():
        fresh = save_stall.summarize(save_stall.read_metrics(H100 / run["metrics"]))
        assert {k: run[k] for k in fresh} == json.loads(json.dumps(fresh)), mode
    assert (H100 / "checkpoint_save.md").read_text() == save_stall.render(result)


def test_summary_reads_each_saves_hold_and_the_steps_around_the_first() -> None:
    rows = [{"step": s, "perf/step_ms": 100.0 + s} for s in range(1, 8)]
    rows[0]["perf/step_ms"] = 900.0  # step 1: compilation, not a steady step
    rows += [{"step": 4, "perf/checkpoint_s": 2.5}, {"step": 7, "perf/checkpoint_s": 3.0}]
    summary = save_stall.summarize(rows)
    assert summary == {"held_s": {4: 2.5, 7: 3.0}, "step_ms_before": 103.0, "step_ms_after": 105.0}


@pytest.mark.slow
def test_a_real_pair_of_runs_on_the_cpu(tmp_path) -> None:
    tiny = ["model=tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
            "model.block_size=32", "train.batch_size=2", "device=cpu",
            "wandb.mode=disabled"]  # fmt: skip
    out = tmp_path / "cs"
    done = subprocess.run([python(), "scripts/save_stall.py", "--out", str(out), *tiny],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.with_suffix(".json").read_text())
    for run in result["runs"].values():
        assert set(run["held_s"]) == {"20", "30"} and run["step_ms_after"] > 0
        assert (tmp_path / run["metrics"]).exists()
    assert "train.async_save=true" in result["runs"]["async"]["command"]
    assert not list(tmp_path.glob(".cs_*_run"))  # the checkpoints are gone
    assert "less)." in out.with_suffix(".md").read_text()


def test_missing_metrics_files_are_refused_in_one_line(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        save_stall.main(["--out", str(tmp_path / "r"), "--from-metrics", "nope.jsonl",
                         str(H100 / "checkpoint_save_async.metrics.jsonl")])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--from-metrics: no file nope.jsonl" in err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    ("content", "line"),
    [
        ('{"step": 1}\n{"step": 2, "perf\n{"step": 3}\n', r", line 2: not JSON text"),
        ('{"step": 1, "perf/step_ms": 5.0}\n', r": no save timed after a timed step"),
    ],
)
def test_malformed_metrics_are_refused_in_one_line(
    tmp_path, capsys, monkeypatch, content, line
) -> None:
    from base import errors

    monkeypatch.setattr("sys.argv", ["save_stall.py"])

    metrics = tmp_path / "sync.jsonl"
    metrics.write_text(content)
    args = ["--out", str(tmp_path / "r"), "--from-metrics", str(metrics), str(metrics)]
    with pytest.raises(errors.ReportedExit) as exit_:
        errors.main(lambda: save_stall.main(args))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f"save_stall.py: error: {metrics}{line}")
    assert not (tmp_path / "r.json").exists()
