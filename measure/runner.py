"""Running a ladder's step: the command lines of its processes (one, a torchrun, or several
torchrun agents meeting at a rendezvous), the processes run to their end or their timeout and
then stopped with all their descendants, and the run's row read from its summary.json, metrics
and output (the status, the numbers, what went wrong)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from base.signals import sigterm_raises
from launch.provenance import git_commit
from launch.torchrun import descendants, torchrun
from measure import ladder_profile, stats

ROOT = Path(__file__).resolve().parents[1]  # where train.py runs
OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|not enough memory|Cannot allocate memory")


def launches(
    plan: dict, ladder: DictConfig, extra: list[str], run_dir: Path
) -> list[tuple[list[str], dict[str, str]]]:
    """The processes that run a step: a command and the environment it adds, per torchrun agent
    (one per "machine") or for the single process."""
    stages = [f"+opt=[{','.join(plan['stages'])}]"] if plan["stages"] else []
    args = [
        "train.py",
        *ladder.workload,
        *stages,
        *plan["overrides"],
        *([f"perf.memory_cap_gib={cap}"] if (cap := plan.get("memory_cap_gib")) else []),
        *extra,
        f"hydra.run.dir={run_dir}",
        f"wandb.group=ladder-{ladder.name}",
        f"wandb.name={ladder.name}-{run_dir.name}",  # <index>-<step>[-r<repeat>]
    ]
    nproc, nnodes = plan["nproc"], plan["nnodes"]
    step_env = plan.get("env", {})  # the step's own variables (NCCL's tuning, say)
    if plan["gpus"] == 1:
        return [([sys.executable, *args], dict(step_env))]
    # NVLink multicast (NVLS) off: some lent machines require it, and every multi-GPU row of a
    # ladder then runs the same NCCL algorithms (unless the step says otherwise).
    env = {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"), **step_env}
    if nnodes == 1:
        return [([*torchrun(nproc), *args], env)]
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    agent = torchrun(nproc, nnodes, endpoint, rdzv_id=f"{ladder.name}-{plan['name']}")
    gpus = visible_gpus()
    return [
        (
            [*agent, *args],
            {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus[node * nproc : (node + 1) * nproc])}
            if gpus
            else env,
        )
        for node in range(nnodes)
    ]


def visible_gpus() -> list[str]:
    """This host's GPUs as CUDA_VISIBLE_DEVICES names them (none on a CPU machine)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g for g in listed.split(",") if g][: torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def shell(command: list[str], env: dict[str, str]) -> str:
    """A command as one would type it (`python` for this interpreter)."""
    prefix = [f"{k}={v}" for k, v in env.items()]
    return shlex.join([*prefix, "python", *command[1:]])


def run_step(
    plan: dict, ladder: DictConfig, cfg: DictConfig, runs_dir: Path, repeat: int | None = None
) -> dict[str, Any]:
    """Runs a step (one of its repeats: `repeat`, its own run folder) in its own process(es);
    returns that run's row (status and numbers). A failure of the harness itself while running
    it is the run's failure too: the ladder goes on with the next step."""
    suffix = "" if repeat is None else f"-r{repeat}"
    run_dir = runs_dir / f"{plan['index']:02d}-{plan['name']}{suffix}"
    agents = launches(plan, ladder, list(cfg.extra), run_dir)
    row = {
        **plan,
        "command": " & ".join(shell(command, env) for command, env in agents),
        "git_commit": git_commit(),
        "repeat": repeat or 0,
    }
    gpus = torch.cuda.device_count()  # with none, several processes share the CPU (gloo)
    if 0 < gpus < plan["gpus"]:
        return {**row, "status": "skipped", "error": f"needs {plan['gpus']} GPUs, {gpus} here"}
    print(
        f"[ablate] {ladder.name} {plan['index']:02d} {plan['name']}"
        + ("" if repeat is None else f" (repeat {repeat})")
        + f": {row['command']}",
        flush=True,
    )
    started = time.time()
    try:
        status, output, summary = launch(agents, run_dir, cfg.timeout_s)
    except Exception as e:  # noqa: BLE001 -- recorded as the step's failure, the ladder goes on
        status, output, summary = "failed", f"ablate.py: {type(e).__name__}: {e}", {}
    row["wall_s"] = round(time.time() - started, 1)
    row.update({column: summary_value(summary, column, key) for column, key in stats.NUMBERS})
    row["attention_kernel"] = summary.get("attention_kernel")  # what computed attention (a name)
    row["loss_rise"] = loss_rise(run_dir / "metrics.jsonl")
    if status != "ok":
        row["error"] = failure_reason(output)
    rise = row["loss_rise"]
    warning = (
        f" (diverged: its loss ended {rise:.0%} above its lowest)" if stats.diverged(rise) else ""
    )
    print(f"[ablate]   -> {status}, {row['wall_s']} s{warning}", flush=True)
    return {**row, "status": status}


def loss_rise(metrics_path: Path) -> float | None:
    """How far a run's last logged training loss ends above its lowest logged one (0.33: 33%
    above), from its metrics.jsonl; None without two logged losses (or without the file)."""
    if not metrics_path.exists():
        return None
    losses = []
    for line in metrics_path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut by a killed run
            if (loss := json.loads(line).get("train/loss")) is not None:
                losses.append(loss)
    if len(losses) < 2 or min(losses) <= 0:
        return None
    return round(losses[-1] / min(losses) - 1, 4)


