"""Does the fastest configuration learn as well? GPT-2 124M on the bundled plays, the plain
bfloat16 configuration (reference) against a candidate, each run with several seeds, interleaved
(reference seed 0, candidate seed 0, reference seed 1, ...: a drift of the machine hits both);
their final validation losses compared by a significance test, against a tolerance.

    python scripts/quality.py --out docs/results/<gpu>/quality            # 3 seeds per arm
    python scripts/quality.py --out q --seeds 5 --candidate "+opt=[...]" device=cpu
    python scripts/quality.py --report docs/results/<gpu>/quality.json    # its .md and .png again
    python scripts/quality.py --out q_a --candidate "A" --out q_b --candidate "B"  # one reference
    python scripts/quality.py --out q --jobs 4       # 4 runs at a time (over the visible GPUs)

Several candidates (`--out` given again, each with its own `--candidate` and `--title`, paired
in order) share one reference: its runs are made once, interleaved with every candidate's
(reference seed 0, A seed 0, B seed 0, reference seed 1, ...), and each candidate gets its own
report against them, so judging N changes costs N + 1 arms instead of 2N.

`--jobs N` trains N runs at a time, in the same interleaved order (each run's output in
`<run folder>.log` beside its folder), spread over the visible GPUs (each run takes a free slot of
`gpu_slots`: the GPUs in turn, so N jobs on G GPUs put at most ceil(N / G) on one). A 300-step
run of GPT-2 124M keeps an H100 busy for only part of its ~45 s (start-up and compilation are
the rest, on the host): 4 at a time judged 21 runs in 431 s on an H100, half of their time one
by one. On a host of 2 GPUs, `--jobs 2` trains two of GPT-2 XL's runs at once, one on each. The
losses do not depend on it (the math is the same); the speeds do (runs beside each other share
the host, or a GPU), so a report of shared runs shows none.

Writes <out>.json (every run's curve and command, each arm's mean, std and range, the test),
<out>.md and <out>.png: every seed's curve, named by its arm's configuration, and below them the
gap of the means at each evaluation against the tolerance band (a gap of 0.01 nats is invisible
on a 5-11 nats loss axis). The verdict: "same within <tolerance> nats (p=...)" when the test finds
no difference and the mean difference is within the tolerance; "different: Δ=... nats, p=..."
when it finds one (p < alpha), or "better: ..." when it finds the candidate's loss lower by more
than the tolerance; else "inconclusive" (more seeds would tell). The test is Welch's t
(scipy) or, without scipy, a seeded bootstrap of the difference of means; both give a 95%
interval of the difference. A "same" whose interval reaches past the tolerance says so under
the verdict: no difference was found, but the seeds cannot bound one. Exits 0 when the
candidate passes: "same", "better", or a difference within the tolerance (also with one seed,
untested).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from base import errors
from base.files import read_json, shape_problem
from launch.provenance import environment
from measure import runner, stats

ROOT = Path(__file__).resolve().parents[1]

WORKLOAD = (
    "model=gpt2 data=shakespeare train.batch_size=16 train.max_steps=300 train.lr=6e-4 "
    "train.min_lr=6e-5 train.warmup_steps=30 train.log_interval=25 train.eval_interval=25 "
    "train.eval_sequences=80 train.checkpoint_interval=0 sample.num_samples=0 "
    "opt.amp.dtype=bfloat16 perf.warmup_steps=20"
)
REFERENCE = "+opt=[compile,amp,fused,tf32]"
CANDIDATE = "+opt=[compile,amp,fused,tf32,custom_op] opt.amp.residual=compute"
TITLE = "the fastest configuration against plain bfloat16"
FIRST_SEED = 1337  # train.seed's default: seed 0 of an arm is the run of the one-seed reports
ARMS = ("reference", "candidate")

# What `--report` reads of a report: today's, and a one-seed one of before (`runs`: one per arm).
NUMBER, MAYBE = float, (float, None)
RUN = {"command": str, "val_loss": {re.compile(r"\d+"): NUMBER}, "tokens_per_sec?": MAYBE}
SPREAD = {"mean": NUMBER, "std": MAYBE, "min": NUMBER, "max": NUMBER}
REPORT = {"workload": str, "tolerance": NUMBER, "title?": str, "jobs?": int, "gpus?": int,
          "alpha?": MAYBE, "environment?": {str: object}}  # fmt: skip
ONE_SEED_REPORT = {**REPORT, "runs": {arm: RUN for arm in ARMS}}
SEEDS_REPORT = {
    **REPORT,
    "runs": {arm: [RUN] for arm in ARMS},
    "arms": {arm: str for arm in ARMS},
    "seeds": [(int, None)],
    "final": {arm: [NUMBER] for arm in ARMS},
    "spread": {arm: SPREAD for arm in ARMS},
    "difference": {"delta": NUMBER, "interval": ([NUMBER], None), "test": (str, None)},
    "verdict": str,
    "passed": bool,
    "gap": NUMBER,
}


def run(
    name: str, stages: str, seed: int, args: argparse.Namespace, gpu: str | None = None
) -> dict[str, Any]:
    """One training run of an arm with `train.seed=seed` (on `gpu`, as CUDA_VISIBLE_DEVICES
    names it; None: every visible one): its validation curve and speed. A run that an
    interrupted call of the same command finished in `--runs-dir` is read, not repeated (a GPU
    call cut off by its time limit goes on where it stopped)."""
    run_dir = Path(args.runs_dir).resolve() / f"{name}-seed{seed}"
    command = [sys.executable, "train.py", *shlex.split(WORKLOAD), *shlex.split(stages),
               *args.extra, f"train.seed={seed}", f"hydra.run.dir={run_dir}",
               f"wandb.name=quality-{name}-seed{seed}"]  # fmt: skip
    done = run_dir / "quality_run.json"  # written once the run finished: its command
    what = [word for word in command[1:] if not word.startswith("hydra.run.dir=")]
    if done.exists():
        if json.loads(done.read_text())["command"] != what:
            sys.exit(f"[quality] {run_dir} holds a finished run of another command: give this "
                     "judgment its own --runs-dir")  # fmt: skip
        print(f"[quality] {run_dir.name}: finished by an earlier call, reused", flush=True)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # a run cut off before it finished: again
        print("[quality]", shlex.join(command), flush=True)
        launch(command, run_dir, shared=args.jobs > 1, gpu=gpu)
        done.write_text(json.dumps({"command": what}))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "seed": seed,
        "command": shlex.join(["python", *command[1:]]),
        "val_loss": {r["step"]: r["val/loss"] for r in rows if "val/loss" in r},
        "tokens_per_sec": summary.get("perf/tokens_per_sec"),
    }


def launch(command: list[str], run_dir: Path, shared: bool, gpu: str | None = None) -> None:
    """Runs train.py (on `gpu`); beside other runs (`shared`), its output goes to
    `<run_dir>.log` beside the run's folder (the trainer refuses a folder holding files that are
    not a run's), whose tail is shown if it fails."""
    env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    if not shared:
        subprocess.run(command, cwd=ROOT, check=True, env=env)
        return
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_name(f"{run_dir.name}.log")
    with log.open("w") as out:
        code = subprocess.run(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
        ).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        print(f"[quality] {run_dir.name} failed (exit {code}); the end of {log}:\n{tail}",
              file=sys.stderr, flush=True)  # fmt: skip
        raise subprocess.CalledProcessError(code, command)


