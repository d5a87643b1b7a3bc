"""A signalled sweep stops as a whole; a live preparation's
temporary folder is kept whatever its process id says; folders that are not ours are not
overwritten and links planted in a run folder are not followed; and no dead ends (a folder
without a run in it, bad metrics lines, unquoted commands)."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from base import errors
from checkpointing import FILENAME
from helpers import ROOT, TINY, python, tiny_run, tool_cfg, wandb_run_record
from recipe import config, rundir
from tools import evaluate as evaluate_app
from tools import export_hf as export_app
from tools import sample as sample_app
from train import closing_line

preparation = importlib.import_module("data.prepare")  # `data.prepare` is the function
QUIET = ("wandb.mode=disabled", "sample.num_samples=0")


def _lines_until(proc: subprocess.Popen, text: str, timeout: float = 120) -> list[str]:
    lines, deadline = [], time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if text in line or time.time() > deadline:
            break
    return lines


# ---- 7. a signalled sweep stops as a whole


@pytest.mark.slow  # three processes' start-up: ~25 s on 2 shared cores
def test_sigterm_stops_a_sweep_after_the_running_job_checkpoints(tmp_path) -> None:
    proc = subprocess.Popen(
        [python(), "train.py", "-m", *TINY, f"hydra.sweep.dir={tmp_path}", "train.seed=1,2,3",
         "train.max_steps=100000", "train.log_interval=1", *QUIET],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = _lines_until(proc, "step      2/")
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "[train] sweep stopped by SIGTERM after job 0 of 3;" in out
    assert "the 2 later job(s) did not start" in out
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0"]  # 1, 2 never ran
    assert (tmp_path / "0" / FILENAME).exists()
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and not summary["completed"]


@pytest.mark.slow  # two jobs' start-up in one process: ~20 s on 2 shared cores
def test_a_sweeps_jobs_are_named_by_what_they_vary_in_one_group_and_keep_no_files(
    tmp_path,
) -> None:
    sweep_dir = tmp_path / "lr-sweep"
    tiny = [o for o in TINY if not o.startswith("sample.")]  # the sweep's own default: none
    done = subprocess.run(
        [python(), "train.py", "-m", *tiny, f"hydra.sweep.dir={sweep_dir}", "train.lr=1e-3,3e-3",
         "train.max_steps=2", "train.eval_interval=2", "train.log_interval=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = [wandb_run_record(sweep_dir / job) for job in ("0", "1")]
    assert [r.display_name for r in runs] == ["tiny-baseline-lr=0.001", "tiny-baseline-lr=0.003"]
    assert [r.run_group for r in runs] == ["lr-sweep", "lr-sweep"]
    for job in ("0", "1"):
        left = {p.name for p in (sweep_dir / job).iterdir()}
        assert not left & {FILENAME, "checkpoint.dcp", "checkpoints", "samples.txt"}, left
        assert "summary.json" in left


def test_a_sweep_keeps_the_wandb_name_and_group_the_user_set_and_the_command_line_wins(
    monkeypatch,
) -> None:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from omegaconf import OmegaConf

    from launch import sweep

    monkeypatch.setattr(sweep, "SWEPT", ["opt", "train.lr"])
    job = ["+opt=[bs]", "train.lr=0.003", "train.seed=1"]
    unset = OmegaConf.create({"name": None, "group": None})
    assert sweep.job_wandb(unset, job, "tiny-bs", "multirun/x/sweep") == {
        "name": "tiny-bs-lr=0.003", "group": "sweep"
    }  # fmt: skip
    mine = OmegaConf.create({"name": "mine", "group": "ours"})
    assert sweep.job_wandb(mine, job, "tiny-bs", "multirun/x/sweep") == {}
    # conf's hydra.sweeper.params come first: a key the command line gives again takes its value
    params = OmegaConf.load(ROOT / "conf" / "config.yaml").hydra.sweeper.params
    assert dict(params) == {"train.checkpoint_interval": 0, "sample.num_samples": 0}
    config = OmegaConf.create({"hydra": {"sweeper": {"params": params}, "overrides": {
        "task": ["train.lr=1e-3,3e-3", "train.checkpoint_interval=50"]}}})  # fmt: skip
    (jobs,) = BasicSweeper.split_arguments(sweep.sweep_overrides(config), max_batch_size=None)
    assert all("train.checkpoint_interval=50" in j and "sample.num_samples=0" in j for j in jobs)


# ---- 9. a live preparation is never taken for a dead one


def test_a_locked_temporary_folder_is_kept_even_under_a_dead_pid(tmp_path) -> None:
    """Two containers sharing a cache and a host name: the other one's preparation runs under a
    process id that means nothing here (here: one that has exited). Its lock keeps its folder."""
    dead = subprocess.run([python(), "-c", "import os; print(os.getpid())"], capture_output=True)
    prefix = f"text-0123456789.tmp-{preparation._HOST}-{int(dead.stdout)}"
    live, stale = tmp_path / f"{prefix}-live", tmp_path / f"{prefix}-stale"
    for folder in (live, stale):
        folder.mkdir()
        (folder / "train.bin").write_bytes(b"partial")
        (folder / preparation.LOCK).touch()
    hold = (
        f"import fcntl, time; f = open({str(live / preparation.LOCK)!r}, 'a'); "
        "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([python(), "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        assert preparation.remove_stale_tmp_folders(tmp_path) == [stale]
        assert (live / "train.bin").read_bytes() == b"partial" and not stale.exists()
    finally:
        holder.kill()
        holder.wait()
    assert preparation.remove_stale_tmp_folders(tmp_path) == [live]  # its holder is gone now


# ---- 10. folders that are not ours; links planted in a run folder


@pytest.mark.parametrize("name", [".lock", "config.yaml", "metrics.jsonl", "wandb"])
def test_a_link_planted_in_a_run_folder_is_refused_and_its_target_untouched(tmp_path, name) -> None:
    victim, run_dir = tmp_path / "victim", tmp_path / "run"
    victim.write_text("precious")
    run_dir.mkdir()
    (run_dir / name).symlink_to(victim)
    with pytest.raises(RuntimeError, match=rf"run/{name} is a symbolic link \(to .*victim\)"):
        tiny_run(run_dir, "train.max_steps=1", *QUIET)
    assert victim.read_text() == "precious"


def test_config_files_are_replaced_by_a_rename_not_written_through_a_link(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "config.yaml").symlink_to(victim)
    config.save(tmp_path, {"train": {"lr": 0.1}}, ["train.lr=0.1"])
    assert victim.read_text() == "precious"
    assert not (tmp_path / "config.yaml").is_symlink()
    assert (tmp_path / "config.yaml").read_text() == "train:\n  lr: 0.1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "overrides.yaml", "victim"]


def test_export_refuses_a_foreign_hugging_face_folder_unless_forced(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    foreign = tmp_path / "foreign"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=32)).save_pretrained(
        foreign
    )
    before = (foreign / "config.json").read_text()
    run_dir = tmp_path / "run"
    tiny_run(run_dir, "train.max_steps=1", *QUIET)
    args = (f"run={run_dir}", f"out={foreign}", "check=false")
    with pytest.raises(SystemExit, match=r"^export_hf.py: error: out=.*not an export.*force=true"):
        export_app.main.__wrapped__(tool_cfg("export_hf", *args))
    assert (foreign / "config.json").read_text() == before
    export_app.export_run(tool_cfg("export_hf", *args, "force=true"))
    assert (foreign / "config.json").read_text() != before
    export_app.export_run(tool_cfg("export_hf", *args))  # now an export of ours: replaced


@pytest.mark.parametrize("app", ["sample", "evaluate"])
def test_out_is_checked_before_the_work(tmp_path, app) -> None:
    """`run=` names no folder: reading the model would fail first if `out=` were checked late."""
    main = {"sample": sample_app.main, "evaluate": evaluate_app.main}[app]
    for out, problem in [(tmp_path, "is a folder"), (tmp_path / "no" / "x", "there is no folder")]:
        cfg = tool_cfg(app, f"run={tmp_path / 'nothing here'}", f"out={out}")
        with pytest.raises(SystemExit, match=rf"^{app}.py: error: out=.*{problem}"):
            main.__wrapped__(cfg)


@pytest.mark.parametrize("mine", ["config.yaml", "overrides.yaml", "notes.txt"])
def test_a_folder_holding_someone_elses_files_is_refused_and_left_as_it_was(tmp_path, mine):
    run_dir = tmp_path / "u"
    run_dir.mkdir()
    (run_dir / mine).write_text("mine")
    with pytest.raises(errors.FileRefused, match=rf"u holds files that are not a run's \({mine}\)"):
        tiny_run(run_dir, "train.max_steps=1", *QUIET)
    assert [p.name for p in run_dir.iterdir()] == [mine]
    assert (run_dir / mine).read_text() == "mine"
    (run_dir / mine).unlink()
    (run_dir / ".hydra").mkdir()  # Hydra's own files (hydra.output_subdir=.hydra) are a run's
    (run_dir / ".hydra" / "config.yaml").write_text("hydra's")
    assert tiny_run(run_dir, "train.max_steps=1", *QUIET)["completed"]


# ---- a compile cache that is not the user's own is never read


class _Payload:
    """A pickle that writes `marker` when it is loaded: what a planted cache entry could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (self.marker, "code ran")


