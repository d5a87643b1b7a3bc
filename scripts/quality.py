"""Does the fastest configuration learn as well? Two runs of GPT-2 124M on the bundled plays with
the same seed and data, the plain bfloat16 configuration and the fastest one; their validation
curves side by side, and the final gap against a tolerance.

    python scripts/quality.py --out docs/results/<gpu>/quality
    python scripts/quality.py --report docs/results/<gpu>/quality.json   # redraw its chart only

Writes <out>.json (both curves, the commands, the final gap, pass/fail), <out>.md and <out>.png:
the two curves named by their configurations, and below them the gap at each evaluation against
the tolerance band (a gap of 0.01 nats is invisible on a 5–11 nats loss axis).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout without installing

from recipe.provenance import environment  # noqa: E402

WORKLOAD = (
    "model=gpt2 data=shakespeare train.batch_size=16 train.max_steps=300 train.lr=6e-4 "
    "train.min_lr=6e-5 train.warmup_steps=30 train.log_interval=25 train.eval_interval=25 "
    "train.eval_sequences=80 train.checkpoint_interval=0 sample.num_samples=0 "
    "opt.amp.dtype=bfloat16 perf.warmup_steps=20"
)
REFERENCE = "+opt=[compile,amp,fused,tf32]"
CANDIDATE = "+opt=[compile,amp,fused,tf32,custom_op] opt.amp.residual=compute"
TITLE = "the fastest configuration against plain bfloat16"


def run(name: str, stages: str, args: argparse.Namespace) -> dict:
    run_dir = Path(args.runs_dir).resolve() / name
    command = [sys.executable, "train.py", *shlex.split(WORKLOAD), *shlex.split(stages),
               *args.extra, f"hydra.run.dir={run_dir}", f"wandb.name=quality-{name}"]  # fmt: skip
    print("[quality]", shlex.join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "stages": stages,
        "command": shlex.join(["python", *command[1:]]),
        "val_loss": {r["step"]: r["val/loss"] for r in rows if "val/loss" in r},
        "tokens_per_sec": summary.get("perf/tokens_per_sec"),
    }


def stages_of(run: dict, workload: str) -> str:
    """A run's configuration: its stages (recorded since they were; before, read off its command
    as the words that are neither the workload's nor where the run went)."""
    if run.get("stages"):
        return run["stages"]
    common = set(shlex.split(workload))
    words = shlex.split(run["command"])[2:]  # after `python train.py`
    own = [w for w in words if w not in common and not w.startswith(("hydra.run.dir=", "wandb."))]
    return " ".join(own)


def chart(result: dict, path: Path) -> None:
    """The validation curves of both runs, named by their configurations, and their gap at each
    evaluation against the ±tolerance band (the pass/fail is the final step's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, tolerance = result["runs"], result["tolerance"]
    curves = {name: {int(s): v for s, v in r["val_loss"].items()} for name, r in runs.items()}
    fig, (loss, gap) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    for name, curve in curves.items():
        label = f"{name}: {stages_of(runs[name], result['workload'])}"
        loss.plot(list(curve), list(curve.values()), marker="o", markersize=3, label=label)
    loss.set_ylabel("validation loss (nats)")
    loss.legend(fontsize=8)
    loss.set_title(f"Quality: {result.get('title', TITLE)}", fontsize=10)
    steps = [s for s in curves["reference"] if s in curves["candidate"]]
    gaps = [curves["candidate"][s] - curves["reference"][s] for s in steps]
    gap.axhspan(-tolerance, tolerance, color="tab:green", alpha=0.15, label=f"±{tolerance} nats")
    gap.axhline(0, color="gray", linewidth=0.8)
    gap.plot(steps, gaps, marker="o", markersize=3, color="black", label="candidate − reference")
    verdict = "within" if result["passed"] else "OUTSIDE"
    gap.set_title(f"final gap {result['gap']:+.4f} nats: {verdict} the tolerance", fontsize=10)
    gap.set_ylim(*_gap_limits(gaps, tolerance))
    gap.set_ylabel("gap (nats)")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="<out>.json, .md, .png")
    parser.add_argument("--report", type=Path, help="a result json: redraw its png, run nothing")
    parser.add_argument("--reference", default=REFERENCE, help="the plain bf16 stages")
    parser.add_argument("--candidate", default=CANDIDATE, help="the fastest stages")
    parser.add_argument("--title", default=TITLE)
    parser.add_argument("--tolerance", type=float, default=0.02, help="nats, final val loss")
    parser.add_argument("--runs-dir", default="outputs/quality")
    parser.add_argument("extra", nargs="*", help="overrides for both runs (e.g. device=cpu)")
    args = parser.parse_args()
    if args.report:
        chart(json.loads(args.report.read_text()), args.report.with_suffix(".png"))
        print(f"[quality] chart: {args.report.with_suffix('.png')}")
        return
    if args.out is None:
        parser.error("--out is required (or --report <json> to redraw a chart)")
    runs = {name: run(name, stages, args) for name, stages in
            (("reference", args.reference), ("candidate", args.candidate))}  # fmt: skip
    final = {name: r["val_loss"][max(r["val_loss"])] for name, r in runs.items()}
    gap = final["candidate"] - final["reference"]
    env = environment(["python", "scripts/quality.py", *sys.argv[1:]])
    result = {"title": args.title, "runs": runs, "final_val_loss": final, "gap": gap,
              "tolerance": args.tolerance, "passed": abs(gap) <= args.tolerance,
              "workload": WORKLOAD, "environment": env}  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    steps = sorted(runs["reference"]["val_loss"])
    lines = [
        f"# Quality: {args.title}", "",
        f"Same seed and data; workload `{WORKLOAD}`.", "",
        f"- reference: `{args.reference}`", f"- candidate: `{args.candidate}`", "",
        f"Final validation loss: reference {final['reference']:.4f}, candidate "
        f"{final['candidate']:.4f}, gap {gap:+.4f} nats (tolerance {args.tolerance}): "
        f"**{'within' if result['passed'] else 'OUTSIDE'}**.", "",
        "| step | reference val/loss | candidate val/loss | gap |", "|---|---|---|---|",
    ]  # fmt: skip
    for s in steps:
        a, b = runs["reference"]["val_loss"][s], runs["candidate"]["val_loss"].get(s)
        lines.append(f"| {s} | {a:.4f} | {'–' if b is None else f'{b:.4f}'} | "
                     f"{'–' if b is None else f'{b - a:+.4f}'} |")  # fmt: skip
    lines += ["", "Commands:", "", *[f"- `{r['command']}`" for r in runs.values()]]
    lines += ["", "Environment:", "", *[f"- {key}: `{value}`" for key, value in env.items()]]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    chart(result, args.out.with_suffix(".png"))
    print("\n".join(lines))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