def run_interleaved(
    stages: dict[str, str], seeds: list[int], args: argparse.Namespace, slots: list[str | None]
) -> dict:
    """Every arm's runs, seed by seed: {arm: [run per seed]}; `args.jobs` of them at a time,
    started in that order, each taking a GPU of `slots` (gpu_slots) while it runs. Once one
    fails no other starts (those running end), and it raises."""
    order = [(name, arm_stages, seed) for seed in seeds for name, arm_stages in stages.items()]
    failed = threading.Event()
    free: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    for slot in slots:
        free.put(slot)

    def job(name: str, arm_stages: str, seed: int) -> dict[str, Any]:
        if failed.is_set():  # after a failure, so later in the order: its result is never read
            raise CancelledError
        gpu = free.get()  # one slot per job of the pool: one is free when a job starts
        try:
            return run(name, arm_stages, seed, args, gpu)
        except BaseException:
            failed.set()
            raise
        finally:
            free.put(gpu)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(job, *each) for each in order]
        done = [future.result() for future in futures]  # raises at the failed run
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in stages}
    for (name, _, _), result in zip(order, done, strict=True):
        runs[name].append(result)
    return runs


def gpu_slots(jobs: int, gpus: list[str]) -> list[str | None]:
    """The GPU each of `jobs` runs at a time takes: the visible ones in turn (two jobs on one
    GPU when there are more jobs than GPUs); with one job or no GPU, None (every visible one)."""
    if jobs == 1 or not gpus:
        return [None] * jobs
    return [gpus[i % len(gpus)] for i in range(jobs)]


