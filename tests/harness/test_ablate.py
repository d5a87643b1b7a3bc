"""The ablation harness: ladders accumulate as configured, and a CPU-sized ladder writes its
table, CSV, JSON and chart, recording a failed or out-of-memory step and going on; multi-process
steps (several GPUs, several "machines") carry their per-GPU efficiency, and a timed-out step,
or a harness stopped by SIGTERM, leaves no process behind."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError
from helpers import ROOT, python
from measure import ablate, ladder_results, ladder_table, ladders, runner, stats


@pytest.mark.parametrize("name", ["speed", "memory_xl"])
def test_a_gpu_ladder_without_a_gpu_is_refused_naming_the_quick_ladder(monkeypatch, name) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=f"^ladder={name} measures") as e:
        ablate.main([f"ladder={name}"])  # before any step runs
    assert "use ladder=quick, sized for a CPU" in str(e.value)


@pytest.mark.parametrize("name", sorted(p.stem for p in (ladders.CONF / "ladder").glob("*.yaml")))
def test_every_ladder_composes_into_valid_train_configs(name: str) -> None:
    from helpers import make_cfg

    ladder = ladders.read(name)
    for plan in ladders.step_plans(ladder):
        stages = [f"+opt=[{','.join(plan['stages'])}]"] if plan["stages"] else []
        cfg = make_cfg(*ladder.workload, *stages, *plan["overrides"])  # fails on a bad override
        assert list(cfg.opt) == plan["stages"]


@pytest.mark.parametrize("name", sorted(p.stem for p in (ladders.CONF / "ladder").glob("*.yaml")))
def test_every_ladder_step_is_planned_on_its_process_count(name: str) -> None:
    """Each step's stages accept its model and its GPUs (a tp degree that splits the heads, a
    process count that pp x tp divides, micro-batches that divide the batch)."""
    import warnings

    from helpers import planned

    ladder = ladders.read(name)
    for plan in ladders.step_plans(ladder):
        stages = [f"+opt=[{','.join(plan['stages'])}]"] if plan["stages"] else []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. +opt=ddp's "no effect in one process"
            planned(plan["gpus"], *ladder.workload, *stages, *plan["overrides"])


def test_cumulative_ladders_keep_earlier_steps() -> None:
    plans = ladders.step_plans(ladders.read("speed"))
    assert plans[0]["stages"] == [] and plans[1]["stages"] == ["bs"]
    memmap, last = (next(p for p in plans if p["name"] == n) for n in ("memmap", "bs64"))
    assert memmap["stages"] == ["bs", "workers", "non_blocking", "compile", "amp", "tf32", "fused"]
    assert memmap["overrides"][-2:] == ["data.loader=memmap", "opt.compile.mode=default"]
    assert last["stages"] == [*memmap["stages"], "custom_op"]
    assert last["overrides"][-2:] == ["opt.amp.residual=compute", "opt.bs.batch_size=64"]
    assert "opt.amp.dtype=bfloat16" in last["overrides"]
    assert [p["name"] for p in plans][-2:] == ["ddp", "multi_node"]
    alone = ladders.step_plans(ladders.read("stages"))
    assert all(len(p["stages"]) <= 1 for p in alone)


def _harness(tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [python(), "scripts/ablate.py", "ladder=quick", f"out_dir={tmp_path / 'results'}",
               f"runs_dir={tmp_path / 'runs'}", "extra=['wandb.mode=disabled']", *args]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_ctrl_c_on_the_harness_ends_in_one_line(tmp_path) -> None:
    # A terminal's Ctrl-C reaches the harness's process group (its steps run in their own): it
    # stops the running step and ends in base/errors.py's one line, not a traceback.
    command = [python(), "scripts/ablate.py", "ladder=quick", f"out_dir={tmp_path / 'results'}",
               f"runs_dir={tmp_path / 'runs'}", "extra=['wandb.mode=disabled']"]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's recipe, not an installed one
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:  # until the first step is running
        if line.startswith("[ablate] quick 00 baseline:"):
            break
    else:
        raise AssertionError("the harness ended before its first step")
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in out + err, err[-3000:]
    assert err.strip().splitlines() == ["ablate.py: interrupted"] and proc.returncode == 130


def _processes_of(runs_dir: Path) -> list[str]:
    """The pids of the processes whose command line names a run folder in `runs_dir` (the
    steps' processes; not the harness, which names `runs_dir` itself)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if f"{runs_dir}{os.sep}" in cmdline.read_text(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


def test_sigterm_to_the_harness_stops_its_running_step(tmp_path) -> None:
    # `timeout` and schedulers signal the harness's group; the step runs in a session of its
    # own, so it would otherwise go on training (on a GPU: under the next call's measurements).
    runs = tmp_path / "runs"
    endless = "extra=['wandb.mode=disabled','train.max_steps=1000000']"
    command = [python(), "scripts/ablate.py", "ladder=quick", f"out_dir={tmp_path / 'results'}",
               f"runs_dir={runs}", endless]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 120
    while not _processes_of(runs) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert _processes_of(runs), "the harness's first step never started"
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert not _processes_of(runs), f"the step outlived its harness:\n{out[-3000:]}"


@pytest.mark.slow
def test_quick_ladder_publishes_and_survives_failed_steps(tmp_path) -> None:
    _harness(
        tmp_path,
        "ladder.cumulative=false",  # so that the injected failures stay in their own steps
        "ladder.steps.2.overrides=['model.n_embd=4000000','model.n_head=1']",  # 0.8 TB of embedding
        "+ladder.steps.3.overrides=['model.n_head=3']",  # 128 wide is not divisible by 3 heads
    )
    folder = tmp_path / "results" / ladder_results.slug(ablate.device_name())
    result = json.loads((folder / "quick.json").read_text())
    statuses = [row["status"] for row in result["steps"]]
    assert statuses == ["ok", "ok", "oom", "failed", "ok", "ok"]
    ok = [row for row in result["steps"] if row["status"] == "ok"]
    assert all(row["tokens_per_sec"] > 0 and row["measured_steps"] == 12 for row in ok)
    assert "must be divisible by model.n_head=3" in result["steps"][3]["error"]
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
    # The rerun step ran again, in the new ladder's folder (its wall time, rounded to 0.1 s, may
    # well be the same); the other rows are the first run's.
    assert again[1]["command"] != result["steps"][1]["command"] and again[0] == result["steps"][0]


def test_multi_process_steps_and_base_stages() -> None:
    plans = {p["name"]: p for p in ladders.step_plans(ladders.read("scaling"))}
    base = ["non_blocking", "compile", "amp", "fused", "tf32"]
    assert plans["one_gpu"]["stages"] == base and plans["fsdp"]["stages"] == [*base, "fsdp"]
    assert (plans["two_nodes"]["gpus"], plans["two_nodes"]["nnodes"]) == (2, 2)
    strategies = {name: p["strategy"] for name, p in plans.items()}
    assert strategies["one_gpu"] == "single" and strategies["two_nodes"] == "ddp"
    assert strategies["fsdp_pure"] == "fsdp"
    # Model-level parallelism: the model split, at equal tokens a step
    assert strategies["xl_pp4"] == "pp" and strategies["b4_tp2_fsdp2"] == "tp x fsdp"
    assert strategies["b4_pp2_tp2"] == "pp x tp" and plans["b4_pp2_tp2"]["gpus"] == 4
    assert plans["b4_tp4"]["overrides"] == [
        "model=gpt2-4b",
        "train.lr=1.6e-4",
        "train.min_lr=1.6e-5",
        "train.batch_size=16",
        "opt.tp.degree=4",
    ]
    speed = ladders.step_plans(ladders.read("speed"))
    assert [(p["name"], p["gpus"]) for p in speed[-2:]] == [("ddp", 2), ("multi_node", 2)]


def test_memory_xl_rows_drop_what_cannot_combine_and_keep_16k_tokens() -> None:
    """Every row of the memory_xl ladder is a valid combination of stages (opt.check refuses the
    others), the reference row is the issue's [amp,fused,ac], and the 16 x 1024 workload holds
    except in the largest-micro-batch rows."""
    import torch

    import opt
    from base.distributed import Distributed
    from helpers import make_cfg

    ladder = ladders.read("memory_xl")
    plans = {p["name"]: p for p in ladders.step_plans(ladder)}
    assert ladder.reference == "ac" and plans["ac"]["stages"] == ["amp", "fused", "ac"]
    assert "opt_in_backward" not in plans["offload"]["stages"]
    assert {"offload", "fused"}.isdisjoint(plans["lowbit"]["stages"])
    assert "opt_in_backward" in plans["lowbit"]["stages"]
    one_process = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    for name, plan in plans.items():
        stages = [f"+opt=[{','.join(plan['stages'])}]"] if plan["stages"] else []
        cfg = make_cfg(*ladder.workload, *stages, *plan["overrides"])
        assert opt.plan(cfg, one_process).stages == [s for s in opt.ORDER if s in plan["stages"]]
        tokens = cfg.train.batch_size * cfg.model.block_size
        assert (tokens == 16 * 1024) != name.startswith("bs"), name


def test_a_reference_row_is_compared_in_memory_and_speed() -> None:
    ladder = OmegaConf.create(
        {"name": "x", "focus": "memory", "cumulative": True, "reference": "ac"}
    )
    rows = [
        {"index": 0, "name": "fp32", "what": "", "status": "oom"},
        {"index": 1, "name": "ac", "what": "", "status": "ok", "tokens_per_sec": 1000.0,
         "peak_allocated_gib": 30.0},
        {"index": 2, "name": "small", "what": "", "status": "ok", "tokens_per_sec": 800.0,
         "peak_allocated_gib": 15.0},
    ]  # fmt: skip
    rows = [{**row, "command": ""} for row in rows]
    table = ladder_table.markdown(ladder, rows, {"device": "GPU"})
    assert "| peak memory vs `ac` | tokens/s vs `ac` |" in table
    assert "| -50% | -50% | 0.80x |" in table  # vs prev, vs ac (memory), vs ac (tokens/s)


def test_the_attention_kernel_that_ran_shows_where_the_rows_differ() -> None:
    ladder = OmegaConf.create({"name": "x", "focus": "speed", "cumulative": False})
    flash, math = (
        "flash: pytorch_flash::flash_fwd_kernel",
        "math: aten::_scaled_dot_product_attention_math",
    )
    rows = [
        {"index": i, "name": n, "what": "", "status": "ok", "command": "",
         "tokens_per_sec": 1000.0, "attention_kernel": kernel}
        for i, (n, kernel) in enumerate([("a", flash), ("b", math)])
    ]  # fmt: skip
    table = ladder_table.markdown(ladder, rows, {"device": "GPU"})
    assert "| attention kernel |" in table
    assert "| flash: `pytorch_flash::flash_fwd_kernel` |" in table
    assert "math: `aten::_scaled_dot_product_attention_math` |" in table
    same = [{**row, "attention_kernel": flash} for row in rows]
    assert "attention kernel" not in ladder_table.markdown(ladder, same, {"device": "GPU"})


def test_a_step_may_drop_earlier_stages_and_their_knobs() -> None:
    ladder = OmegaConf.create({"cumulative": True, "steps": [
        {"name": "a", "opt": ["amp", "fused"]},
        {"name": "b", "opt": ["lowbit"], "drop": ["fused"], "overrides": ["opt.lowbit.bits=4"]},
        {"name": "c", "opt": ["ac"]},
        {"name": "d", "opt": ["fused"], "drop": ["lowbit"]},
    ]})  # fmt: skip
    plans = ladders.step_plans(ladder)
    assert [p["stages"] for p in plans] == [
        ["amp", "fused"], ["amp", "lowbit"], ["amp", "lowbit", "ac"], ["amp", "ac", "fused"]
    ]  # fmt: skip
    assert [p["overrides"] for p in plans] == [[], *[["opt.lowbit.bits=4"]] * 2, []]


def test_two_machines_are_two_agents_with_their_gpus(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(runner, "visible_gpus", lambda: ["4", "5", "6", "7"])
    plan = {**ladders.step_plans(ladders.read("scaling"))[2], "nproc": 2, "gpus": 4}
    agents = runner.launches(plan, ladders.read("scaling"), [], tmp_path)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in agents] == ["4,5", "6,7"]
    assert all(env["NCCL_NVLS_ENABLE"] == "0" for _, env in agents)
    (first, _), (second, _) = agents
    assert first == second  # the same command on every "machine": c10d assigns node ranks
    assert "--nnodes=2" in first and "--rdzv_backend=c10d" in first
    assert any(arg.startswith("--rdzv_endpoint=127.0.0.1:") for arg in first)


def test_a_steps_environment_reaches_its_processes_and_that_step_only(tmp_path) -> None:
    ladder = OmegaConf.create({"name": "t", "cumulative": True, "workload": [], "steps": [
        {"name": "one", "env": {"NCCL_PROTO": "Simple"}},
        {"name": "two", "nproc": 2, "env": {"NCCL_MAX_NCHANNELS": 4}},
        {"name": "plain", "nproc": 2},
    ]})  # fmt: skip
    plans = ladders.step_plans(ladder)
    envs = [[env for _, env in runner.launches(p, ladder, [], tmp_path)] for p in plans]
    assert envs[0] == [{"NCCL_PROTO": "Simple"}]
    assert envs[1] == [{"NCCL_NVLS_ENABLE": "0", "NCCL_MAX_NCHANNELS": "4"}]
    assert envs[2] == [{"NCCL_NVLS_ENABLE": "0"}]
    command = runner.shell(*runner.launches(plans[1], ladder, [], tmp_path)[0])
    assert command.startswith("NCCL_NVLS_ENABLE=0 NCCL_MAX_NCHANNELS=4 ")


def test_per_gpu_efficiency_is_against_the_nearest_one_gpu_row() -> None:
    rows = [
        {"name": "a", "gpus": 1, "status": "ok", "tokens_per_sec": 100.0},
        {"name": "ddp", "gpus": 2, "status": "ok", "tokens_per_sec": 190.0},
        {"name": "b", "gpus": 1, "status": "failed", "tokens_per_sec": None},
        {"name": "c", "gpus": 1, "status": "ok", "tokens_per_sec": 200.0},
        {"name": "fsdp", "gpus": 2, "status": "ok", "tokens_per_sec": 300.0},
        {"name": "oom", "gpus": 2, "status": "oom", "tokens_per_sec": None},
        # Another workload whose 1-GPU row does not fit: "c" is no reference for it.
        {"name": "big", "gpus": 1, "status": "oom", "tokens_per_sec": None},
        {"name": "big_tp", "gpus": 2, "status": "ok", "tokens_per_sec": 50.0},
    ]
    done = stats.with_efficiency(rows)
    assert [r["efficiency"] for r in done] == [1.0, 0.95, None, 1.0, 0.75, None, None, None]
    assert [r["efficiency_vs"] for r in done] == ["a", "a", None, "c", "c", None, None, None]


def test_the_baseline_row_is_not_compared_with_itself() -> None:
    ladder = OmegaConf.create({"name": "scaling", "cumulative": False})
    rows = [
        {
            "index": 0,
            "name": "one_gpu",
            "status": "ok",
            "tokens_per_sec_runs": [100.0, 101.0],
            "call": "c",
        },
        {
            "index": 1,
            "name": "ddp",
            "status": "ok",
            "tokens_per_sec_runs": [190.0, 194.0],
            "call": "c",
        },
    ]
    done = stats.with_ratios(ladder, rows)
    assert done[0]["ratio"] is None and done[0]["within_noise"] is None
    assert done[1]["ratio"] == pytest.approx(1.9104, abs=1e-4) and done[1]["ratio_vs"] == "one_gpu"


def test_a_later_calls_efficiency_is_against_that_calls_own_one_gpu_run() -> None:
    """Rows of a later call (a segment anchored on the 1-GPU step) divide by the anchor that ran
    beside them, not by the 1-GPU row of another call; without such an anchor, by the row."""
    rows = [
        {"name": "one_gpu", "gpus": 1, "status": "ok", "tokens_per_sec": 100.0, "call": "c1"},
        {"name": "ddp", "gpus": 2, "status": "ok", "tokens_per_sec": 190.0, "call": "c1"},
        {"name": "ddp4", "gpus": 4, "status": "ok", "tokens_per_sec": 400.0, "call": "c2"},
        {"name": "fsdp4", "gpus": 4, "status": "ok", "tokens_per_sec": 360.0, "call": "c3"},
    ]
    anchor = {"name": "one_gpu", "status": "ok", "tokens_per_sec": 125.0, "call": "c2"}
    segments: list[dict] = [{"call": "c1", "anchor": None}, {"call": "c2", "anchor": anchor}]
    done = stats.with_efficiency(rows, segments)
    assert [r["efficiency"] for r in done] == [1.0, 0.95, 0.8, 0.9]
    assert {r["efficiency_vs"] for r in done} == {"one_gpu"}
    # c3 had no anchor: its ratio is against c1's machine, and its cell says so
    assert [r["efficiency_across_calls"] for r in done] == [False, False, False, True]
    cells = [ladder_table.efficiency_cell(r) for r in done]
    assert cells == ["1.000", "0.950", "0.800", "0.900 (across calls)"]


def _run_steps(tmp_path, steps: list[dict], timeout_s: int = 600) -> tuple[list[dict], Path]:
    """Runs steps on the quick ladder's workload with the harness; returns the rows and the
    folder they were published to."""
    cfg = ladders.config(
        ["ladder=quick", f"timeout_s={timeout_s}", "extra=['wandb.mode=disabled']"]
    )
    ladder = OmegaConf.merge(cfg.ladder, {"cumulative": False, "steps": steps})
    assert isinstance(ladder, DictConfig)
    rows = [
        runner.run_step(plan, ladder, cfg, tmp_path / "runs") for plan in ladders.step_plans(ladder)
    ]
    ladder_results.publish(ladder, rows, ablate.environment([]), tmp_path / "results")
    return rows, tmp_path / "results"


@pytest.mark.slow
@pytest.mark.distributed
def test_scaling_rows_on_cpu_processes(tmp_path) -> None:
    rows, results = _run_steps(
        tmp_path,
        [
            {"name": "one", "what": "1 process"},
            {"name": "ddp", "what": "2 processes", "nproc": 2},
            {"name": "two_nodes", "what": "2 x 1", "nproc": 1, "nnodes": 2},
        ],
    )
    assert [r["status"] for r in rows] == ["ok", "ok", "ok"], [r.get("error") for r in rows]
    assert [r["gpus"] for r in rows] == [1, 2, 2]
    assert rows[1]["efficiency"] > 0 and rows[2]["efficiency_vs"] == "one"
    table = (results / "quick.md").read_text()
    assert "per-GPU efficiency" in table and "| 2 x 1 |" in table
    saved = json.loads((results / "quick.json").read_text())["steps"]
    assert all({"gpus", "strategy", "tokens_per_sec", "efficiency"} <= row.keys() for row in saved)
    assert "& " in rows[2]["command"] and "--rdzv_backend=c10d" in rows[2]["command"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_timed_out_step_leaves_no_process_behind(tmp_path) -> None:
    step = {"name": "endless", "what": "never ends", "nproc": 2,
            "overrides": ["train.max_steps=1000000"]}  # fmt: skip
    started = time.time()
    rows, _ = _run_steps(tmp_path, [step], timeout_s=25)
    assert rows[0]["status"] == "timeout" and time.time() - started < 90
    left = _processes_of(tmp_path / "runs")
    assert not left, f"processes of the timed-out step still running: {left}"


def test_a_failed_step_is_reported_by_its_exception_not_by_what_follows_it() -> None:
    output = "\n".join([
        "Error executing job with overrides: ['model=gpt2-xl']",
        "Traceback (most recent call last):",
        '  File "train.py", line 1, in <module>',
        "    raise torch.OutOfMemoryError(...)",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.28 GiB.",
        "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.",
        "\x1b[1;34mwandb\x1b[0m: You can sync this run to the cloud by running:",
        "\x1b[1;34mwandb\x1b[0m: Find logs at: outputs/run/wandb/logs",
    ])  # fmt: skip
    assert runner.failure_reason(output) == (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.28 GiB."
    )
    assert runner.failure_reason("one\n\nKilled\n") == "one | Killed"  # no exception named


def _results_with(**changes: object) -> str:
    """The shipped memory_xl results json with some of its top-level keys changed."""
    result = json.loads((ROOT / "docs/results/nvidia-h100-80gb-hbm3/memory_xl.json").read_text())
    return json.dumps({**result, **changes})


@pytest.mark.parametrize(
    ("content", "line"),
    [
        ('{"steps": [{"name": "baseline", "sta', r"not JSON \(Unterminated string"),
        ('[{"name": "baseline"}]', r"the file is not an object"),
        (_results_with(environment={"gpus": 1}), r"environment has no 'device'"),
        (_results_with(steps=[{"name": "baseline", "what": ""}]), r"steps\[0\] has no 'status'"),
        (
            _results_with(steps=[{"name": "x", "what": "", "status": "ok", "mfu": "40%"}]),
            r"steps\[0\].mfu is not a number",
        ),
    ],
    ids=["not JSON", "not an object", "no device", "a row without status", "a text number"],
)
def test_a_malformed_report_is_refused_in_one_line(tmp_path, capsys, content, line) -> None:
    """`report=` of a results json that ablate.py did not write: one line naming the file and
    what is wrong, exit 2, no chart."""
    from base import errors

    results = tmp_path / "memory_xl.json"
    results.write_text(content)
    with pytest.raises(errors.ReportedExit) as exit_:
        errors.main(lambda: ablate.main([f"report={results}"]))
    assert exit_.value.code == 2
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert re.match(rf"^\S+: error: {results}: {line}.*; give report= a <ladder>.json", said), said
    assert not results.with_suffix(".png").exists()


def test_a_step_with_vs_compares_with_that_step_and_a_segment_from_it_anchors_there() -> None:
    ladder = OmegaConf.create({"name": "levers", "focus": "speed", "cumulative": False, "steps": [
        {"name": "plain"}, {"name": "tuned"}, {"name": "lever", "vs": "tuned"},
    ]})  # fmt: skip
    assert [p.get("vs") for p in ladders.step_plans(ladder)] == [None, None, "tuned"]
    rows = [
        {"index": i, "name": n, "what": "", "status": "ok", "command": "", "call": "c",
         "tokens_per_sec_runs": runs, "tokens_per_sec": runs[0], "repeats": 2}
        for i, (n, runs) in enumerate(
            [("plain", [100.0, 100.0]), ("tuned", [110.0, 110.0]), ("lever", [121.0, 132.0])]
        )
    ]  # fmt: skip
    done = stats.with_ratios(ladder, rows)
    assert done[1]["ratio_vs"] == "plain" and done[1]["ratio"] == pytest.approx(1.1)
    assert done[2]["ratio_vs"] == "tuned" and done[2]["ratio_interval"] == [1.1, 1.2]
    table = ladder_table.markdown(ladder, done, {"device": "GPU"})
    assert "| 1.150x (1.100–1.200) vs `tuned` |" in table
    assert "| 1.100x (1.100–1.100) |" in table  # the tuned row: against the baseline, unmarked
    cfg = ladders.config(["ladder=float8_xl", "steps=[tensorwise_cd]"])
    _, anchor = ladders.selection(cfg, ladders.step_plans(cfg.ladder))
    assert anchor is not None and anchor["name"] == "bf16_cd"  # not the baseline, bf16


def test_a_vs_that_is_not_a_step_above_is_refused_in_one_line() -> None:
    for vs in ("later", "nope", "self"):
        ladder = OmegaConf.create({"name": "bad", "cumulative": False, "steps": [
            {"name": "a"}, {"name": "self", "vs": vs}, {"name": "later"},
        ]})  # fmt: skip
        with pytest.raises(ConfigError, match=f"step self has vs={vs}, which is not a step above"):
            ladders.step_plans(ladder)
