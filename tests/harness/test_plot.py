"""scripts/plot.py: a sweep folder's jobs compared in one PNG, the legend naming what each job
varied; no empty panel (memory on a CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import tiny_run
from measure import plot

RUN = ("train.max_steps=2", "train.log_interval=1", "train.eval_interval=2",
       "train.checkpoint_interval=0", "wandb.mode=disabled")  # fmt: skip


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tiny runs laid out as `python train.py -m train.lr=1e-3,2e-3` lays out its jobs."""
    folder = tmp_path_factory.mktemp("multirun")
    for job, lr in enumerate(("1e-3", "2e-3")):
        tiny_run(folder / str(job), *RUN, f"train.lr={lr}")
    (folder / "multirun.yaml").write_text("hydra: {}\n")
    return folder


def test_a_sweep_folder_plots_its_jobs_named_by_their_overrides(sweep) -> None:
    out, names = plot.plot([sweep])
    assert out == sweep / "metrics.png" and out.stat().st_size > 0
    assert names == ["train.lr=1e-3", "train.lr=2e-3"]  # what the jobs share is left out


def test_the_legend_names_each_job(sweep, tmp_path, monkeypatch) -> None:
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot.plot([sweep], tmp_path / "x.png")
    legend = saved[0].axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["train.lr=1e-3", "train.lr=2e-3"]


def test_no_empty_panel_on_a_cpu(sweep) -> None:
    metrics = [plot.read_metrics(run / "metrics.jsonl") for run in plot.runs_in(sweep)]
    assert [title.split()[0] for title, _, _ in plot.with_data(metrics)] == ["loss", "throughput"]


def test_several_run_folders_plot_beside_them(sweep, capsys) -> None:
    plot.main([str(sweep / "0"), str(sweep / "1")])
    assert (sweep / "compare.png").is_file()
    assert "2 run(s)" in capsys.readouterr().out


def test_a_folder_without_runs_is_refused_in_one_line(tmp_path) -> None:
    with pytest.raises(SystemExit, match="no metrics.jsonl in it or in numbered job folders"):
        plot.plot([tmp_path])


# ---- the sweep's table at its end


def _job(num: int, overrides: list[str], summary: dict | None) -> tuple:
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    done = JobReturn(overrides=overrides, status=JobStatus.COMPLETED, _return_value=summary)
    if summary is None:
        done = JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=ValueError())
    return OmegaConf.create({"hydra": {"job": {"num": num}}}), done


def test_a_sweep_prints_its_table_when_its_last_job_ends(capsys) -> None:
    from launch.sweep import SweepTable

    table = SweepTable()
    table.jobs = 3
    ok = {"val/loss": 5.61234, "perf/tokens_per_sec": 12345.6, "completed": True}
    table.on_job_end(*_job(0, ["train.max_steps=50", "train.lr=1e-3"], ok))
    table.on_job_end(*_job(1, ["train.max_steps=50", "train.lr=2e-3"], None))
    assert capsys.readouterr().out == ""  # not before the last job
    table.on_job_end(*_job(2, ["train.max_steps=50", "train.lr=4e-3"], ok | {"stopped_by": None}))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[train] sweep: 3 of 3 job(s) ran"
    assert lines[2].split() == ["0", "train.lr=1e-3", "5.6123", "12,346", "ok"]
    assert lines[3].split() == ["1", "train.lr=2e-3", "-", "-", "failed"]
    assert lines[4].split()[:2] == ["2", "train.lr=4e-3"]


def test_a_stopped_sweep_prints_its_table_too(capsys) -> None:
    from launch.sweep import SweepTable

    table = SweepTable()
    table.jobs = 3
    table.on_job_end(*_job(0, ["train.lr=1e-3"], {"stopped_by": "SIGTERM", "val/loss": 7.0}))
    assert "stopped by SIGTERM" in capsys.readouterr().out


def test_a_single_run_prints_no_table(capsys) -> None:
    from launch.sweep import SweepTable

    SweepTable().on_job_end(*_job(0, ["train.lr=1e-3"], {"completed": True}))
    assert capsys.readouterr().out == ""


@pytest.mark.slow  # a two-job sweep in a subprocess: ~40 s on 2 shared cores
def test_a_real_sweep_prints_its_table_and_plots_its_jobs(tmp_path) -> None:
    import subprocess

    from helpers import ROOT, TINY, python

    sweep = [python(), "train.py", "-m", *TINY, *RUN, "train.lr=1e-3,2e-3",
             f"hydra.sweep.dir={tmp_path}"]  # fmt: skip
    done = subprocess.run(sweep, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("[train] sweep: 2 of 2 job(s) ran") :].splitlines()
    assert [line.split()[1] for line in table[2:4]] == ["train.lr=0.001", "train.lr=0.002"]
    drawn = subprocess.run([python(), "scripts/plot.py", str(tmp_path)], cwd=ROOT, timeout=120)
    assert drawn.returncode == 0 and (tmp_path / "metrics.png").is_file()
    assert plot.labels(plot.runs_in(tmp_path)) == ["train.lr=0.001", "train.lr=0.002"]


@pytest.mark.parametrize(
    ("file", "content", "line"),
    [
        ("metrics.jsonl", '{"step": 1}\n{"step": 2, "train/l\n{"step": 3}\n', r"line 2: not JSON"),
        ("overrides.yaml", "- !!python/name:os.system x\n", r"overrides.yaml is damaged"),
    ],
)
def test_a_malformed_run_folder_is_refused_in_one_line(tmp_path, file, content, line) -> None:
    import os
    import re
    import subprocess

    from helpers import ROOT, python

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 3.0}\n')
    (tmp_path / file).write_text(content)
    this_checkout = {**os.environ, "PYTHONPATH": str(ROOT)}  # its recipe, not an installed one
    done = subprocess.run(
        [python(), "scripts/plot.py", str(tmp_path)],
        cwd=ROOT, env=this_checkout, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (said,) = done.stderr.strip().splitlines()
    assert re.match(rf"^plot.py: error: {tmp_path}.*{line}", said)