def final_loss(run: dict[str, Any]) -> float:
    """A run's last validation loss (its curve's keys are steps, ints or JSON's strings)."""
    return run["val_loss"][max(run["val_loss"], key=int)]


def verdict(difference: dict, tolerance: float, alpha: float) -> tuple[str, str, bool]:
    """(status, the sentence, passed): same, better, different, inconclusive, or one seed."""
    delta, p = difference["delta"], difference["p"]
    within = abs(delta) <= tolerance
    if p is None:
        where = "within" if within else "OUTSIDE"
        return "one seed", f"Δ={delta:+.4f} nats, one seed (no test): {where} {tolerance}", within
    if p < alpha and delta < -tolerance:  # learns better: what the tolerance guards against
        return "better", f"better: Δ={delta:+.4f} nats, p={p:.3g} (lower loss)", True
    if p < alpha:
        where = "within" if within else "beyond"
        sentence = f"different: Δ={delta:+.4f} nats, p={p:.3g} ({where} the tolerance {tolerance})"
        return "different", sentence, within
    if within:
        return "same", f"same within {tolerance} nats (p={p:.3g}, Δ={delta:+.4f})", True
    sentence = f"inconclusive: Δ={delta:+.4f} nats, p={p:.3g}: more seeds would tell"
    return "inconclusive", sentence, False


def judge(runs: dict[str, list[dict]], tolerance: float, alpha: float) -> dict[str, Any]:
    """Each arm's spread of final losses, the test of their difference and its verdict."""
    finals = {name: [final_loss(r) for r in arm_runs] for name, arm_runs in runs.items()}
    difference = stats.difference_of_means(finals["reference"], finals["candidate"])
    status, sentence, passed = verdict(difference, tolerance, alpha)
    spreads = {name: stats.mean_spread(values) for name, values in finals.items()}
    return {
        "final": finals,
        "spread": spreads,
        "difference": difference,
        "status": status,
        "verdict": sentence,
        "passed": passed,
        # What the one-seed reports held (their readers keep working): means and their gap.
        "final_val_loss": {name: spread["mean"] for name, spread in spreads.items()},
        "gap": difference["delta"],
    }


def upgrade(result: dict[str, Any]) -> dict[str, Any]:
    """A one-seed report (before seeds: `runs` {arm: one run}) in today's shape."""
    if "arms" in result:
        return result
    runs = {name: [{"seed": None, **r}] for name, r in result["runs"].items()}
    stages = {name: _stages(r[0]["command"], result["workload"]) for name, r in runs.items()}
    return {**result, "arms": stages, "runs": runs, "seeds": [None], "alpha": None,
            **judge(runs, result["tolerance"], 0.05)}  # fmt: skip