def profile_step(plan: dict, ladder: DictConfig, cfg: DictConfig, runs_dir: Path) -> dict:
    """One more, short run of a step under the profiler, after its timed runs (why apart:
    scripts/ladder_profile.py); returns what its row gains: `families_ms` and `profile`, or
    `profile`'s status and error when the run or its trace failed (the ladder goes on)."""
    run_dir = runs_dir / f"{plan['index']:02d}-{plan['name']}-profile"
    extra = [*cfg.extra, *ladder_profile.overrides(cfg.profile_wait)]
    agents = launches(plan, ladder, extra, run_dir)
    print(f"[ablate] profiling {plan['name']}: {shell(*agents[0])}", flush=True)
    try:
        status, output, _ = launch(agents, run_dir, cfg.timeout_s)
        if status != "ok":
            return {"profile": {"status": status, "error": failure_reason(output)}}
        return ladder_profile.families(run_dir / "trace.json")
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the row keeps its timed numbers
        return {"profile": {"status": "failed", "error": f"ablate.py: {type(e).__name__}: {e}"}}


def launch(
    agents: list[tuple[list[str], dict[str, str]]],
    run_dir: Path,
    timeout_s: float,
    cwd: Path = ROOT,
) -> tuple[str, str, dict]:
    """Runs a step's processes (from `cwd`) to their end (or its timeout): its status (ok, oom,
    failed, timeout), its output and the run's summary.json (empty when it wrote none)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    logs = [
        run_dir / ("output.txt" if i == 0 else f"output-node{i}.txt") for i in range(len(agents))
    ]
    procs: list[subprocess.Popen] = []
    # The step's processes run in sessions of their own, out of reach of the signals sent to
    # this one's group: a SIGTERM to the harness (`timeout`, a scheduler) or Ctrl-C stops them
    # here, or they would go on holding the GPU under the next call's measurements.
    with sigterm_raises():
        try:
            for (command, env), log in zip(agents, logs, strict=True):
                with open(log, "w") as out:
                    procs.append(
                        subprocess.Popen(
                            command,
                            cwd=cwd,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True,  # its own process group: killable as a whole
                        )  # fmt: skip
                    )
            timed_out = not wait_all(procs, deadline=started + timeout_s)
        finally:
            stop(procs)
    output = "".join(log.read_text(errors="replace") for log in logs)
    if timed_out:
        status = "timeout"
    elif any(p.returncode for p in procs):
        status = "oom" if OOM.search(output) else "failed"
    else:
        status = "ok"
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return status, output, summary


def summary_value(summary: dict, column: str, key: str) -> Any:
    """A number of the run's summary: under its key, else under any namespace with the column's
    name (`perf/goodput` or `time/goodput`), else None (a trainer that does not report it)."""
    if key in summary:
        return summary[key]
    return next((v for k, v in summary.items() if k.rsplit("/", 1)[-1] == column), None)


ANSI = re.compile(r"\x1b\[[0-9;]*m")
# An exception's last traceback line, or a one-line error (base/errors.py: `<program>: error:`).
RAISED = re.compile(r"^[\w.]*(Error|Exception)\b|^[\w.]+: error: |CUDA out of memory")
# Hydra's own errors (an unknown config, a bad override) name no exception: its message is the
# block from "Could not ..." up to the search path or its HYDRA_FULL_ERROR hint.
HYDRA_CAUSE = re.compile(r"^(In '[^']*': )?Could not ")
HYDRA_END = re.compile(r"^(Config search path:|Available options|Set the environment variable)")


def failure_reason(output: str) -> str:
    """What a failed step's output says went wrong: the last line naming an exception (wandb
    prints its sync hints after the traceback), else Hydra's message, else the last three
    lines."""
    lines = [ANSI.sub("", line).strip() for line in output.splitlines()]
    raised = [line for line in lines if RAISED.search(line)]
    cause = next((i for i, line in enumerate(lines) if HYDRA_CAUSE.search(line)), None)
    if raised:
        reason = raised[-1]
    elif cause is not None:
        block = []
        for line in lines[cause:]:
            if HYDRA_END.search(line):
                break
            block += [line] if line else []
        reason = " | ".join(block)
    else:
        reason = " | ".join([line for line in lines if line][-3:])
    return reason if len(reason) <= 600 else reason[:599] + "…"


def wait_all(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Waits for the step's processes; False on a timeout. It returns as soon as one fails: the
    others are stopped then (an agent whose peer died would wait for it in the rendezvous)."""
    while any(p.poll() is None for p in procs):
        if time.time() > deadline:
            return False
        if any(p.returncode for p in procs):
            return True
        time.sleep(0.5)
    return True


def stop(procs: list[subprocess.Popen], grace_s: float = 20) -> None:
    """SIGTERM first (torchrun passes it to its workers, the trainer checkpoints and exits),
    then SIGKILL for every process of the step still alive after `grace_s`, with all its
    descendants: torchrun's workers run in sessions of their own, so they do not die with the
    agent."""
    running = [p for p in procs if p.poll() is None]
    if not running:
        return
    tree = [pid for p in running for pid in (p.pid, *descendants(p.pid))]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    end = time.time() + grace_s
    while any(p.poll() is None for p in running) and time.time() < end:
        time.sleep(0.5)
    for pid in tree:  # the agents' groups and each worker's own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) != os.getpgrp():
                os.killpg(os.getpgid(pid), signal.SIGKILL)
    for p in running:
        p.wait()
