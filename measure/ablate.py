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
a run that needs more fails as out of memory; the row records the cap. A step may set
environment variables, `env: {NCCL_PROTO: Simple}` (that step only): its processes run with them,
and its row's command shows them.

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
(measure/ladder_profile.py).

Results: `<out_dir>/<device>/<ladder>.{json,csv,md,png}` (`outputs/ablate/results/`, untracked;
`publish=true` writes them into `docs/results/<device>/`, the shipped ones), with the command, the
git commit, the GPU, the driver and the library versions; rerunning some steps updates their
rows, and two calls publishing one ladder at once (a ladder on each GPU of a host) keep each
other's rows. The table compares each row with step 0, or with the row named by the ladder's
`reference` (the memory_xl ladder's target is relative to its `ac` row), in memory and in
tokens/s; it is printed at the end.
A failing step, or a results file that cannot be written (its error is in the json's
`report_errors`), never stops the steps after it.
"""

from __future__ import annotations

import contextlib
import datetime
from pathlib import Path
from typing import Any

from launch.provenance import device_name, environment
from measure import ladder_profile, ladder_results, ladder_table, ladders, runner, stats


def main(argv: list[str]) -> list[dict]:
    cfg = ladders.config(argv)
    if cfg.report:
        return ladder_results.report(Path(cfg.report))
    ladder = cfg.ladder
    ladders.check_device(cfg)
    plans = ladders.step_plans(ladder)
    chosen, anchor = ladders.selection(cfg, plans)
    repeats = ladders.repeat_count(cfg, ladder)
    profile = ladder_profile.enabled(cfg, ladder)
    folder = ladder_results.results_dir(cfg) / ladder_results.slug(device_name())
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
    mine: dict[str, dict] = {}  # this call's rows, by step
    segment: dict[str, Any] = {
        "call": call,
        "steps": [p["name"] for p in chosen],
        "repeats": repeats,
        "command": env.get("command"),
        "anchor": None,  # the anchor's row, once it ran
    }
    published = ladder_results.Published(rows=[], segments=[], errors=[])
    for repeat, plan in ladders.interleaved(measured, repeats):
        done = runs[plan["name"]]
        if done and done[-1]["status"] != "ok":
            continue  # a step that failed, ran out of memory or timed out is not tried again
        done.append(runner.run_step(plan, ladder, cfg, runs_dir, repeat if repeats > 1 else None))
        for p in chosen:
            if runs[p["name"]]:
                mine[p["name"]] = stats.aggregate(runs[p["name"]], call)
        if anchor and runs[anchor["name"]]:
            segment["anchor"] = stats.aggregate(runs[anchor["name"]], call)
        # After every run: a killed ladder keeps its results.
        published = ladder_results.publish_call(ladder, plans, mine, segment, env, folder)
    for plan in measured if profile else []:  # after every timed run: none of them is profiled
        row = segment["anchor"] if plan is anchor else mine[plan["name"]]
        if row["status"] == "ok":
            row.update(runner.profile_step(plan, ladder, cfg, runs_dir))
            published = ladder_results.publish_call(ladder, plans, mine, segment, env, folder)
    rows, errors = published.rows, published.errors
    with contextlib.suppress(Exception):  # a table that cannot be made is in `errors` already
        table = ladder_table.markdown(ladder, rows, env, published.segments)
        print("\n" + table.split("\n## ")[0], flush=True)  # the table, without the environment
    if errors:
        raise SystemExit(f"ablate.py: every step ran, but some results were not written: {errors}")
    return rows
