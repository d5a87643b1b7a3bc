"""The recipe against nanoGPT's bench.py at equal work, from one device call.

    python scripts/vs_nanogpt.py run --bench .ref/nanogpt --repeats 3   # on the GPU, <= 10 min
    python scripts/vs_nanogpt.py report docs/results/<gpu>/vs_nanogpt.json  # re-render the .md

`run` measures, in one process tree and interleaved (round 1: every configuration once, round 2:
again, ...: drift hits every configuration alike), nanoGPT's bench.py (compile, bf16, synthetic
tokens: `--real_data=False`) at each batch without biases (its fastest shape) and with them
(GPT-2's shape), and this recipe's train.py at the same batches (always with GPT-2's biases) in
two configurations of the speed ladder (conf/ablate/ladder/speed.yaml): `plain`, its memmap row
(compile, bf16 autocast, TF32, fused AdamW: bench.py's math) and `fastest`, its residual_bf16 row
(+ custom_op, same math, + a bfloat16 residual stream, which changes the math); `--ours` also
offers `custom_op` (plain + the fused head and loss) and `tuned` (that, with Inductor's kernels
tuned by coordinate descent: same math, minutes more compilation). bench.py's
tokens/s is its mean over 20 steps after 10 of burn-in; ours the same: 30 steps, the mean over
steps 11-30 (metrics.jsonl).

Time (H100, estimate): a first round compiles every configuration (bench.py ~35-45 s a run, ours
~45-60 s with its data loader and evaluation), ~7 min for 8 configurations; later rounds hit
Inductor's cache (~15-25 s a run, ~3 min a round): 3 rounds ~12-13 min from a cold cache,
~9 min from a warm one. `--deadline-s` (default 560) starts no run expected to end past it (its
configuration's last duration, else the longest run so far), so a 10-minute device command
always returns whole results: 2 rounds from a cold cache; for 3, run it again on the same warm
machine (each call is self-contained: its own rounds, its own json).

Writes <out>.json after every run (a killed call keeps its results): the runs, each
configuration's median over repeats with its min-max interval, every ratio at the same batch and
biases (the equal-work ones: same math) with the median and min-max of the per-round ratios,
and the headlines: ours at its best against bench.py at its best (the math and biases stated)
and the same with bench.py's math only. Then <out>.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measure import runner, stats

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 1024  # tokens per sequence, both sides
BENCH_MS = re.compile(r"^time per iteration: ([\d.]+)ms", re.MULTILINE)
# Our configurations: a step of the speed ladder (its stages and overrides, accumulated), then
# overrides that change how fast, not what is computed (Inductor's kernels tuned by coordinate
# descent: their launch shapes only).
VARIANTS = {
    "plain": ("memmap", []),
    "custom_op": ("custom_op", []),
    "tuned": ("custom_op", ["opt.compile.coordinate_descent=true"]),
    "fastest": ("residual_bf16", []),
}
STAGES_BEYOND_PLAIN = {
    "custom_op": "plain + custom_op",
    "tuned": "plain + custom_op + coordinate descent",
    "fastest": "plain + custom_op",
}
# Overrides that change what is computed, not how fast: named in every row they are in.
OTHER_MATH = {
    "opt.amp.residual=compute": "bfloat16 residual stream",
    "opt.custom_op.float8=true": "float8 head",
}
# Short runs: 10 steps of burn-in (compilation) and 20 measured, as bench.py.
OURS_RUN = [
    "train.max_steps=30", "perf.warmup_steps=10", "train.log_interval=10",
    "train.checkpoint_interval=0", "sample.num_samples=0", "wandb.mode=disabled",
]  # fmt: skip
NANOGPT_MATH = "compile, bf16 autocast, TF32, fused AdamW, flash attention"
METHOD = (
    "How each side is timed: bench.py, the mean step over its 20 steps after 10 of burn-in, by "
    "the wall clock, with a `loss.item()` sync every step, on synthetic tokens already on the "
    "GPU; ours, train.py's mean step over steps 11-30 by CUDA events (no per-step sync), on "
    "real text through the memmap loader (12 workers), with gradient clipping and the "
    "non-finite guard on. Ratios: the median over rounds of ours / bench.py within a round, "
    "and their min-max; within noise when that interval contains 1."
)


# ---- parsing what the runs print and write


def bench_tokens_per_sec(output: str, batch: int) -> float | None:
    """Tokens/s from bench.py's `time per iteration: <ms>ms` line; None if it never got there."""
    match = BENCH_MS.search(output)
    return batch * BLOCK / (float(match.group(1)) / 1e3) if match else None


