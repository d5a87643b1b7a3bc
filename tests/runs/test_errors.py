"""One-line errors (base/errors.py): a user's mistake, Hydra's own errors included, ends every
entry point in one line naming the key or file, exit status 2, no traceback, and before any data
is prepared; a diverged run exits 1 with its line; a bug keeps its traceback. And the documented
way to drop a stage on resume, '~opt=<stage>'."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import opt
from base import errors
from base.distributed import Distributed
from helpers import ROOT, RUN_4_STEPS, TINY, make_cfg, python, tiny_cfg, tiny_run, torchrun_output
from recipe import config
from recipe.guard import NonFiniteSteps
from train import train

CPU = torch.device("cpu")


def _train_cli(cache: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    """`python train.py <overrides>` with an empty data cache of its own."""
    environment = {**os.environ, "GPT2_RECIPE_CACHE": str(cache), "PYTHONWARNINGS": "ignore"}
    environment.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [python(), "train.py", *overrides, f"hydra.run.dir={cache.parent / 'run'}"],
        cwd=ROOT, env={**environment, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


# The commands a user mistypes most, and the other Hydra errors: (overrides, the one line's text).
REFUSED = [
    (["train.max_steps=0"], "train.max_steps must be an integer >= 1, got 0"),
    (["+opt=ac", "opt.ac.mode=ful"], "opt.ac.mode must be one of full, selective, op, got 'ful'"),
    (["+opt=amps"], "opt=amps: no such option (did you mean amp?); choose one of ac, accum"),
    (["train.maxsteps=5"], "train.maxsteps is not a setting (did you mean train.max_steps?)"),
    (["+train.maxsteps=5"], "+train.maxsteps=5: train.maxsteps is not a setting (did you mean"),
    (["opt.compile.mode=fast"], "opt.compile.mode is not a setting: select it first with +opt="),
    (["+opt=compile", "opt.compile.mode=fast"], "opt.compile.mode must be one of default, reduce-"),
    (["sample.prompt=🙂"], "cannot parse the override 'sample.prompt=🙂': quote the value"),
    (["model=gpt3"], "model=gpt3: no such option (did you mean gpt2?)"),
]


@pytest.mark.slow  # a Python, torch and Hydra start per command: ~4 s each
@pytest.mark.parametrize(("overrides", "line"), REFUSED, ids=lambda v: str(v)[:40])
def test_a_mistake_on_the_command_line_ends_in_one_line_before_any_work(
    tmp_path, overrides, line
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    done = _train_cli(cache, *overrides)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line
    assert done.stderr.startswith(f"train.py: error: {line}"), done.stderr
    assert not list(cache.iterdir())  # nothing prepared
    assert not (tmp_path / "run").exists()  # no run folder left behind


@pytest.mark.parametrize("case", ["cwd", "run_dir", "export"])
def test_an_unwritable_folder_ends_in_one_line(tmp_path, read_only_dir, case) -> None:
    """A read-only working folder (Hydra's outputs/ there), `hydra.run.dir=<read-only>/run1`,
    and `python -m tools.export_hf out=<read-only>/x`: one line naming the path, exit 2."""
    run = [*TINY, "train.max_steps=1"]
    command, cwd, path = {
        "cwd": ([str(ROOT / "train.py"), *run], read_only_dir, read_only_dir / "outputs"),
        "run_dir": (["train.py", *run, f"hydra.run.dir={read_only_dir / 'run1'}"], ROOT,
                    read_only_dir / "run1"),
        "export": (["-m", "tools.export_hf", f"run={tmp_path}", f"out={read_only_dir / 'x'}"],
                   ROOT, read_only_dir / "x"),
    }[case]  # fmt: skip
    if case == "export":
        tiny_run(tmp_path, "train.max_steps=1", "sample.num_samples=0", "wandb.mode=disabled")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # from another folder, as when installed
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(
        [python(), *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    program = "export_hf" if case == "export" else "train"
    assert line.startswith(f"{program}.py: error: {path}: "), line
    assert "give a folder this user can write" in line


@pytest.mark.slow
def test_hydra_full_error_still_shows_the_traceback(tmp_path) -> None:
    done = _train_cli(tmp_path / "cache", "train.maxsteps=5", HYDRA_FULL_ERROR="1")
    assert done.returncode != 0 and "Traceback" in done.stderr


# A bad knob of every stage that has one: (its overrides, the key named in the refusal).
BAD_KNOBS = [
    (["+opt=ac", "opt.ac.mode=ful"], "opt.ac.mode"),
    (["+opt=ac", "opt.ac.mode=selective", "opt.ac.target=head"], "opt.ac.target"),
    (["+opt=accum", "opt.accum.steps=3"], "opt.accum"),
    (["+opt=amp", "opt.amp.dtype=float8"], "opt.amp.dtype"),
    (["+opt=bs", "opt.bs.batch_size=0"], "opt.bs.batch_size"),
    (["+opt=compile", "opt.compile.mode=fast"], "opt.compile.mode"),
    (["+opt=compile", "opt.compile.backend=tvm2"], "opt.compile.backend"),
    (["+opt=custom_op", "opt.custom_op.block=3"], "opt.custom_op.block"),
    (["+opt=ddp", "opt.ddp.comm_hook=int8"], "opt.ddp.comm_hook"),
    (["+opt=lowbit", "opt.lowbit.bits=3"], "opt.lowbit.bits"),
    (["+opt=workers", "opt.workers.num_workers=0"], "opt.workers.num_workers"),
    (["+opt=amp", "opt.amp.residual=half"], "opt.amp.residual"),
    (["+opt=ac", "++opt.ac.mod=full"], "opt.ac.mod is not a setting"),
    (["+opt=fused", "++opt.fused.lr=1"], "opt.fused.lr is not a setting"),
    (["+opt=fsdp", "opt.fsdp.mixed_precision=fp8"], "opt.fsdp.mixed_precision"),
    (["+opt=offload", "opt.offload.reshard_after_forward=maybe"], "opt.offload"),
    (["+opt=tp", "opt.tp.degree=0"], "opt.tp.degree"),
    (["+opt=pp", "opt.pp.schedule=zigzag"], "opt.pp.schedule"),
    (["+opt=custom_op", "opt.custom_op.num_warps=3"], "opt.custom_op.num_warps"),
    (["+opt=float8", "opt.float8.recipe=blockwise"], "opt.float8.recipe"),
    (["+opt=float8", "opt.float8.fsdp_all_gather=true"], "opt.float8.fsdp_all_gather"),
    (["+opt=attention", "opt.attention.backend=fast"], "opt.attention.backend"),
]


@pytest.mark.parametrize(("overrides", "key"), BAD_KNOBS, ids=lambda v: str(v)[:40])
def test_a_bad_knob_of_each_stage_is_refused_before_any_data_is_prepared(
    tmp_path, monkeypatch, overrides, key
) -> None:
    monkeypatch.setenv("GPT2_RECIPE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(errors.ConfigError, match=f"^{key}"):
        train(tiny_cfg(*overrides), tmp_path / "run")
    assert not (tmp_path / "cache").exists()


def test_fsdps_knob_is_refused_with_the_plan() -> None:
    """FSDP runs on several processes only: its knob is checked by opt.plan (before the data)."""
    two = Distributed(rank=0, local_rank=0, world_size=2, device=CPU)
    with pytest.raises(errors.ConfigError, match="^opt.fsdp.mixed_precision must be one of"):
        opt.plan(make_cfg("+opt=fsdp", "opt.fsdp.mixed_precision=fp8"), two)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+train.maxsteps=5", "train.maxsteps is not a setting (did you mean train.max_steps?)"),
        ("+opt.ac.mode=full", "opt.ac.mode is not a setting: select it first with +opt=ac"),
        ("+model.n_layers=2", "did you mean model.n_layer?"),
    ],
)
def test_a_key_added_with_plus_is_refused_naming_the_known_one(override, message) -> None:
    cfg = tiny_cfg(override)
    with pytest.raises(errors.ConfigError, match=f"^{override.replace('+', '[+]')}: .*"):
        config.validate(cfg, [override])
    with pytest.raises(errors.ConfigError) as refused:
        config.validate(cfg, [*TINY, override])
    assert message in str(refused.value)


def test_group_options_free_form_keys_and_double_plus_are_not_refused() -> None:
    overrides = ["+opt=ac", "+data.hub.name=sample-10BT", "++train.max_steps=5"]
    config.validate(tiny_cfg(*overrides), overrides)


def _exit_of(task) -> errors.ReportedExit:
    with pytest.raises(errors.ReportedExit) as ended:
        errors.main(task)
    return ended.value


def test_errors_main_reports_by_kind(capsys, monkeypatch) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr("sys.argv", ["tool.py"])

    def refuse():
        raise errors.MissingFile("run=x: no such folder;\n give the folder of a run")

    ended = _exit_of(refuse)
    line = "tool.py: error: run=x: no such folder; give the folder of a run"  # one line
    assert ended.code == 2 and str(ended) == line and capsys.readouterr().err == line + "\n"

    def diverge():
        raise NonFiniteSteps("step 7: the last 20 steps had a non-finite loss")

    assert _exit_of(diverge).code == 1

    def bug():
        raise ValueError("deep inside torch")

    with pytest.raises(ValueError, match="deep inside torch"):  # a bug: its traceback
        errors.main(bug)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(errors.MissingFile):  # Hydra's switch shows the traceback of any error
        errors.main(refuse)


def test_a_tool_ends_a_hydra_error_in_one_line(tmp_path) -> None:
    done = subprocess.run(
        [python(), "sample.py", "prompt=🙂", "temperatur=1"], cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("sample.py: error: cannot parse the override 'prompt=🙂'")
    quoted = """'prompt="🙂"'"""
    assert quoted in done.stderr and len(done.stderr.splitlines()) == 1


# ---- dropping a stage on resume: '~opt=<stage>'


def test_dropping_a_stage_on_resume_removes_it_and_its_knobs() -> None:
    saved = ["model=tiny", "+opt=[fsdp,amp]", "opt.fsdp.cpu_offload=true", "train.max_steps=4"]
    new = ["~opt=fsdp", "train.resume=true", "train.max_steps=8"]
    merged = config.merge_overrides(saved, new)
    assert merged == ["model=tiny", "+opt=[amp]", "train.max_steps=8"]
    assert new == ["~opt=fsdp", "train.resume=true", "train.max_steps=8"]  # not changed
    assert config.merge_overrides(["+opt=fsdp"], ["~opt=fsdp"]) == []
    assert OmegaConf.to_container(config.compose(merged).opt) == {
        "amp": OmegaConf.to_container(make_cfg("+opt=amp").opt.amp)
    }
    with pytest.raises(errors.ConfigError, match=r"~opt=fsdp: the saved run did not select it"):
        config.merge_overrides(["+opt=amp"], ["~opt=fsdp"])


def test_the_one_process_refusal_says_how_to_drop_the_stage() -> None:
    one = Distributed(rank=0, local_rank=0, world_size=1, device=CPU)
    with pytest.raises(
        errors.ConfigError, match="launch with `torchrun.*drop the stage: '~opt=fsdp'"
    ):
        opt.plan(make_cfg("+opt=fsdp"), one)


@pytest.mark.distributed
@pytest.mark.slow
def test_an_fsdp_run_resumes_in_one_process_without_the_stage(tmp_path) -> None:
    run_dir = tmp_path / "run"
    torchrun_output(2, "train.py", *TINY, *RUN_4_STEPS, "train.batch_size=2", "+opt=fsdp",
                    "train.max_steps=2", f"hydra.run.dir={run_dir}")  # fmt: skip
    done = subprocess.run(
        [python(), "train.py", f"hydra.run.dir={run_dir}", "train.resume=true", "~opt=fsdp",
         "train.batch_size=4", "train.max_steps=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished at step 4/4" in done.stdout
    assert "+opt=fsdp" not in (run_dir / "overrides.yaml").read_text()