@pytest.mark.parametrize("foreign", ["world-writable", "another user's"])
def test_a_planted_compile_cache_is_refused_before_any_of_it_is_read(tmp_path, foreign) -> None:
    cache, marker = tmp_path / "cc", tmp_path / "marker"
    for entry in ("float32/aotautograd/planted/entry", "float32/fxgraph/pl/planted/entry"):
        (cache / entry).parent.mkdir(parents=True)
        (cache / entry).write_bytes(pickle.dumps(_Payload(marker)))
    if foreign == "world-writable":
        cache.chmod(0o777)
    elif os.getuid() == 0:
        for folder in (cache, cache / "float32"):
            os.chown(folder, 65534, 65534)
    else:
        pytest.skip("making a folder another user's takes root")
    with pytest.raises(errors.Unusable, match=r"compile cache .*cc.*pickles and compiled code"):
        tiny_run(tmp_path / "run", "train.max_steps=2", "+opt=compile",
                 f"opt.compile.cache_dir={cache}", *QUIET)  # fmt: skip
    assert not marker.exists()


@pytest.mark.parametrize("program", ["sample.py compile=true", "the low-bit optimizer"])
def test_a_planted_inductor_cache_is_refused_by_every_compile(
    tmp_path, monkeypatch, hf_dir, program
) -> None:
    """Not only the compile stage compiles: with Inductor's own folder writable by others
    (TORCHINDUCTOR_CACHE_DIR here), sampling compiled and torchao's compiled update refuse it
    before they compile."""
    cache, marker = tmp_path / "cc", tmp_path / "marker"
    (cache / "fxgraph" / "pl").mkdir(parents=True)
    (cache / "fxgraph" / "pl" / "planted").write_bytes(pickle.dumps(_Payload(marker)))
    cache.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    with pytest.raises(errors.Unusable, match=r"compile cache .*cc.*pickles and compiled code"):
        if program == "sample.py compile=true":
            settings = (f"model.pretrained={hf_dir[0]}", "max_new_tokens=2", "compile=true")
            sample_app.sample(tool_cfg("sample", *settings))
        else:
            pytest.importorskip("torchao")
            tiny_run(
                tmp_path / "run",
                "train.max_steps=1",
                "+opt=lowbit",
                "opt.lowbit.impl=torchao",
                *QUIET,
            )
    assert not marker.exists()