def ours_tokens_per_sec(run_dir: Path, warmup_steps: int) -> dict[str, float | None]:
    """Our run's tokens/s as bench.py measures its own (total tokens / total time over the steps
    after the burn-in, from metrics.jsonl's log windows), and the median step's (summary.json)."""
    windows = []
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        record = json.loads(line)
        tps, ms = record.get("perf/tokens_per_sec"), record.get("perf/step_ms")
        if tps and ms and record["step"] > warmup_steps:
            windows.append((tps, ms))  # every window spans log_interval steps
    summary = run_dir / "summary.json"
    summary = json.loads(summary.read_text()) if summary.exists() else {}
    median = summary.get("perf/tokens_per_sec")
    mean = sum(t * ms for t, ms in windows) / sum(ms for _, ms in windows) if windows else None
    return {"tokens_per_sec": mean, "tokens_per_sec_median": median}


def other_math(overrides: list[str]) -> str | None:
    """What in a configuration changes the math against bench.py's; None: the same math."""
    changes = [what for override, what in OTHER_MATH.items() if override in overrides]
    return ", ".join(changes) or None


# ---- the configurations and their runs


def bench_configs(batches: list[int]) -> list[dict[str, Any]]:
    """bench.py at each batch, without biases (its fastest shape) and with them (GPT-2's)."""
    configs = []
    for batch in batches:
        for bias in (False, True):
            args = ["--real_data=False", f"--batch_size={batch}", f"--bias={bias}"]
            configs.append(
                {
                    "name": f"bench.py b{batch}" + (" bias" if bias else ""),
                    "side": "nanogpt",
                    "batch": batch,
                    "bias": bias,
                    "math": None,
                    "what": NANOGPT_MATH + ", synthetic tokens",
                    "argv": [sys.executable, "bench.py", *args],
                }
            )
    return configs


def ours_configs(batches: list[int], variants: list[str]) -> list[dict[str, Any]]:
    """train.py at each batch in each variant: the speed ladder's workload and its step's stages
    and overrides, then the batch and the short run."""
    from measure import ladders

    ladder = ladders.read("speed")
    plans = {plan["name"]: plan for plan in ladders.step_plans(ladder)}
    configs = []
    for batch in batches:
        for variant in variants:
            step, tuning = VARIANTS[variant]
            plan = plans[step]
            overrides = [*plan["overrides"], *tuning, f"opt.bs.batch_size={batch}"]
            configs.append(
                {
                    "name": f"ours b{batch} {variant}",
                    "side": "ours",
                    "batch": batch,
                    "bias": True,
                    "variant": variant,
                    "math": other_math(overrides),
                    "what": f"+opt=[{','.join(plan['stages'])}], real data (memmap loader)",
                    "argv": [
                        sys.executable,
                        "train.py",
                        *ladder.workload,
                        f"+opt=[{','.join(plan['stages'])}]",
                        *overrides,
                        *OURS_RUN,
                    ],  # fmt: skip
                }
            )
    return configs


