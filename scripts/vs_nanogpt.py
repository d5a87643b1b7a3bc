"""The recipe against nanoGPT on the same GPU, from one device call: nanoGPT's bench.py output
(`bash .ref/vs_nanogpt.sh > nanogpt.txt`, see /work/shared/reference) and a row of a ladder
measured in the same call (the recipe's fastest single-GPU configuration: real data through the
memmap loader, logging on).

    python scripts/vs_nanogpt.py nanogpt.txt docs/results/<gpu>/speed.json --step bs64 \\
        --out docs/results/<gpu>/vs_nanogpt

Writes <out>.json (nanogpt_tokens_per_sec: bench.py's best, no biases;
nanogpt_bias_tokens_per_sec; ours_tokens_per_sec; ratio = ours / nanogpt_tokens_per_sec; mfu;
device; command; commit) and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

LINE = re.compile(r"bias=(True|False): ([\d,]+) tokens/s")


def nanogpt_numbers(text: str) -> dict[bool, float]:
    """{bias: tokens/s} from vs_nanogpt.sh's output; a run that failed is missing."""
    return {m.group(1) == "True": float(m.group(2).replace(",", "")) for m in LINE.finditer(text)}


def compare(nanogpt_text: str, ladder: dict, step: str) -> dict:
    numbers = nanogpt_numbers(nanogpt_text)
    if False not in numbers:
        raise SystemExit("no bench.py number without biases in the nanoGPT output: did it fail?")
    rows = {r["name"]: r for r in ladder["steps"]}
    if step not in rows or rows[step]["status"] != "ok":
        raise SystemExit(f"ladder step {step!r} is not an ok row of this ladder: {sorted(rows)}")
    row, env = rows[step], ladder["environment"]
    ours = row["tokens_per_sec"]
    return {
        "nanogpt_tokens_per_sec": numbers[False],
        "nanogpt_bias_tokens_per_sec": numbers.get(True),
        "ours_tokens_per_sec": ours,
        "ratio": ours / numbers[False],
        "ratio_vs_nanogpt_with_bias": ours / numbers[True] if True in numbers else None,
        "mfu": row["mfu"],
        "peak_allocated_gib": row["peak_allocated_gib"],
        "device": env["device"],
        "command": row["command"],
        "commit": row.get("git_commit", env["git_commit"]),
        "ladder_step": step,
        "date": env["date"],
        "torch": env["torch"],
        "nanogpt_command": "bash .ref/vs_nanogpt.sh (bench.py --real_data=False --batch_size=32 "
        "--bias=False|True: compile, bf16, flash attention, fused AdamW, synthetic tokens)",
    }


def markdown(r: dict) -> str:
    bias = r["nanogpt_bias_tokens_per_sec"]
    return (
        f"# The recipe vs nanoGPT on {r['device']} ({r['date']}, torch {r['torch']})\n\n"
        "Both measured in the same device call (GPU instances differ by up to 5%).\n\n"
        "| | tokens/s | ratio |\n|---|---|---|\n"
        f"| nanoGPT bench.py, batch 32, no biases (its best) | {r['nanogpt_tokens_per_sec']:,.0f}"
        " | 1.00 |\n"
        + (f"| nanoGPT bench.py, batch 32, with biases | {bias:,.0f} | – |\n" if bias else "")
        + f"| **this recipe, GPT-2 with biases, real data, logging on** | "
        f"**{r['ours_tokens_per_sec']:,.0f}** | **{r['ratio']:.3f}** |\n\n"
        f"The recipe's MFU: {r['mfu']:.1f}% (989 TFLOP/s dense bf16); peak "
        f"{r['peak_allocated_gib']:.2f} GiB. Its row: ladder step `{r['ladder_step']}`, commit "
        f"{r['commit']}:\n\n    {r['command']}\n\nnanoGPT: {r['nanogpt_command']}.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nanogpt", type=Path, help="vs_nanogpt.sh's output")
    parser.add_argument("ladder", type=Path, help="the ladder's .json (scripts/ablate.py)")
    parser.add_argument("--step", required=True, help="the ladder step to compare")
    parser.add_argument("--out", type=Path, required=True, help="<out>.json and <out>.md")
    args = parser.parse_args()
    result = compare(args.nanogpt.read_text(), json.loads(args.ladder.read_text()), args.step)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
