"""Does the fastest configuration learn as well? Two runs of GPT-2 124M on the bundled plays with
the same seed and data, the plain bfloat16 configuration and the fastest one; their validation
curves side by side, and the final gap against a tolerance.

    python scripts/quality.py --out docs/results/<gpu>/quality

Writes <out>.json (both curves, the commands, the final gap, pass/fail), <out>.md and <out>.png.
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


def run(name: str, stages: str, args: argparse.Namespace) -> dict:
    run_dir = Path(args.runs_dir).resolve() / name
    command = [sys.executable, "train.py", *shlex.split(WORKLOAD), *shlex.split(stages),
               *args.extra, f"hydra.run.dir={run_dir}", f"wandb.name=quality-{name}"]  # fmt: skip
    print("[quality]", shlex.join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "command": shlex.join(["python", *command[1:]]),
        "val_loss": {r["step"]: r["val/loss"] for r in rows if "val/loss" in r},
        "tokens_per_sec": summary.get("perf/tokens_per_sec"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="<out>.json, .md, .png")
    parser.add_argument("--reference", default=REFERENCE, help="the plain bf16 stages")
    parser.add_argument("--candidate", default=CANDIDATE, help="the fastest stages")
    parser.add_argument("--title", default="the fastest configuration against plain bfloat16")
    parser.add_argument("--tolerance", type=float, default=0.02, help="nats, final val loss")
    parser.add_argument("--runs-dir", default="outputs/quality")
    parser.add_argument("extra", nargs="*", help="overrides for both runs (e.g. device=cpu)")
    args = parser.parse_args()
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        ax.plot(list(r["val_loss"]), list(r["val_loss"].values()), marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print("\n".join(lines))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
