"""Runs an ablation ladder and publishes its results: one command per ladder.

    python scripts/ablate.py ladder=speed           # the book's speed ladder, then beyond
    python scripts/ablate.py ladder=memory          # the book's memory ladder
    python scripts/ablate.py ladder=quick           # a CPU-sized ladder, for trying the harness
    python scripts/ablate.py ladder=speed steps=[compile,amp_fp16] "extra=['+prof=trace']"

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

Results: `<out_dir>/<device>/<ladder>.{json,csv,md,png}`, with the command, the git commit, the
GPU, the driver and the library versions; rerunning some steps updates their rows. The table
compares each row with step 0, or with the row named by the ladder's `reference` (the memory_xl
ladder's target is relative to its `ac` row), in memory and in tokens/s.
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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout without installing
# The harness's own config, apart from conf/'s groups: train.py's search path does not see it.
CONF = ROOT / "conf" / "ablate"

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from recipe.distributed import descendants, torchrun  # noqa: E402
from recipe.provenance import device_name, environment, git_commit  # noqa: E402

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
)


def step_plans(ladder: DictConfig) -> list[dict[str, Any]]:
    """What each step runs: its stages and overrides (after the workload's), accumulated when the
    ladder is cumulative, less the stages it drops, and its processes."""
    base = list(ladder.get("opt", []))
    overrides: list[str]
    plans, stages, overrides = [], base, []
    for index, step in enumerate(ladder.steps):
        if not ladder.cumulative:
            stages, overrides = base, []
        stages = stages + [s for s in step.get("opt", []) if s not in stages]
        stages = [s for s in stages if s not in step.get("drop", [])]
        overrides = overrides + list(step.get("overrides", []))
        nproc, nnodes = step.get("nproc", 1), step.get("nnodes", 1)
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
                "strategy": "fsdp"
                if "fsdp" in stages
                else "ddp"
                if nproc * nnodes > 1
                else "single",
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
        *extra,
        f"hydra.run.dir={run_dir}",
        f"wandb.group=ladder-{ladder.name}",
        f"wandb.name={ladder.name}-{plan['index']:02d}-{plan['name']}",
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


def run_step(plan: dict, ladder: DictConfig, cfg: DictConfig, runs_dir: Path) -> dict[str, Any]:
    """Runs one step in its own process(es); returns its row (status and numbers)."""
    run_dir = runs_dir / f"{plan['index']:02d}-{plan['name']}"
    agents = launches(plan, ladder, list(cfg.extra), run_dir)
    row = {
        **plan,
        "command": " & ".join(shell(command, env) for command, env in agents),
        "git_commit": git_commit(),
    }
    gpus = torch.cuda.device_count()  # with none, several processes share the CPU (gloo)
    if 0 < gpus < plan["gpus"]:
        return {**row, "status": "skipped", "error": f"needs {plan['gpus']} GPUs, {gpus} here"}
    run_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"[ablate] {ladder.name} {plan['index']:02d} {plan['name']}: {row['command']}", flush=True
    )
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
    timed_out = not wait_all(procs, deadline=started + cfg.timeout_s)
    output = "".join(log.read_text(errors="replace") for log in logs)
    if timed_out:
        status = "timeout"
    elif any(p.returncode for p in procs):
        status = "oom" if OOM.search(output) else "failed"
    else:
        status = "ok"
    row["wall_s"] = round(time.time() - started, 1)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    row.update({column: summary.get(key) for column, key in NUMBERS})
    if status != "ok":
        row["error"] = failure_reason(output)
    print(f"[ablate]   -> {status}, {row['wall_s']} s", flush=True)
    return {**row, "status": status}


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAISED = re.compile(r"^[\w.]*(Error|Exception)\b|CUDA out of memory")


def failure_reason(output: str) -> str:
    """What a failed step's output says went wrong: the last line naming an exception (wandb
    prints its sync hints after the traceback), else the last three lines."""
    lines = [ANSI.sub("", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    raised = [line for line in lines if RAISED.search(line)]
    reason = raised[-1] if raised else " | ".join(lines[-3:])
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


# ---- rendering


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ratio(row: dict, ref: dict | None, key: str) -> str:
    if not ref or row.get(key) is None or ref.get(key) in (None, 0):
        return "–"
    if key == "tokens_per_sec":
        return f"{row[key] / ref[key]:.2f}x"
    return f"{100 * (row[key] / ref[key] - 1):+.0f}%"


def with_efficiency(rows: list[dict]) -> list[dict]:
    """Sets each row's per-GPU `efficiency`: its tokens/s over `gpus` times those of the nearest
    1-GPU row above it that ran (`efficiency_vs`), the same workload on one GPU of this host;
    1.0 for a 1-GPU row that ran; None where there is nothing to compare."""
    reference = None
    for row in rows:
        gpus = row.setdefault("gpus", row.get("nproc", 1))
        ran = row["status"] == "ok" and row.get("tokens_per_sec")
        if gpus == 1 and ran:
            reference = row
        ref_tps = reference["tokens_per_sec"] if reference else None
        row["efficiency"] = (
            round(row["tokens_per_sec"] / (gpus * ref_tps), 4) if ran and ref_tps else None
        )
        row["efficiency_vs"] = reference["name"] if row["efficiency"] is not None else None
    return rows


def _gpus(row: dict) -> str:
    """`2` for 2 GPUs of one torchrun, `2 x 1` for two "machines" of one GPU."""
    nnodes, gpus = row.get("nnodes", 1), row.get("gpus", 1)
    return f"{nnodes} x {gpus // nnodes}" if nnodes > 1 else str(gpus)


def markdown(ladder: DictConfig, rows: list[dict], env: dict) -> str:
    key = "tokens_per_sec" if ladder.focus == "speed" else "peak_allocated_gib"
    gain = "speed-up" if ladder.focus == "speed" else "peak memory"
    scaling = any(row.get("gpus", 1) > 1 for row in rows)  # then: GPUs and per-GPU efficiency
    # Compared with step 0, or with the row the ladder names as its reference, then also in
    # tokens/s when memory is the focus (a memory stage's price is speed).
    reference = ladder.get("reference")
    versus = f"`{reference}`" if reference else "baseline"
    speed_too = bool(reference) and key != "tokens_per_sec"
    columns = [
        "#", "step", "what changes", *(["GPUs"] if scaling else []), "tokens/s (p10–p90)",
        *(["per-GPU efficiency"] if scaling else []), f"{gain} vs prev", f"{gain} vs {versus}",
        *([f"tokens/s vs {versus}"] if speed_too else []),
        "MFU", "step ms", "peak alloc GiB", "peak reserved GiB", "loss", "status",
    ]  # fmt: skip
    header = "| " + " | ".join(columns) + " |"
    lines = [
        f"# Ladder `{ladder.name}` on {env['device']}",
        "",
        header,
        "|" + "---|" * len(columns),
    ]
    ok = [r for r in rows if r["status"] == "ok"]
    if reference:
        baseline = next((r for r in ok if r["name"] == reference), None)
    else:
        baseline = ok[0] if ok and ok[0]["index"] == 0 else None
    previous = None
    for row in rows:
        spread = ""
        if row.get("tokens_per_sec_p10") is not None:
            spread = f" ({row['tokens_per_sec_p10']:,.0f}–{row['tokens_per_sec_p90']:,.0f})"
        mfu = _fmt(row.get("mfu"), ".1f") + ("%" if row.get("mfu") is not None else "")
        cells = [
            str(row["index"]),
            f"`{row['name']}`",
            row["what"],
            *([_gpus(row)] if scaling else []),
            _fmt(row.get("tokens_per_sec"), ",.0f") + spread,
            *([_fmt(row.get("efficiency"), ".3f")] if scaling else []),
            _ratio(row, previous, key) if ladder.cumulative else "–",
            _ratio(row, baseline, key),
            *([_ratio(row, baseline, "tokens_per_sec")] if speed_too else []),
            mfu,
            _fmt(row.get("step_ms"), ".1f"),
            _fmt(row.get("peak_allocated_gib"), ".2f"),
            _fmt(row.get("peak_reserved_gib"), ".2f"),
            _fmt(row.get("train_loss"), ".3f"),
            row["status"] if row["status"] == "ok" else f"**{row['status']}**",
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if row["status"] == "ok":
            previous = row
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
    lines += [f"\n- `{r['name']}`: {r['note']}" for r in rows if r.get("note")]
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

    def thousands(row: dict, key: str) -> float:
        return (row.get(key) or 0) / 1e3

    x = range(len(rows))
    fig, (speed, memory) = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(rows)), 7), sharex=True)
    tps = [thousands(r, "tokens_per_sec") for r in rows]
    low = [
        t - thousands(r, "tokens_per_sec_p10") if t else 0 for t, r in zip(tps, rows, strict=True)
    ]
    high = [
        thousands(r, "tokens_per_sec_p90") - t if t else 0 for t, r in zip(tps, rows, strict=True)
    ]
    speed.bar(x, tps, yerr=[low, high], color="tab:blue", capsize=3)
    speed.set_ylabel("thousand tokens/s (median, p10–p90)")
    alloc = [r.get("peak_allocated_gib") or 0 for r in rows]
    reserved = [r.get("peak_reserved_gib") or 0 for r in rows]
    memory.bar([i - 0.2 for i in x], alloc, width=0.4, label="peak allocated", color="tab:orange")
    memory.bar([i + 0.2 for i in x], reserved, width=0.4, label="peak reserved", color="tab:gray")
    memory.set_ylabel("GiB per GPU")
    memory.legend()
    if not any(alloc):
        memory.text(0.5, 0.5, "no GPU memory to show", transform=memory.transAxes, ha="center")
    for i, row in enumerate(rows):
        if row["status"] != "ok":
            speed.annotate(row["status"], (i, 0), ha="center", va="bottom", color="red")
    memory.set_xticks(list(x), [f"{r['index']} {r['name']}" for r in rows], rotation=30, ha="right")
    speed.set_title(f"ladder {ladder.name}: {env['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def publish(ladder: DictConfig, rows: list[dict], env: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = with_efficiency(rows)
    stem = folder / ladder.name
    (stem.with_suffix(".json")).write_text(
        json.dumps({"environment": env, "steps": rows}, indent=2)
    )
    columns = ["index", "name", "what", "status", "stages", "nproc", "nnodes", "gpus", "strategy"]
    columns += [*(c for c, _ in NUMBERS), "efficiency", "efficiency_vs"]
    columns += ["wall_s", "git_commit", "command", "error"]
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "stages": "+".join(row["stages"])})
    stem.with_suffix(".md").write_text(markdown(ladder, rows, env))
    chart(ladder, rows, env, stem.with_suffix(".png"))
    print(f"[ablate] results: {stem}.{{md,csv,json,png}}", flush=True)


def main(argv: list[str]) -> list[dict]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("ablate", overrides=argv)
    ladder = cfg.ladder
    plans = step_plans(ladder)
    names = [p["name"] for p in plans]
    wanted = list(cfg.steps) if cfg.steps else names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise SystemExit(f"steps {unknown} are not in ladder {ladder.name}: {names}")
    folder = Path(cfg.out_dir) / slug(device_name())
    previous = folder / f"{ladder.name}.json"
    kept = (
        {r["name"]: r for r in json.loads(previous.read_text())["steps"]}
        if previous.exists()
        else {}
    )
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    runs_dir = Path(cfg.runs_dir).resolve() / f"{ladder.name}-{stamp}"
    env = environment(["python", "scripts/ablate.py", *argv])
    for plan in plans:
        if plan["name"] in wanted:
            kept[plan["name"]] = run_step(plan, ladder, cfg, runs_dir)
            rows = [kept[p["name"]] for p in plans if p["name"] in kept]
            publish(
                ladder, rows, env, folder
            )  # after every step: a killed ladder keeps its results
    print(OmegaConf.to_yaml({r["name"]: r["status"] for r in rows}), flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