# ---- 11. dead ends


def _failed_before_logging(run_dir: Path) -> None:
    """What a launch that failed before its first log leaves: its lock file, its config, an empty
    metrics.jsonl."""
    run_dir.mkdir()
    (run_dir / rundir.LOCK).touch()
    config.save(run_dir, {"train": {}}, [*TINY, "train.max_steps=1", *QUIET])
    (run_dir / "metrics.jsonl").touch()


def test_a_folder_without_a_checkpoint_or_metrics_is_not_a_run(tmp_path) -> None:
    _failed_before_logging(tmp_path / "run")
    summary = tiny_run(tmp_path / "run", "train.max_steps=1", *QUIET)  # a rerun proceeds
    assert summary["completed"] and (tmp_path / "run" / FILENAME).exists()


def test_resuming_a_folder_without_a_checkpoint_says_to_start_afresh(tmp_path) -> None:
    _failed_before_logging(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="holds no checkpoint.*drop train.resume"):
        tiny_run(tmp_path / "run", "train.resume=true")


def test_a_run_without_a_checkpoint_is_refused_with_a_way_out(tmp_path) -> None:
    _failed_before_logging(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "val/loss": 10.8}\n')
    with pytest.raises(FileExistsError, match="saved no checkpoint.*move or delete that folder"):
        tiny_run(tmp_path / "run", "train.max_steps=1", *QUIET)