def run_one(
    name: str, argv: list[str], bench: Path | None, run_dir: Path, batch: int, timeout_s: float
) -> dict[str, Any]:
    """One run, as the ablation harness runs a step (its own process group, stopped whole on a
    timeout, Ctrl-C or SIGTERM): bench.py from a copy of `bench` (it reads configurator.py and
    model.py from its working directory), else train.py with `run_dir` as its run folder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cwd = ROOT
    if bench is not None:
        cwd = Path(tempfile.mkdtemp(dir=run_dir))
        for file in bench.glob("*.py"):
            shutil.copy(file, cwd)
    else:
        argv = [*argv, f"hydra.run.dir={run_dir.resolve()}"]
    print(f"[vs_nanogpt] {run_dir.name}: {shlex.join(argv[1:])}", flush=True)
    started = time.time()
    status, output, _ = runner.launch([(argv, {})], run_dir, timeout_s, cwd=cwd)
    if bench is not None:
        numbers = {"tokens_per_sec": bench_tokens_per_sec(output, batch)}
    else:
        numbers = ours_tokens_per_sec(run_dir, warmup_steps=10)
    if status == "ok" and numbers["tokens_per_sec"] is None:
        status = "failed"  # it ended well but printed no speed
    run: dict[str, Any] = {"config": name, "wall_s": round(time.time() - started, 1), **numbers}
    run["status"] = status
    if status != "ok":
        run["error"] = runner.failure_reason(output)
    print(f"[vs_nanogpt]   -> {run['status']}, {run['tokens_per_sec']} tokens/s", flush=True)
    return run


# ---- the arithmetic


def per_round(runs: list[dict], name: str) -> dict[int, float]:
    """A configuration's tokens/s by round, its failed runs left out."""
    return {
        r["repeat"]: r["tokens_per_sec"]
        for r in runs
        if r["config"] == name and r.get("tokens_per_sec") is not None
    }


def ratio(runs: list[dict], ours: dict, nanogpt: dict) -> dict[str, Any]:
    """Ours / bench.py from the rounds both ran (drift within a round cancels): the median of
    the per-round ratios and their min-max; `within_noise` when that interval contains 1."""
    a, b = per_round(runs, ours["name"]), per_round(runs, nanogpt["name"])
    result = {"ours": ours["name"], "nanogpt": nanogpt["name"], "batch": ours["batch"]}
    result |= {"same_batch": ours["batch"] == nanogpt["batch"]}
    result |= {"same_bias": ours["bias"] == nanogpt["bias"], "math": ours["math"]}
    result |= stats.median_interval([a[r] / b[r] for r in sorted(a.keys() & b.keys())])
    interval = result["interval"]
    result["within_noise"] = interval[0] <= 1 <= interval[1] if interval else None
    return result


def best_against(runs: list[dict], ours: list[dict], nanogpt: dict | None) -> dict | None:
    """The fastest of `ours` (by median) against `nanogpt`; None when either is missing."""
    if not ours or nanogpt is None:
        return None
    return ratio(runs, max(ours, key=lambda c: c["median"]), nanogpt)


def summarize(result: dict) -> dict:
    """Fills in each configuration's median and interval, the ratios at the same batch and
    biases, and the two headlines, from `result`'s configs and runs."""
    runs, configs = result["runs"], result["configs"]
    for config in configs:
        config |= stats.median_interval(list(per_round(runs, config["name"]).values()))
    measured = [c for c in configs if c["median"] is not None]
    ours = [c for c in measured if c["side"] == "ours"]
    nanogpt = [c for c in measured if c["side"] == "nanogpt"]
    result["ratios"] = [
        ratio(runs, o, n) for o in ours for n in nanogpt
        if o["batch"] == n["batch"] and o["bias"] == n["bias"]
    ]  # fmt: skip
    best = max(nanogpt, key=lambda c: c["median"], default=None)
    same_math = [c for c in ours if c["math"] is None]
    result["headline"] = best_against(runs, ours, best)
    result["headline_same_math"] = best_against(runs, same_math, best)
    return result


# ---- rendering


