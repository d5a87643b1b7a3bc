"""Runs an ablation ladder and publishes its results: one command per ladder.

    python scripts/ablate.py ladder=speed           # the book's speed ladder, then beyond
    python scripts/ablate.py ladder=memory          # the book's memory ladder
    python scripts/ablate.py ladder=quick           # a CPU-sized ladder, for trying the harness
                                                    # (the others measure GPUs: refused without one)
    python scripts/ablate.py ladder=speed 'steps=[compile,amp_fp16]' "extra=['+prof=trace']"
    python scripts/ablate.py ladder=speed repeats=5 'steps=[custom_op]'  # anchored on memmap
    python scripts/ablate.py ladder=speed profile=true  # + each row's time by kernel family
    python scripts/ablate.py report=docs/results/<gpu>/memory_xl.json   # redraw its chart only

A ladder (`conf/ablate/ladder/<name>.yaml`) is a workload (overrides and stages every step runs
with) and a list of steps; each step adds stages (`+opt=...`) and overrides to the ones before it
(or, with `cumulative: false`, to the workload alone), and may `drop` stages that earlier steps
added (a stage that cannot combine with a later one). Every step runs `train.py` in its own
process, so allocator and compiler state start clean; a step that runs out of memory, fails or
times out is recorded as such (a timed-out step is killed with all its processes) and the ladder
goes on.

A step may run on several GPUs: `nproc: N` processes under torchrun, and with `nnodes: M` as M
"machines" of N GPUs each on this host (M torchrun agents meeting at a c10d rendezvous on
127.0.0.1, the GPUs split between them with CUDA_VISIBLE_DEVICES). Its row carries `gpus` and a
per-GPU `efficiency`: tokens/s / (gpus x tokens/s of the nearest 1-GPU row above it).

A step may set `memory_cap_gib: X` (that step only, not carried to the next): its train.py runs
with `perf.memory_cap_gib=X`, allowed X GiB of the GPU as a card of that size would allow, and
a run that needs more fails as out of memory; the row records the cap.

Repeats: each step runs `repeats` times (3 on a GPU, 1 on a CPU, unless the ladder or the command
line says), interleaved A B C A B C so that drift touches every row alike; a row is the median of
its runs with their min–max (and a bootstrap 95% CI of the median from 3 runs), and its tokens/s
ratio to the row it is compared with pairs run i with run i; a ratio whose range includes 1.00x
is `within_noise`. `steps=[...]` runs a segment of the ladder; unless it starts at step 0 the
step its first row is compared with (or `anchor=<step>`) runs beside it, so that its ratios come
from one call, and its measurement is kept in the json's `segments`.

Profile: with `profile=true` (or `profile: true` in the ladder) every step runs once more after
the timed runs, briefly, under the profiler; its row gains `families_ms`, the step's time by
kernel family, and the table the change of each family against the row before
(scripts/ladder_profile.py).

Results: `<out_dir>/<device>/<ladder>.{json,csv,md,png}` (`outputs/ablate/results/`, untracked;
`publish=true` writes them into `docs/results/<device>/`, the shipped ones), with the command, the
git commit, the GPU, the driver and the library versions; rerunning some steps updates their
rows. The table compares each row with step 0, or with the row named by the ladder's `reference`
(the memory_xl ladder's target is relative to its `ac` row), in memory and in tokens/s; it is
printed at the end.
A failing step, or a results file that cannot be written (its error is in the json's
`report_errors`), never stops the steps after it.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ladder_profile  # a sibling script: its folder is first on sys.path
import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import recipe.errors
from launch.provenance import device_name, environment, git_commit
from launch.torchrun import descendants, torchrun
from recipe.files import read_json

ROOT = Path(__file__).resolve().parents[1]
# The harness's own config, apart from conf/'s groups: train.py's search path does not see it.
CONF = ROOT / "conf" / "ablate"
PUBLISHED = ROOT / "docs" / "results"  # the shipped results: written only with publish=true

OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|not enough memory|Cannot allocate memory")
# The per-step numbers, from the run's summary.json: (column, summary key).
NUMBERS = (
    ("tokens_per_sec", "perf/tokens_per_sec"),
    ("tokens_per_sec_p10", "perf/tokens_per_sec_p10"),
    ("tokens_per_sec_p90", "perf/tokens_per_sec_p90"),
    ("mfu", "perf/mfu"),
    ("step_ms", "perf/step_ms"),
    ("peak_allocated_gib", "mem/peak_allocated_gib"),
    ("peak_reserved_gib", "mem/peak_reserved_gib"),
    ("train_loss", "train/loss"),
    ("val_loss", "val/loss"),
    ("measured_steps", "perf/measured_steps"),
    # Cold start, goodput, and over the measured steps: input waits, energy and the GPU's busy
    # share (null where the trainer does not report them). Not perf/data_wait_ms and the like:
    # those are the last log window's.
    ("first_step_s", "first_step_s"),
    ("compile_s", "compile_s"),
    ("goodput", "goodput"),
    ("data_wait_ms", "data_wait_ms"),
    ("joules_per_token", "joules_per_token"),
    ("gpu_busy", "gpu_busy"),
)
# A run diverged when its last logged training loss ends this far above its lowest: its tokens/s
# then time a broken model, not the step (on an H100, bf16 runs that diverged ran 5.5% faster
# than converged runs of the same command: docs/results/.../speed_bf16_cache.md).
DIVERGED = 0.10


def diverged(rise: float | None) -> bool:
    """Whether a run's `loss_rise` (see loss_rise) says it diverged."""
    return rise is not None and rise > DIVERGED