def test_a_failed_launch_leaves_no_empty_run_folder(tmp_path) -> None:
    run_dir = tmp_path / "run"
    failed = subprocess.run(
        [python(), "train.py", *TINY, f"hydra.run.dir={run_dir}", "data=text",
         f"data.files={tmp_path}/none/*.txt", f"data.cache_dir={tmp_path}/cache", *QUIET],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert failed.returncode != 0 and not run_dir.exists(), failed.stderr[-2000:]


def test_a_launch_failing_after_taking_its_folder_removes_it(tmp_path) -> None:
    with pytest.raises(RuntimeError), rundir.removed_on_failure(tmp_path):
        rundir.RunFolder(tmp_path, resume=False)
        config.save(tmp_path, {"train": {}}, [])
        raise RuntimeError("failed before logging")
    assert not tmp_path.exists()


def test_a_failed_launch_keeps_a_folder_that_was_not_empty(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError), rundir.removed_on_failure(tmp_path):
        raise RuntimeError("failed")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_launch_refused_by_the_lock_leaves_the_holders_new_folder_alone(tmp_path) -> None:
    hold = (
        "import pathlib, time, recipe.rundir as r; "
        f"f = r.RunFolder(pathlib.Path({str(tmp_path)!r}), False); "
        "print('held', flush=True); time.sleep(60)"
    )
    refused = pytest.raises(RuntimeError, match="another run is using")
    with refused, rundir.removed_on_failure(tmp_path):  # empty now: the other launch comes in
        holder = subprocess.Popen([python(), "-c", hold], cwd=ROOT, stdout=subprocess.PIPE)
        try:
            assert holder.stdout.readline() == b"held\n"
            rundir.RunFolder(tmp_path, resume=False)
        finally:
            holder.kill()
            holder.wait()
    assert (tmp_path / ".lock").exists()


def _metrics(run_dir: Path, data: bytes) -> Path:
    (run_dir / FILENAME).touch()  # the folder holds a checkpoint: it can be resumed
    (run_dir / "metrics.jsonl").write_bytes(data)
    return run_dir / "metrics.jsonl"


def test_a_line_torn_at_the_end_of_the_metrics_is_dropped(tmp_path) -> None:
    path = _metrics(tmp_path, b'{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x')
    assert rundir.RunFolder(tmp_path, resume=True).cut_metrics(2) == [
        {"step": 1, "x": 1.0},
        {"step": 2, "x": 2.0},
    ]
    assert path.read_text() == '{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n'


@pytest.mark.parametrize(
    "bad, problem",
    [(b'{"step": 2, "x', "not JSON text"), (b"42", "not a row"), (b'{"x": "\xff"}', "not JSON")],
)
def test_a_bad_metrics_line_is_refused_naming_the_file_and_line(tmp_path, bad, problem) -> None:
    data = b'{"step": 1}\n' + bad + b'\n{"step": 3}\n'
    path = _metrics(tmp_path, data)
    with pytest.raises(RuntimeError, match=rf"metrics.jsonl, line 2: {problem}.*delete that line"):
        rundir.RunFolder(tmp_path, resume=True).cut_metrics(3)
    assert path.read_bytes() == data  # nothing dropped


def test_printed_commands_are_quoted_for_the_shell(tmp_path) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    run_dir = tmp_path / "my runs" / "a b"
    lines = closing_line(run_dir, 3, 5).splitlines()
    resume = shlex.split(lines[1].removeprefix("  continue: "))
    assert resume == ["python", "train.py", f"hydra.run.dir={run_dir}", "train.resume=true"]
    assert shlex.split(lines[2].removeprefix("  sample:   ")) == [
        "python",
        "sample.py",
        f"run={run_dir}",
    ]
    assert OverridesParser.create().parse_override(resume[2]).value() == str(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / FILENAME).touch()
    with pytest.raises(FileExistsError) as refused:
        rundir.RunFolder(run_dir, resume=False)
    command = str(refused.value).split("`")[1]
    assert shlex.split(command)[2] == f"hydra.run.dir={run_dir}"