def _stages(command: str, workload: str) -> str:
    """An arm's stages, from its command: what it adds to the workload."""
    common = set(shlex.split(workload))
    words = shlex.split(command)[2:]  # after `python train.py`
    return " ".join(w for w in words if w not in common and not w.startswith(("hydra.", "wandb.")))


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "–" if value is None else format(value, spec)


def render(result: dict[str, Any]) -> list[str]:
    """The report's markdown lines, from its JSON (a one-seed report's too)."""
    result = upgrade(result)
    runs, diff, tol = result["runs"], result["difference"], result["tolerance"]
    seeds = [s for s in result["seeds"] if s is not None]
    title = result.get("title", TITLE)
    shared = result.get("jobs", 1) > 1  # runs beside each other: their speeds are not the arms'
    gpus = result.get("gpus", 1)
    where = "on one GPU" if gpus == 1 else f"over {gpus} GPUs"
    lines = [f"# Quality: {title}", "",
             f"Workload `{result['workload']}`; "
             + (f"seeds {', '.join(map(str, seeds))} per arm, interleaved" if seeds
                else "one seed (train.seed's default) per arm")
             + (f"; {result['jobs']} runs at a time {where}, so no speeds." if shared
                else "."), ""]  # fmt: skip
    lines += [f"- {name}: `{stages}`" for name, stages in result["arms"].items() if stages]
    lines += ["", "| arm | final val/loss per seed | mean ± std | min – max | tokens/s |",
              "|---|---|---|---|---|"]  # fmt: skip
    for name, arm_runs in runs.items():
        s = result["spread"][name]
        speeds = [r["tokens_per_sec"] for r in arm_runs if r.get("tokens_per_sec")]
        speed = f"{sum(speeds) / len(speeds):,.0f}" if speeds and not shared else "–"
        losses = ", ".join(f"{x:.4f}" for x in result["final"][name])
        lines.append(f"| {name} | {losses} | {s['mean']:.4f} ± {_fmt(s['std'])} | "
                     f"{s['min']:.4f} – {s['max']:.4f} | {speed} |")  # fmt: skip
    interval = diff["interval"]
    test = {"welch": "Welch's t-test", "bootstrap": f"bootstrap ({stats.RESAMPLES:,} resamples)",
            "exact": "no spread"}.get(diff["test"], "no test")  # fmt: skip
    lines += ["", f"Difference (candidate − reference): Δ = {diff['delta']:+.4f} nats"
              + (f", 95% interval [{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else "")
              + f", {test}; tolerance {tol} nats"
              + (f", α = {result['alpha']}" if result.get("alpha") else "") + ".", "",
              f"**{result['verdict']}**", ""]  # fmt: skip
    lines += _unbounded(result)
    lines += _curves(runs)
    lines += ["", "Commands:", "", *[f"- `{r['command']}`" for rs in runs.values() for r in rs]]
    env = result.get("environment", {})
    lines += ["", "Environment:", "", *[f"- {key}: `{value}`" for key, value in env.items()]]
    return lines


def unbounded(result: dict[str, Any]) -> float | None:
    """For a "same" verdict whose 95% interval reaches past the tolerance, the largest difference
    the interval allows (the test found none, but these seeds cannot rule out one larger than
    the tolerance); else None."""
    interval = result["difference"].get("interval")
    if result["status"] != "same" or not interval:
        return None
    largest = max(map(abs, interval))
    return largest if largest > result["tolerance"] else None


def _unbounded(result: dict[str, Any]) -> list[str]:
    """The line under a verdict that its interval leaves open (`unbounded`)."""
    largest = unbounded(result)
    if largest is None:
        return []
    return [f"The 95% interval reaches past ±{result['tolerance']} nats: "
            f"{len(result['seeds'])} seeds per arm cannot rule out a difference of up to "
            f"{largest:.4f} nats; more seeds would bound it.", ""]  # fmt: skip


def _curves(runs: dict[str, list[dict]]) -> list[str]:
    """The mean validation loss of each arm's seeds at every evaluated step."""
    steps = sorted({int(s) for rs in runs.values() for r in rs for s in r["val_loss"]})
    lines = ["| step | " + " | ".join(f"{n} val/loss (mean)" for n in runs) + " | gap |",
             "|---|" + "---|" * (len(runs) + 1)]  # fmt: skip
    for step in steps:
        means = [_mean_at(rs, step) for rs in runs.values()]
        gap = None if None in means else means[-1] - means[0]
        lines.append(f"| {step} | " + " | ".join(_fmt(m) for m in means)
                     + f" | {_fmt(gap, '+.4f')} |")  # fmt: skip
    return lines


def _mean_at(arm_runs: list[dict], step: int) -> float | None:
    values = [v for r in arm_runs for s, v in r["val_loss"].items() if int(s) == step]
    return sum(values) / len(values) if len(values) == len(arm_runs) else None


def chart(result: dict[str, Any], path: Path) -> None:
    """Every seed's validation curve, each arm named by its configuration, and the gap of the
    arms' means at each evaluation against the ±tolerance band (the verdict is the final one's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = upgrade(result)
    runs, tolerance = result["runs"], result["tolerance"]
    fig, (loss, gap) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    for color, (name, arm_runs) in zip(("C0", "C1"), runs.items(), strict=False):
        for i, r in enumerate(arm_runs):
            curve = {int(s): v for s, v in r["val_loss"].items()}
            label = f"{name}: {result['arms'][name]}" if i == 0 else None
            loss.plot(list(curve), list(curve.values()), color=color, alpha=0.8, marker="o",
                      markersize=3, label=label)  # fmt: skip
    loss.set_ylabel("validation loss (nats)")
    loss.legend(fontsize=8)
    loss.set_title(f"Quality: {result.get('title', TITLE)}", fontsize=10)
    steps = sorted({int(s) for rs in runs.values() for r in rs for s in r["val_loss"]})
    means = {s: [_mean_at(rs, s) for rs in runs.values()] for s in steps}
    steps = [s for s in steps if None not in means[s]]
    gaps = [means[s][-1] - means[s][0] for s in steps]
    gap.axhspan(-tolerance, tolerance, color="tab:green", alpha=0.15, label=f"±{tolerance} nats")
    gap.axhline(0, color="gray", linewidth=0.8)
    gap.plot(steps, gaps, marker="o", markersize=3, color="black", label="candidate − reference")
    verdict = "within" if result["passed"] else "OUTSIDE"
    gap.set_title(f"final gap {result['gap']:+.4f} nats: {verdict} the tolerance", fontsize=10)
    gap.set_ylim(*_gap_limits(gaps, tolerance))
    gap.set_ylabel("gap of the means (nats)")
    gap.set_xlabel("step")
    gap.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gap_limits(gaps: list[float], tolerance: float) -> tuple[float, float]:
    """The gap axis: the band and the later gaps in view (the first evaluations, far apart while
    both models are still near 10.8 nats, may leave it)."""
    later = gaps[len(gaps) // 3 :] or gaps
    reach = max(2 * tolerance, *(abs(g) * 1.2 for g in later))
    return -reach, reach


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, action="append",
                        help="<out>.json, .md, .png (again for another candidate)")  # fmt: skip
    parser.add_argument("--report", type=Path, help="a report's .json: its .md and .png again")
    parser.add_argument("--reference", default=REFERENCE, help="the plain bf16 stages")
    parser.add_argument("--candidate", action="append", help="the stages judged (one per --out)")
    parser.add_argument("--title", action="append", help="the report's title (one per --out)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per arm, train.seed 1337...")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, over the visible GPUs")
    parser.add_argument("--tolerance", type=float, default=0.02, help="nats, final val loss")
    parser.add_argument("--alpha", type=float, default=0.05, help="the test's significance level")
    parser.add_argument("--runs-dir", default="outputs/quality")
    parser.add_argument("extra", nargs="*", help="overrides for every run (e.g. device=cpu)")
    args = parser.parse_args(argv)
    if (args.out is None) == (args.report is None):
        parser.error("give --out <path> (run and report) or --report <report.json>")
    if args.out is not None:
        n = len(args.out)
        args.candidate = args.candidate or [CANDIDATE]
        if len(args.candidate) != n or len(args.title or [None] * n) != n:
            parser.error(
                f"{n} --out, {len(args.candidate)} --candidate, {len(args.title or [])} "
                "--title: give each --out its --candidate (and its --title, if any)"
            )
        titles = [TITLE] if n == 1 else [f"`{c}` against plain bfloat16" for c in args.candidate]
        args.title = args.title or titles
        names = [out.name for out in args.out]
        if n > 1 and (len(set(names)) < n or "reference" in names):
            parser.error(f"--out {names}: several candidates need reports of different names")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: give at least 1 (3 or more for a test)")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give at least 1 (runs trained at a time)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report is not None:  # run nothing: the report of a result again
        result = read_report(args.report)
        args.report.with_suffix(".md").write_text("\n".join(render(result)) + "\n")
        chart(result, args.report.with_suffix(".png"))
        print(f"[quality] {args.report.with_suffix('.md')}, {args.report.with_suffix('.png')}")
        return
    judged = candidates(args)
    stages = {"reference": args.reference, **{arm: c for arm, (_, c, _) in judged.items()}}
    seeds = [FIRST_SEED + i for i in range(args.seeds)]
    slots = gpu_slots(args.jobs, runner.visible_gpus())
    runs = run_interleaved(stages, seeds, args, slots)
    env = environment(["python", "scripts/quality.py", *(sys.argv[1:] if argv is None else argv)])
    passed = True
    for arm, (out, candidate, title) in judged.items():
        pair = {"reference": runs["reference"], "candidate": runs[arm]}
        result = {"title": title, "workload": shlex.join([*shlex.split(WORKLOAD), *args.extra]),
                  "arms": {"reference": args.reference, "candidate": candidate}, "seeds": seeds,
                  "tolerance": args.tolerance, "alpha": args.alpha, "jobs": args.jobs,
                  "gpus": len(set(slots) - {None}) or 1,
                  "runs": pair,
                  **judge(pair, args.tolerance, args.alpha), "environment": env}  # fmt: skip
        out.with_suffix(".json").write_text(json.dumps(result, indent=2))
        lines = render(result)
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        chart(result, out.with_suffix(".png"))
        print("\n".join(lines))
        passed &= result["passed"]
    sys.exit(0 if passed else 1)


def read_report(path: Path) -> dict[str, Any]:
    """A report's JSON, refused in one line naming the file and what is wrong when it is not one
    that `--out` wrote (or a one-seed one of before)."""
    fix = "give a .json that scripts/quality.py --out wrote"
    result = read_json(path, object, fix)
    seeds = isinstance(result, dict) and "arms" in result
    problem = shape_problem(result, SEEDS_REPORT if seeds else ONE_SEED_REPORT)
    if not problem:
        arms = result["runs"].values()
        if any(not run["val_loss"] for arm in arms for run in (arm if seeds else [arm])):
            problem = "a run has an empty val_loss"
    if problem:
        raise errors.Unusable(f"{path}: {problem}; {fix}")
    return result


def candidates(args: argparse.Namespace) -> dict[str, tuple[Path, str, str]]:
    """{arm: (out, candidate stages, title)}: one candidate is the arm `candidate`; several are
    named by their reports (`--out q_lowbit` runs as `q_lowbit-seed1337`)."""
    if len(args.out) == 1:
        return {"candidate": (args.out[0], args.candidate[0], args.title[0])}
    return {
        out.name: (out, c, t)
        for out, c, t in zip(args.out, args.candidate, args.title, strict=True)
    }