def _k(tps: float | None) -> str:
    return "—" if tps is None else f"{tps / 1e3:,.1f} K"


def _x(r: dict) -> str:
    """A ratio with its interval and repeats, or its single run."""
    if r["interval"] is None:
        return "—"
    text = f"{r['median']:.3f}x"
    if r["repeats"] > 1:
        text += f" ({r['interval'][0]:.3f}–{r['interval'][1]:.3f}, {r['repeats']} rounds"
        text += ", within noise)" if r["within_noise"] else ")"
    else:
        text += " (one run each: no interval)"
    return text


def describe(config: dict) -> str:
    """`batch 64, biases, plain + custom_op, other math: bfloat16 residual stream`."""
    parts = [f"batch {config['batch']}", "biases" if config["bias"] else "no biases"]
    if config["side"] == "ours":
        variant = config.get("variant", "?")
        parts.append(STAGES_BEYOND_PLAIN.get(variant, variant))
    parts.append(f"other math: {config['math']}" if config["math"] else "bench.py's math")
    return ", ".join(parts)


def differences(ours: dict, nanogpt: dict) -> str:
    """What makes a comparison other than equal work, or that it is equal work."""
    diffs = []
    if ours["batch"] != nanogpt["batch"]:
        diffs.append(f"batch {ours['batch']} vs {nanogpt['batch']}")
    if ours["bias"] != nanogpt["bias"]:
        diffs.append(f"biases on {'ours' if ours['bias'] else 'bench.py'} only")
    if ours["math"]:
        diffs.append(f"ours changes the math ({ours['math']})")
    return "not equal work: " + "; ".join(diffs) if diffs else "equal work"


def headline(result: dict) -> str:
    """The sentences the README shows: ours at its best, then with bench.py's math (unless that
    is the same configuration, whose description names its math), each against bench.py's
    fastest configuration measured in the same call, what differs stated."""
    configs = {c["name"]: c for c in result["configs"]}
    sentences = []
    best, same = result.get("headline"), result.get("headline_same_math")
    leads = [("at its best", best)]
    if not (best and same and best["ours"] == same["ours"]):
        leads.append(("with bench.py's math", same))
    for lead, h in leads:
        if not h:
            sentences.append(f"Ours {lead}: not measured.")
            continue
        o, n = configs[h["ours"]], configs[h["nanogpt"]]
        sentences.append(
            f"Ours {lead} ({describe(o)}: {_k(o['median'])} tokens/s) runs at **{_x(h)}** "
            f"the fastest bench.py of the call ({describe(n)}: {_k(n['median'])}); "
            f"{differences(o, n)}."
        )
    batches = sorted({c["batch"] for c in configs.values() if c["side"] == "nanogpt"})
    sentences.append(f"bench.py measured at batch {', '.join(map(str, batches))}.")
    return " ".join(sentences)