def strategy(stages: list[str], gpus: int) -> str:
    """How a step spreads over its GPUs: the model-splitting and sharding stages it runs
    ("pp x tp x fsdp"), else "ddp" on several GPUs (the default there), "single" on one."""
    spread = [s for s in ("pp", "tp", "fsdp") if s in stages]
    return " x ".join(spread) if spread else "ddp" if gpus > 1 else "single"


def step_plans(ladder: DictConfig) -> list[dict[str, Any]]:
    """What each step runs: its stages and overrides (after the workload's), accumulated when the
    ladder is cumulative, less the stages it drops (and their knobs), and its processes."""
    base = list(ladder.get("opt", []))
    overrides: list[str]
    plans, stages, overrides = [], base, []
    for index, step in enumerate(ladder.steps):
        if not ladder.cumulative:
            stages, overrides = base, []
        stages = stages + [s for s in step.get("opt", []) if s not in stages]
        dropped = step.get("drop", [])
        stages = [s for s in stages if s not in dropped]
        # A dropped stage's knobs go with it (its config group is no longer composed).
        overrides = [o for o in overrides if not o.startswith(tuple(f"opt.{d}." for d in dropped))]
        overrides = overrides + list(step.get("overrides", []))
        nproc, nnodes = step.get("nproc", 1), step.get("nnodes", 1)
        cap = step.get("memory_cap_gib")  # this step's only
        plans.append(
            {
                "index": index,
                "name": step.name,
                "what": step.get("what", ""),
                "stages": stages,
                "overrides": overrides,
                "nproc": nproc,
                "nnodes": nnodes,
                "gpus": nproc * nnodes,
                "strategy": strategy(stages, nproc * nnodes),
                **({"memory_cap_gib": cap} if cap else {}),
            }
        )
    return plans


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
    if plan["gpus"] == 1:
        return [([sys.executable, *args], {})]
    # NVLink multicast (NVLS) off: some lent machines require it, and every multi-GPU row of a
    # ladder then runs the same NCCL algorithms.
    env = {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
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
    row.update({column: summary_value(summary, column, key) for column, key in NUMBERS})
    row["loss_rise"] = loss_rise(run_dir / "metrics.jsonl")
    if status != "ok":
        row["error"] = failure_reason(output)
    rise = row["loss_rise"]
    warning = f" (diverged: its loss ended {rise:.0%} above its lowest)" if diverged(rise) else ""
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
    agents: list[tuple[list[str], dict[str, str]]], run_dir: Path, timeout_s: float
) -> tuple[str, str, dict]:
    """Runs a step's processes to their end (or its timeout): its status (ok, oom, failed,
    timeout), its output and the run's summary.json (empty when it wrote none)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    logs = [
        run_dir / ("output.txt" if i == 0 else f"output-node{i}.txt") for i in range(len(agents))
    ]
    procs = []
    for (command, env), log in zip(agents, logs, strict=True):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,  # its own process group: killable as a whole
                )  # fmt: skip
            )
    timed_out = not wait_all(procs, deadline=started + timeout_s)
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
# An exception's last traceback line, or a one-line error (recipe/errors.py: `<program>: error:`).
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
    """Waits for the step's processes; False on a timeout. When one fails the others are
    stopped (an agent whose peer died would wait for it in the rendezvous). Whatever is left
    is killed with all its descendants: torchrun's workers run in sessions of their own, so
    they do not die with the agent."""
    try:
        while any(p.poll() is None for p in procs):
            if time.time() > deadline:
                return False
            if any(p.returncode for p in procs):
                return True
            time.sleep(0.5)
        return True
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen], grace_s: float = 20) -> None:
    """SIGTERM first (torchrun passes it to its workers, the trainer checkpoints and exits),
    then SIGKILL for every process of the step still alive after `grace_s`."""
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


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ---- which steps run, how often, in what order


def selection(cfg: DictConfig, plans: list[dict]) -> tuple[list[dict], dict | None]:
    """The steps this call measures (ladder order) and its anchor: `anchor=<step>`, else, when
    the first of `steps=[...]` is not the ladder's first, the step its row is compared with, so
    that its ratio comes from this call too. Unknown or repeated names are refused up front."""
    ladder, names = cfg.ladder, [p["name"] for p in plans]
    where = f"ladder {ladder.name} (conf/ablate/ladder/{ladder.name}.yaml)"
    if repeated(names):
        raise recipe.errors.ConfigError(
            f"{where} names {repeated(names)} more than once; rename them"
        )
    wanted = list(cfg.steps) if cfg.steps else names
    if repeated(wanted):
        raise recipe.errors.ConfigError(f"steps={wanted} names {repeated(wanted)} more than once")
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise recipe.errors.ConfigError(f"steps {unknown} are not in {where}: {names}")
    chosen = [p for p in plans if p["name"] in wanted]
    if cfg.get("anchor"):
        if cfg.anchor not in names:
            raise recipe.errors.ConfigError(
                f"anchor={cfg.anchor} is not a step of {where}: {names}"
            )
        if cfg.anchor in wanted:
            raise recipe.errors.ConfigError(
                f"anchor={cfg.anchor} is one of steps={wanted}; drop it"
            )
        return chosen, plans[names.index(cfg.anchor)]
    first = chosen[0]["index"]
    if ladder.cumulative:
        candidate = plans[first - 1] if first > 0 else None
    else:
        reference = ladder.get("reference")
        candidate = plans[names.index(reference)] if reference else plans[0]
    return chosen, None if candidate is None or candidate["name"] in wanted else candidate


def check_device(cfg: DictConfig) -> None:
    """A ladder that measures a GPU's work (its workload does not say device=cpu), on a machine
    without a GPU: refused up front, naming the ladder sized for a CPU. A step would otherwise
    train its model on the CPU for hours, or until the kernel kills it for its memory."""
    ladder = cfg.ladder
    if torch.cuda.is_available() or "device=cpu" in [*ladder.workload, *cfg.extra]:
        return
    model = next((w for w in ladder.workload if w.startswith("model=")), "its model")
    raise recipe.errors.ConfigError(
        f"ladder={ladder.name} measures {model} on a GPU, and this machine has none: use "
        "ladder=quick, sized for a CPU (or \"extra=['device=cpu']\" to run this one anyway)"
    )


def repeated(names: list[str]) -> list[str]:
    return sorted({n for n in names if names.count(n) > 1})


def repeat_count(cfg: DictConfig, ladder: DictConfig) -> int:
    """How often each step runs: `repeats=N`, else the ladder's `repeats`, else 3 on a GPU (where
    a few percent decide a row) and 1 on a CPU (where the harness itself is what is tried)."""
    for value in (cfg.get("repeats"), ladder.get("repeats")):
        if value is not None:
            if not isinstance(value, int) or value < 1:
                raise recipe.errors.ConfigError(
                    f"repeats={value}: give a whole number of runs, >= 1"
                )
            return value
    return 3 if torch.cuda.is_available() else 1


def interleaved(plans: list[dict], repeats: int) -> list[tuple[int, dict]]:
    """(repeat, step) in running order, A B C A B C ...: a drift of the machine (clocks,
    temperature, a neighbour) then touches every step alike instead of the last ones."""
    return [(repeat, plan) for repeat in range(repeats) for plan in plans]


def _median(values: list) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def bootstrap_ci(values: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """A 95% confidence interval of the median (percentile bootstrap, seeded: reproducible)."""
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, size=(resamples, len(values))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return [float(low), float(high)]


def aggregate(runs: list[dict], call: str) -> dict[str, Any]:
    """A step's row from its runs: every number the median over the runs that completed, with
    tokens/s per run, their min–max `interval` and, from 3 runs, `ci95` (a bootstrap 95% CI of
    the median); the status and error of the first run that did not complete, if one did not."""
    done = [r for r in runs if r["status"] == "ok"]
    failed = next((r for r in runs if r["status"] != "ok"), None)
    row = {k: v for k, v in (failed or runs[0]).items() if k != "repeat"}
    for column in [*(c for c, _ in NUMBERS), "wall_s"]:
        row[column] = _median([r.get(column) for r in (done or runs)])
    tps = [r["tokens_per_sec"] for r in done if r.get("tokens_per_sec") is not None]
    rises = [r.get("loss_rise") for r in done]
    row.update(
        call=call,
        repeats=len(done),
        tokens_per_sec_runs=tps,
        train_loss_runs=[r.get("train_loss") for r in done],
        loss_rise=max((x for x in rises if x is not None), default=None),
        diverged_runs=sum(map(diverged, rises)),
        interval=[min(tps), max(tps)] if tps else None,
        ci95=bootstrap_ci(tps) if len(tps) >= 3 else None,
    )
    return row


def comparisons(
    ladder: DictConfig, rows: list[dict]
) -> list[tuple[dict, dict | None, dict | None]]:
    """Each row with the ones it is compared with: the last row above it that ran, and the
    baseline (the ladder's `reference` row, else step 0), None where there is none."""
    ok = [r for r in rows if r["status"] == "ok"]
    reference = ladder.get("reference")
    if reference:
        baseline = next((r for r in ok if r["name"] == reference), None)
    else:
        baseline = ok[0] if ok and ok[0].get("index") == 0 else None
    out: list[tuple[dict, dict | None, dict | None]] = []
    previous = None
    for row in rows:
        out.append((row, previous, baseline))
        if row["status"] == "ok":
            previous = row
    return out


def speed_ratio(row: dict, other: dict | None, anchors: dict[str, dict]) -> dict | None:
    """The row's tokens/s over the other's. Runs of one call pair up, repeat i with repeat i
    (they ran side by side): the ratio is the median of the per-repeat ratios, the interval
    their min–max; a row measured in another call is stood in for by this call's anchor when
    it is that step. Else the rows ran in different calls, perhaps on machines 2-5% apart
    (`across_calls`): the ratio of medians, with no interval and no verdict on noise, as one
    call's spread says nothing of another machine's. `within_noise`: the interval includes 1.00x
    (None with a single run: nothing to judge)."""
    if row["status"] != "ok" or not other or other["status"] != "ok":
        return None
    beside = measured_beside(row, other, anchors)
    mine, theirs = _runs(row), _runs(beside)
    if not mine or not theirs:
        return None
    if not same_call(row, beside):
        ratio = statistics.median(mine) / statistics.median(theirs)
        return {"vs": other["name"], "ratio": round(ratio, 4), "interval": None,
                "within_noise": None, "across_calls": True}  # fmt: skip
    if len(mine) == len(theirs):  # paired: run i of both ran side by side
        ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
        ratio, interval = statistics.median(ratios), [min(ratios), max(ratios)]
    else:
        ratio = statistics.median(mine) / statistics.median(theirs)
        interval = [min(mine) / max(theirs), max(mine) / min(theirs)]
    several = max(len(mine), len(theirs)) > 1
    return {
        "vs": other["name"],
        "ratio": round(ratio, 4),
        "interval": [round(v, 4) for v in interval],
        "within_noise": (interval[0] <= 1 <= interval[1]) if several else None,
        "across_calls": False,
    }


def measured_beside(row: dict, other: dict, anchors: dict[str, dict]) -> dict:
    """`other` as measured in `row`'s call: that call's anchor (`anchors_by_call`) where `other`
    ran in another call and the anchor is the same step and ran; else `other` itself."""
    anchor = anchors.get(row.get("call") or "")
    if anchor and anchor["name"] == other["name"] and anchor["status"] == "ok":
        return other if same_call(row, other) else anchor
    return other


def same_call(row: dict, other: dict) -> bool:
    """Whether two rows ran in one call (one machine): the same call id, or, for rows written
    before calls were recorded, the same commit."""
    if row.get("call") or other.get("call"):
        return row.get("call") == other.get("call")
    return row.get("git_commit") == other.get("git_commit")


def _runs(row: dict) -> list[float]:
    """A row's tokens/s per run (a row written before repeats: its one number)."""
    runs = row.get("tokens_per_sec_runs")
    if runs:
        return list(runs)
    return [row["tokens_per_sec"]] if row.get("tokens_per_sec") else []


def anchors_by_call(segments: Sequence[dict]) -> dict[str, dict]:
    """Each segment's anchor row (the step re-measured beside its steps), by its call."""
    return {s["call"]: s["anchor"] for s in segments if s.get("anchor")}


def with_ratios(ladder: DictConfig, rows: list[dict], segments: Sequence[dict] = ()) -> list[dict]:
    """Sets each row's `ratio` (tokens/s over the row it is compared with: the one above it in a
    cumulative ladder, else the baseline), `ratio_vs`, `ratio_interval` and `within_noise`, and
    with a `reference` row the same against it (`ratio_ref`, ...)."""
    anchors = anchors_by_call(segments)
    for row, previous, baseline in comparisons(ladder, rows):
        targets = {"": previous if ladder.cumulative else baseline}
        if ladder.get("reference"):
            targets["_ref"] = baseline
        for suffix, other in targets.items():
            # The baseline is not compared with itself (a ratio of 1 "within noise" says nothing).
            found = (speed_ratio(row, other, anchors) if other is not row else None) or {}
            row[f"ratio{suffix}"] = found.get("ratio")
            row[f"ratio{suffix}_vs"] = found.get("vs")
            row[f"ratio{suffix}_interval"] = found.get("interval")
            row[f"within_noise{suffix}"] = found.get("within_noise")
            row[f"ratio{suffix}_across_calls"] = found.get("across_calls")
    return rows


# ---- rendering


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _percent(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec) + "%"


def _ratio(row: dict, ref: dict | None, key: str) -> str:
    if not ref or row.get(key) is None or ref.get(key) in (None, 0):
        return "–"
    stored = next((s for s in ("", "_ref") if row.get(f"ratio{s}_vs") == ref["name"]), None)
    if key == "tokens_per_sec" and stored is not None and row.get(f"ratio{stored}") is not None:
        return _speed_cell(row, stored)
    if key == "tokens_per_sec":
        return f"{row[key] / ref[key]:.2f}x"
    return f"{100 * (row[key] / ref[key] - 1):+.0f}%"


def _speed_cell(row: dict, suffix: str) -> str:
    """A stored tokens/s ratio; with repeats, its interval and whether it is within noise; from
    two calls, only that."""
    ratio, interval = row[f"ratio{suffix}"], row[f"ratio{suffix}_interval"]
    if interval is None:
        return f"{ratio:.2f}x (across calls)"
    low, high = interval
    if row.get("repeats", 1) <= 1 and low == high:
        return f"{ratio:.2f}x"
    noise = " within noise" if row.get(f"within_noise{suffix}") else ""
    return f"{ratio:.3f}x ({low:.3f}–{high:.3f}){noise}"


def _tokens_cell(row: dict) -> str:
    """Tokens/s: the median of the repeats with their min–max, or one run's p10–p90."""
    low, high = _spread(row)
    runs = f", {row['repeats']} runs" if row.get("repeats", 1) > 1 else ""
    spread = "" if low is None or high is None else f" ({low:,.0f}–{high:,.0f}{runs})"
    return _fmt(row.get("tokens_per_sec"), ",.0f") + spread


def _loss_cell(row: dict) -> str:
    """The training loss, marked when some of the row's runs diverged (its numbers then time a
    broken model)."""
    loss, broken = _fmt(row.get("train_loss"), ".3f"), row.get("diverged_runs")
    return f"{loss} **({broken} of {row.get('repeats') or 1} runs diverged)**" if broken else loss


def with_efficiency(rows: list[dict], segments: Sequence[dict] = ()) -> list[dict]:
    """Sets each row's per-GPU `efficiency`: its tokens/s over `gpus` times those of the nearest
    1-GPU row above it (`efficiency_vs`), the same workload on one GPU of this host; 1.0 for a
    1-GPU row that ran; None where there is nothing to compare, also below a 1-GPU row that did
    not run (out of memory, say): the 1-GPU rows above it are another workload's. A row measured
    in a later call than that 1-GPU row is compared with its own call's anchor where the anchor
    is that step (`measured_beside`): one machine's numbers."""
    anchors = anchors_by_call(segments)
    reference = None
    for row in rows:
        gpus = row.setdefault("gpus", row.get("nproc", 1))
        ran = row["status"] == "ok" and row.get("tokens_per_sec")
        if gpus == 1:
            reference = row if ran else None
        ref = measured_beside(row, reference, anchors) if reference else None
        ref_tps = ref["tokens_per_sec"] if ref else None
        row["efficiency"] = (
            round(row["tokens_per_sec"] / (gpus * ref_tps), 4) if ran and ref_tps else None
        )
        row["efficiency_vs"] = reference["name"] if row["efficiency"] is not None else None
    return rows


def efficiency_reference(row: dict, rows: list[dict], segments: Sequence[dict]) -> dict | None:
    """The 1-GPU row that `row`'s efficiency is against, as measured in `row`'s call where that
    call re-measured it and profiled it too (else as the ladder has it)."""
    reference = next((r for r in rows if r["name"] == row.get("efficiency_vs")), None)
    if reference is None:
        return None
    beside = measured_beside(row, reference, anchors_by_call(segments))
    return beside if beside.get("breakdown") else reference


def gpus_label(row: dict) -> str:
    """`2` for 2 GPUs of one torchrun, `2 x 1` for two "machines" of one GPU."""
    nnodes, gpus = row.get("nnodes", 1), row.get("gpus", 1)
    return f"{nnodes} x {gpus // nnodes}" if nnodes > 1 else str(gpus)


def markdown(ladder: DictConfig, rows: list[dict], env: dict, segments: Sequence[dict] = ()) -> str:
    key = "tokens_per_sec" if ladder.focus == "speed" else "peak_allocated_gib"
    gain = "speed-up" if ladder.focus == "speed" else "peak memory"
    scaling = any(row.get("gpus", 1) > 1 for row in rows)  # then: GPUs and per-GPU efficiency
    # Compared with step 0, or with the row the ladder names as its reference, then also in
    # tokens/s when memory is the focus (a memory stage's price is speed).
    reference = ladder.get("reference")
    versus = f"`{reference}`" if reference else "baseline"
    speed_too = bool(reference) and key != "tokens_per_sec"
    repeats = any(r.get("repeats", 1) > 1 for r in rows)
    spread = "tokens/s (runs: median, min–max)" if repeats else "tokens/s (p10–p90)"
    busy = any(r.get("gpu_busy") is not None for r in rows)  # NVML's samples, when measured
    across = any(r.get("ratio_across_calls") or r.get("ratio_ref_across_calls") for r in rows)
    columns = [
        "#", "step", "what changes", *(["GPUs"] if scaling else []), spread,
        *(["per-GPU efficiency"] if scaling else []), f"{gain} vs prev", f"{gain} vs {versus}",
        *([f"tokens/s vs {versus}"] if speed_too else []),
        "MFU", *(["GPU busy"] if busy else []), "step ms", "peak alloc GiB", "peak reserved GiB",
        "loss", "status",
    ]  # fmt: skip
    header = "| " + " | ".join(columns) + " |"
    lines = [
        f"# Ladder `{ladder.name}` on {env['device']}",
        "",
        header,
        "|" + "---|" * len(columns),
    ]
    pairs = comparisons(ladder, rows)
    for row, previous, baseline in pairs:
        cells = [
            str(row["index"]),
            f"`{row['name']}`",
            row["what"] + (f" (cap {cap} GiB)" if (cap := row.get("memory_cap_gib")) else ""),
            *([gpus_label(row)] if scaling else []),
            _tokens_cell(row),
            *([_fmt(row.get("efficiency"), ".3f")] if scaling else []),
            _ratio(row, previous, key) if ladder.cumulative else "–",
            _ratio(row, baseline, key),
            *([_ratio(row, baseline, "tokens_per_sec")] if speed_too else []),
            _percent(row.get("mfu"), ".1f"),
            *([_percent(row.get("gpu_busy"), ".0f")] if busy else []),
            _fmt(row.get("step_ms"), ".1f"),
            _fmt(row.get("peak_allocated_gib"), ".2f"),
            _fmt(row.get("peak_reserved_gib"), ".2f"),
            _loss_cell(row),
            row["status"] if row["status"] == "ok" else f"**{row['status']}**",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    versus_row = f"the `{reference}` row" if reference else "step 0"
    compared = (
        f"the last step that ran (`vs prev`) and with {versus_row}"
        if ladder.cumulative
        else versus_row
    )
    lines += ["", f"Gains compare with {compared}."]
    if scaling:
        lines += [
            "Per-GPU efficiency: tokens/s / (GPUs x tokens/s of the nearest 1-GPU step above), "
            "the same per-GPU batch on one GPU of this host; `a x b` GPUs: a torchrun agents "
            '("machines", c10d rendezvous on 127.0.0.1) of b GPUs each.'
        ]
    if repeats:
        lines += [
            "Tokens/s: the median of the step's runs, interleaved with the other steps' (A B C A B "
            "C ...), with their min–max; a ratio's range is the min–max of the per-run ratios "
            "(run i of both rows, which ran side by side); *within noise*: that range includes "
            "1.00x. A single run shows the p10–p90 of its steps."
        ]
    if across:
        lines += [
            "*across calls*: the two rows ran in different device calls, perhaps on machines 2-5% "
            "apart, with no anchor between them: the ratio of their medians, not a measurement."
        ]
    if busy:
        lines += [
            "GPU busy: the mean of NVML's utilization samples over the measured steps (the share "
            "of time a kernel ran; 100% minus the idle a trace would show, without the tracer); "
            "'–': not measured (rows from before it was recorded)."
        ]
    if any(r.get("diverged_runs") for r in rows):
        lines += [
            f"*diverged*: a run's last logged training loss ended over {DIVERGED:.0%} above its "
            "lowest; its tokens/s time a model that broke, not the step (on an H100 such runs ran "
            "5.5% faster than converged runs of the same command): rerun the row before trusting "
            "its ratios."
        ]
    # A segment speaks for the rows that still come from its call (a later call may have
    # re-measured some of its steps).
    call_of = {r["name"]: r.get("call") for r in rows}
    lines += [
        f"Steps {shown} ran in one call ({s['call']}) with `{s['anchor']['name']}` "
        f"re-measured beside them as their anchor: {_tokens_cell(s['anchor'])} tokens/s."
        for s in segments
        if s.get("anchor") and s["anchor"].get("status") == "ok"
        if (shown := [n for n in s["steps"] if call_of.get(n) == s["call"]])
    ]
    lines += [f"\n- `{r['name']}`: {r['note']}" for r in rows if r.get("note")]
    lines += ladder_profile.table(
        [(row, previous if ladder.cumulative else baseline) for row, previous, baseline in pairs],
        anchors_by_call(segments),
    )
    lines += ladder_profile.parallel_table(
        [(row, efficiency_reference(row, rows, segments)) for row, _, _ in pairs]
    )
    failures = [r for r in rows if r["status"] != "ok"]
    if failures:
        lines += ["", "Steps that did not complete:", ""]
        lines += [f"- `{r['name']}` ({r['status']}): {r.get('error', '')}" for r in failures]
    lines += ["", "## Environment (of the last `ablate.py` call)", ""]
    lines += [f"- {name}: `{value}`" for name, value in env.items()]
    lines += ["", "## Step commands (and the commit each step ran at)", ""]
    lines += [f"{r['index']}. `{r['command']}` ({r.get('git_commit', '?')})" for r in rows]
    return "\n".join(lines) + "\n"


def chart(ladder: DictConfig, rows: list[dict], env: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    x = range(len(rows))
    alloc = [r.get("peak_allocated_gib") or 0 for r in rows]
    reserved = [r.get("peak_reserved_gib") or 0 for r in rows]
    has_memory = any(alloc) or any(reserved)  # a CPU ladder has none: no empty panel
    fig, axes = plt.subplots(
        1 + has_memory, 1, figsize=(max(6, 0.9 * len(rows)), 7 if has_memory else 4), sharex=True
    )
    speed, memory = (axes[0], axes[1]) if has_memory else (axes, None)
    tps = [(r.get("tokens_per_sec") or 0) / 1e3 for r in rows]
    bars = [_error_bar(r) for r in rows]
    low, high = [b[0] for b in bars], [b[1] for b in bars]
    noise = [any(r.get(k) for k in ("within_noise", "within_noise_ref")) for r in rows]
    speed.bar(
        x,
        tps,
        yerr=[low, high],
        color=["lightgray" if n else "tab:blue" for n in noise],
        hatch=["//" if n else "" for n in noise],
        edgecolor=["gray" if n else "tab:blue" for n in noise],
        capsize=3,
    )
    speed.set_ylabel("thousand tokens/s\n(median; bars: min–max of runs, or p10–p90)")
    if any(noise):
        grey = Patch(facecolor="lightgray", hatch="//", edgecolor="gray")
        speed.legend([grey], ["within noise of the row it is compared with"], loc="upper left")
    if memory is not None:
        memory_bars(memory, ladder, alloc, reserved)
    for i, row in enumerate(rows):
        if row["status"] != "ok":
            speed.annotate(row["status"], (i, 0), ha="center", va="bottom", color="red")
    (memory or speed).set_xticks(
        list(x), [f"{r['index']} {r['name']}" for r in rows], rotation=30, ha="right"
    )
    speed.set_title(f"ladder {ladder.name}: {env['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_bars(ax: Any, ladder: DictConfig, alloc: list[float], reserved: list[float]) -> None:
    """Peak allocated and reserved memory per row, and the ladder's target (`target_gib`) as a
    line: a row under it met the memory goal."""
    x = range(len(alloc))
    ax.bar([i - 0.2 for i in x], alloc, width=0.4, label="peak allocated", color="tab:orange")
    ax.bar([i + 0.2 for i in x], reserved, width=0.4, label="peak reserved", color="tab:gray")
    target = ladder.get("target_gib")
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="--", label=f"target: {target:g} GiB")
    ax.set_ylabel("GiB per GPU")
    ax.legend()


def _error_bar(row: dict) -> tuple[float, float]:
    """How far the chart's error bar reaches below and above the row's bar, in thousand tokens/s:
    never negative (matplotlib refuses that), and none where a run too short for its p10/p90 has
    no spread."""
    low, high = _spread(row)
    tps = row.get("tokens_per_sec")
    if tps is None or low is None or high is None:
        return 0.0, 0.0
    return max(0.0, tps - low) / 1e3, max(0.0, high - tps) / 1e3


def _spread(row: dict) -> tuple[float | None, float | None]:
    """A row's tokens/s spread: the min–max of its runs, else its one run's p10–p90."""
    if row.get("repeats", 1) > 1 and row.get("interval"):
        low, high = row["interval"]
        return low, high
    return row.get("tokens_per_sec_p10"), row.get("tokens_per_sec_p90")


def publish(
    ladder: DictConfig, rows: list[dict], env: dict, folder: Path, segments: Sequence[dict] = ()
) -> list[str]:
    """Writes the results; returns what could not be written. Each file is tried on its own and
    a failure is reported, not raised: a chart that cannot be drawn must not cost the steps that
    are still to run, nor the other files."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / ladder.name
    errors: list[str] = []

    def attempt(what: str, write: Callable[[], Any]) -> None:
        try:
            write()
        except Exception as e:  # noqa: BLE001 -- reported with the results, the ladder goes on
            errors.append(f"{what}: {type(e).__name__}: {e}")
            print(f"[ablate] could not write the {what}: {type(e).__name__}: {e}", flush=True)

    attempt("ratios", lambda: with_ratios(ladder, with_efficiency(rows, segments), segments))
    attempt("csv", lambda: write_csv(rows, stem.with_suffix(".csv")))
    attempt(
        "table", lambda: stem.with_suffix(".md").write_text(markdown(ladder, rows, env, segments))
    )
    attempt("chart", lambda: chart(ladder, rows, env, stem.with_suffix(".png")))
    result = {"environment": env, "steps": rows, "segments": list(segments)}
    attempt("json", lambda: stem.with_suffix(".json").write_text(
        json.dumps({**result, "report_errors": errors}, indent=2)
    ))  # fmt: skip
    print(f"[ablate] results: {stem}.{{md,csv,json,png}}", flush=True)
    return errors


CSV_COLUMNS = [
    "index", "name", "what", "status", "stages", "nproc", "nnodes", "gpus", "memory_cap_gib",
    "strategy",
    *(c for c, _ in NUMBERS), "repeats", "diverged_runs", "ratio", "ratio_vs", "within_noise",
    "efficiency", "efficiency_vs", "wall_s", "git_commit", "command", "error",
]  # fmt: skip


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "stages": "+".join(row["stages"])})


def in_ladder_order(plans: list[dict], rows: dict[str, dict]) -> list[dict]:
    """The rows of the ladder's steps, in its order and numbered by it: a row kept from an
    earlier call keeps its measurement but takes its step's place now (a step added before it
    moves it down)."""
    return [{**rows[p["name"]], "index": p["index"]} for p in plans if p["name"] in rows]


def earlier_results(path: Path) -> tuple[dict[str, dict], list[dict]]:
    """The rows (by step name) and segments of an earlier call, which this one updates."""
    if not path.exists():
        return {}, []
    result = json.loads(path.read_text())
    return {r["name"]: r for r in result["steps"]}, result.get("segments", [])


def results_dir(cfg: DictConfig) -> Path:
    """Where the results go: `out_dir` (untracked), or the shipped docs/results with
    `publish=true`, so that trying a ladder never overwrites the results the README quotes."""
    return PUBLISHED if cfg.publish else Path(cfg.out_dir)


# What `report=` reads of a results json: its rows' names, status and numbers, its segments.
MAYBE_NUMBER = (float, None)
ROW = {"name": str, "status": str, "what": str, "repeats?": int, "gpus?": int, "nnodes?": int,
       "interval?": ([float], None), "tokens_per_sec_runs?": ([float], None),
       **{f"{column}?": MAYBE_NUMBER for column, _ in NUMBERS}}  # fmt: skip
RESULTS = {
    "environment": {"device": str},
    "steps": [ROW],
    "segments?": [{"call": str, "steps": [str], "anchor?": (ROW, None)}],
}


def report(path: Path) -> list[dict]:
    """Redraws the chart of a results json (`<ladder>.json`) beside it and prints its table,
    running nothing: for a chart whose drawing changed, on a machine without the GPU."""
    result = read_json(path, RESULTS, "give report= a <ladder>.json that ablate.py wrote")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        ladder = compose("ablate", overrides=[f"ladder={path.stem}"]).ladder
    steps = in_ladder_order(step_plans(ladder), {r["name"]: r for r in result["steps"]})
    chart(ladder, steps, result["environment"], path.with_suffix(".png"))
    table = markdown(ladder, steps, result["environment"], result.get("segments", []))
    print(table.split("\n## ")[0] + f"\n[ablate] chart: {path.with_suffix('.png')}", flush=True)
    return steps


def main(argv: list[str]) -> list[dict]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("ablate", overrides=argv)
    if cfg.report:
        return report(Path(cfg.report))
    ladder = cfg.ladder
    check_device(cfg)
    plans = step_plans(ladder)
    chosen, anchor = selection(cfg, plans)
    repeats = repeat_count(cfg, ladder)
    profile = ladder_profile.enabled(cfg, ladder)
    folder = results_dir(cfg) / slug(device_name())
    kept, segments = earlier_results(folder / f"{ladder.name}.json")
    call = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")  # unique per call
    runs_dir = Path(cfg.runs_dir).resolve() / f"{ladder.name}-{call}"
    env = environment(["python", "scripts/ablate.py", *argv])
    print(
        f"[ablate] {ladder.name}: {len(chosen)} steps"
        + (f" after anchor {anchor['name']}" if anchor else "")
        + f", {repeats} run(s) each, interleaved",
        flush=True,
    )
    measured = ([anchor] if anchor else []) + chosen
    runs: dict[str, list[dict]] = {p["name"]: [] for p in measured}
    segment: dict[str, Any] = {
        "call": call,
        "steps": [p["name"] for p in chosen],
        "repeats": repeats,
        "command": env.get("command"),
        "anchor": None,  # the anchor's row, once it ran
    }
    errors: list[str] = []
    for repeat, plan in interleaved(measured, repeats):
        done = runs[plan["name"]]
        if done and done[-1]["status"] != "ok":
            continue  # a step that failed, ran out of memory or timed out is not tried again
        done.append(run_step(plan, ladder, cfg, runs_dir, repeat if repeats > 1 else None))
        for p in chosen:
            if runs[p["name"]]:
                kept[p["name"]] = aggregate(runs[p["name"]], call)
        if anchor and runs[anchor["name"]]:
            segment["anchor"] = aggregate(runs[anchor["name"]], call)
            own = kept.get(anchor["name"])
            if own is None or own.get("call") == call:  # no row of its own yet: this is it
                kept[anchor["name"]] = segment["anchor"]
        rows = in_ladder_order(plans, kept)
        # The segments some row still comes from, this one last (its anchor stands in for rows
        # of earlier calls).
        calls = {r.get("call") for r in rows}
        segments = [s for s in segments if s["call"] in calls and s["call"] != call]
        # After every run: a killed ladder keeps its results.
        errors = publish(ladder, rows, env, folder, [*segments, segment])
    for plan in measured if profile else []:  # after every timed run: none of them is profiled
        row = segment["anchor"] if plan is anchor else kept[plan["name"]]
        if row["status"] == "ok":
            row.update(profile_step(plan, ladder, cfg, runs_dir))
            rows = in_ladder_order(plans, kept)
            errors = publish(ladder, rows, env, folder, [*segments, segment])
    with contextlib.suppress(Exception):  # a table that cannot be made is in `errors` already
        table = markdown(ladder, rows, env, [*segments, segment])
        print("\n" + table.split("\n## ")[0], flush=True)  # the table, without the environment
    if errors:
        raise SystemExit(f"ablate.py: every step ran, but some results were not written: {errors}")
    return rows


if __name__ == "__main__":
    recipe.errors.main(lambda: main(sys.argv[1:]))  # bad input in one line (recipe/errors.py)
