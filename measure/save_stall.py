"""How long a checkpoint save holds the training loop: the same run saved synchronously and with
`train.async_save=true`, one after the other, each saving at step 20 and at its last step (30).
The step-20 save is the one to compare: the last one waits for its write either way.

    python scripts/save_stall.py --out docs/results/<gpu>/checkpoint_save     # GPT-2 XL, ~5 min
    python scripts/save_stall.py --out q model=tiny device=cpu                # any overrides
    python scripts/save_stall.py --out r --from-metrics sync.jsonl async.jsonl  # json/md again

Writes <out>.json (per mode: the seconds each save held the loop, `perf/checkpoint_s`; the
median step before the save and the step right after it, which shares the GPU and the host with
the background write) and <out>.md, and keeps each run's metrics beside them
(<out>_sync.metrics.jsonl, <out>_async.metrics.jsonl) so the numbers can be read again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from base import errors
from launch.provenance import environment
from recipe.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SAVE_STEP, LAST_STEP = 20, 30
WORKLOAD = (
    "model=gpt2-xl data=synthetic +opt=[amp,fused,ac] opt.amp.dtype=bfloat16 "
    f"train.batch_size=16 train.max_steps={LAST_STEP} train.log_interval=1 "
    f"train.eval_interval=1000000 train.checkpoint_interval={SAVE_STEP} "
    "perf.checkpoint_time=true sample.num_samples=0"
)
MODES = {"sync": "train.async_save=false", "async": "train.async_save=true"}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's metrics: each save's hold (seconds, by step), the median step before the first
    save and the step after it (ms)."""
    held = {r["step"]: r["perf/checkpoint_s"] for r in rows if "perf/checkpoint_s" in r}
    steps = {r["step"]: r["perf/step_ms"] for r in rows if "perf/step_ms" in r}
    first = min(held, default=None)
    before = [ms for step, ms in steps.items() if first and 1 < step <= first]  # 1: warm-up
    if not before:
        raise errors.UserError(
            "no save timed after a timed step in these metrics: give the metrics.jsonl of a run "
            "with perf.checkpoint_time=true that saved after step 2, as this script's runs do"
        )
    return {"held_s": held, "step_ms_before": statistics.median(before),
            "step_ms_after": steps.get(first + 1)}  # fmt: skip


def summarized(path: Path) -> dict[str, Any]:
    """`summarize` of a run's metrics.jsonl, refused in one line naming the file."""
    rows = read_metrics(path)  # its errors name the file and line
    try:
        return summarize(rows)
    except errors.UserError as e:
        raise errors.UserError(f"{path}: {e}") from None


def render(result: dict[str, Any]) -> str:
    runs = result["runs"]
    lines = ["# How long a checkpoint save holds the loop: synchronous against asynchronous", "",
             f"Workload `{result['workload']}`; saves at steps {SAVE_STEP} and {LAST_STEP} (the "
             "last, which waits for its write either way).", "",
             f"| mode | save at step {SAVE_STEP} held | step before (median) | step after "
             f"| save at step {LAST_STEP} held |", "|---|---|---|---|---|"]  # fmt: skip
    for mode, run in runs.items():
        held = {int(k): v for k, v in run["held_s"].items()}
        after = run["step_ms_after"]
        lines.append(f"| {mode} | {held[SAVE_STEP]:.1f} s | {run['step_ms_before']:.0f} ms | "
                     f"{after:.0f} ms | {held.get(LAST_STEP, float('nan')):.1f} s |")  # fmt: skip
    sync, async_ = (first_save_held(runs[m]["held_s"]) for m in ("sync", "async"))
    lines += ["", f"The asynchronous save held the loop {async_:.1f} s instead of "
              f"{sync:.1f} s ({sync / async_:.1f}x less).", "",
              "Commands:", "", *[f"- `{run['command']}`" for run in runs.values()], "",
              "Environment:", ""]  # fmt: skip
    lines += [f"- {key}: `{value}`" for key, value in result["environment"].items()]
    return "\n".join(lines) + "\n"


def first_save_held(held: dict) -> float:
    """The hold of the save at SAVE_STEP, from a run's `held_s` (JSON's keys are strings)."""
    return {int(k): v for k, v in held.items()}[SAVE_STEP]


def run(mode: str, out: Path, extra: list[str]) -> tuple[str, Path]:
    """Trains the workload with `mode`'s saving; returns its command and kept metrics file."""
    run_dir = out.parent / f".{out.name}_{mode}_run"
    command = [sys.executable, "train.py", *shlex.split(WORKLOAD), MODES[mode], *extra,
               f"hydra.run.dir={run_dir}"]  # fmt: skip
    print("[save_stall]", shlex.join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    kept = out.parent / f"{out.name}_{mode}.metrics.jsonl"
    shutil.copy(run_dir / "metrics.jsonl", kept)
    shutil.rmtree(run_dir)  # a GPT-2 XL checkpoint is 19 GB
    return shlex.join(["python", *command[1:-1]]), kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="<out>.json, <out>.md")
    parser.add_argument("--from-metrics", nargs=2, type=Path, metavar=("SYNC", "ASYNC"),
                        help="summarize these runs' metrics.jsonl instead of training")  # fmt: skip
    parser.add_argument("extra", nargs="*", help="overrides for both runs (e.g. model=tiny)")
    args = parser.parse_args(argv)
    this_command = ["python", "scripts/save_stall.py", *(sys.argv[1:] if argv is None else argv)]
    missing = [str(path) for path in args.from_metrics or () if not path.is_file()]
    if missing:
        parser.error(f"--from-metrics: no file {', '.join(missing)}: give two runs' metrics.jsonl")
    if args.from_metrics:
        earlier = args.out.with_suffix(".json")
        kept = dict(zip(MODES, args.from_metrics, strict=True))
        old = json.loads(earlier.read_text()) if earlier.exists() else {}
        commands = {m: old.get("runs", {}).get(m, {}).get("command", "") for m in MODES}
        env = old.get("environment") or environment(this_command)  # the measuring call's
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        ran = {mode: run(mode, args.out, args.extra) for mode in MODES}
        commands, kept = {m: c for m, (c, _) in ran.items()}, {m: p for m, (_, p) in ran.items()}
        env = environment(this_command)
    result = {"workload": WORKLOAD, "environment": env,
              "runs": {m: {"command": commands[m], "metrics": kept[m].name,
                           **summarized(kept[m])} for m in MODES}}  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(render(result))
    print(render(result))