def equal_work_table(result: dict) -> str:
    """Every ratio at the same batch and biases; the equal-work rows are those with the same
    math."""
    lines = ["| batch | biases | ours | math | ours / bench.py |", "|---|---|---|---|---|"]
    configs = {c["name"]: c for c in result["configs"]}
    for r in result["ratios"]:
        o = configs[r["ours"]]
        math = f"other: {r['math']}" if r["math"] else "same (equal work)"
        bias = "yes" if o["bias"] else "no"
        lines.append(f"| {r['batch']} | {bias} | {o.get('variant', '?')} | {math} | {_x(r)} |")
    if not result["ratios"]:
        lines.append("| — | — | — | — | none measured at the same batch and biases |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"# The recipe vs nanoGPT's bench.py on {env['device']} ({env['date']}, torch "
        f"{env['torch']}, commit {env['git_commit']})",
        "",
        headline(result),
        "",
        f"All in one device call; {result.get('order', '—')}.",
        "",
        "## At the same batch and biases",
        "",
        equal_work_table(result),
        "",
        "## Every configuration (tokens/s: median over rounds, min–max)",
        "",
        "| configuration | what | tokens/s | interval | rounds |",
        "|---|---|---|---|---|",
    ]
    for c in result["configs"]:
        median = "—" if c["median"] is None else f"{c['median']:,.0f}"
        interval = "–".join(f"{v:,.0f}" for v in c["interval"]) if c["repeats"] > 1 else "—"
        cells = [c["name"], f"{describe(c)}; {c['what']}", median, interval, str(c["repeats"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Commands:", ""]
    lines += [f"- {c['name']}: `{c.get('command', '—')}`" for c in result["configs"]]
    if result.get("notes"):
        lines += ["", *result["notes"]]
    return "\n".join(lines) + "\n"


def load(path: Path) -> dict:
    """A vs_nanogpt.json with its ratios and headlines (re)computed from its runs."""
    return summarize(json.loads(path.read_text()))


# ---- the command line


def measure(args: argparse.Namespace) -> dict:
    """Runs every configuration once per round, `args.repeats` rounds, writing the results after
    every run; stops early rather than pass `args.deadline_s`."""
    from launch.provenance import device_name, environment
    from measure.ladder_results import slug

    if not (args.bench / "bench.py").exists():
        raise SystemExit(f"{args.bench}/bench.py not found: copy nanoGPT's bench.py there")
    configs = [*bench_configs(args.batches), *ours_configs(args.batches, args.ours)]
    argvs = {c["name"]: c.pop("argv") for c in configs}
    for c in configs:
        c["command"] = shlex.join(["python", *argvs[c["name"]][1:]])
    order = sorted(configs, key=lambda c: (c["batch"], c["side"] == "ours"))
    out = args.out or ROOT / "docs/results" / slug(device_name()) / "vs_nanogpt"
    runs_dir = Path("outputs/vs_nanogpt") / time.strftime("%Y%m%d-%H%M%S")
    result: dict[str, Any] = {
        "environment": environment(["python", "scripts/vs_nanogpt.py", *sys.argv[1:]])
    }
    result |= {"order": "each round: " + ", ".join(c["name"] for c in order)}
    result |= {"configs": configs, "runs": [], "notes": [METHOD]}
    last_wall_s: dict[str, float]  # each configuration's last run, for the deadline
    started, last_wall_s = time.time(), {}
    for repeat in range(1, args.repeats + 1):
        for config in order:
            name = config["name"]
            # A configuration not yet run is expected to take as long as the longest so far.
            expected = last_wall_s.get(name, max(last_wall_s.values(), default=0))
            if time.time() - started + expected > args.deadline_s:
                print(f"[vs_nanogpt] deadline: stopped before round {repeat}, {name}", flush=True)
                return result
            bench = args.bench if config["side"] == "nanogpt" else None
            run = run_one(name, argvs[name], bench, runs_dir / f"{slug(name)}-{repeat}",
                          config["batch"], args.timeout_s)  # fmt: skip
            result["runs"].append({"repeat": repeat, **run})
            last_wall_s[name] = run["wall_s"]
            write(summarize(result), out)
    return result


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure both, interleaved, on this GPU")
    run.add_argument("--bench", type=Path, default=Path(".ref/nanogpt"), help="bench.py's folder")
    run.add_argument("--repeats", type=int, default=3, help="rounds over every configuration")
    run.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    run.add_argument("--ours", nargs="+", default=["plain", "fastest"], choices=list(VARIANTS))
    run.add_argument("--deadline-s", type=float, default=560, help="start no run that ends later")
    run.add_argument("--timeout-s", type=float, default=240, help="a run taking longer is killed")
    run.add_argument("--out", type=Path, help="<out>.json and .md (default docs/results/<gpu>/)")
    report = sub.add_parser("report", help="re-render the .md from the .json")
    report.add_argument("json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        result = measure(args)
        print(markdown(summarize(result)))
        return
    result = load(args.json)
    args.json.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
