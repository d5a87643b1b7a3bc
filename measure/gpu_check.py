"""One command for the GPU: `pytest -m gpu` (every test must pass), then a three-row smoke ladder
(conf/ablate/ladder/smoke.yaml: GPT-2 124M compiled in bfloat16, + the fused head, + activation
checkpointing) compared with the last accepted `docs/results/<gpu>/check.json`.

    python scripts/gpu_check.py            # about 9 minutes on a fresh H100 (tests 4, ladder 5)
    python scripts/gpu_check.py --accept   # a first run, or numbers that moved on purpose

CI runs on CPUs only, so this is how GPU code gets run: whenever a change touches code a GPU
runs, run it and commit its check.json with the change.

A row passes when its tokens/s lie inside the accepted row's noise interval (the min–max of its
repeats, widened to at least ±2%: repeats in one call agree far more closely than two hosts do)
and its peak allocated memory within 2% of the accepted row's; faster or smaller passes and is
reported. When every test and row passed, or with `--accept` (the tests must still pass and every
row run), a new check.json records the commit, the environment, pytest's counts and the rows.
Prints one verdict line per row and one overall; exits 1 when a test failed or a row regressed.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from launch.provenance import device_name, environment
from measure import ablate, ladder_results

ROOT = Path(__file__).resolve().parents[1]

NOISE = 0.02  # the narrowest tokens/s interval a row is judged with: ±2% of the accepted median
MEMORY = 0.02  # peak allocated memory may move this much either way
PYTEST = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b")


@dataclass
class PytestRun:
    """`pytest -m gpu`'s exit status and its summary's counts ({"passed": 25, "skipped": 1})."""

    returncode: int
    counts: dict[str, int]

    @property
    def passed(self) -> bool:
        return self.returncode == 0  # 1: a test failed, 5: none collected, others: pytest broke

    def summary(self) -> str:
        return ", ".join(f"{n} {what}" for what, n in self.counts.items()) or "no summary"


@dataclass
class Verdict:
    """One row against its accepted row: what changed (empty: nothing beyond the noise), whether
    that passes, and the line printed for it."""

    name: str
    changes: list[str]
    passed: bool
    line: str


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (`1 failed, 25 passed, 1 skipped in 60.1s`)."""
    summaries = [line for line in output.splitlines() if COUNT.search(line) and " in " in line]
    if not summaries:
        return {}
    return {what: int(n) for n, what in COUNT.findall(summaries[-1])}


def run_tests() -> PytestRun:
    """`pytest -m gpu` in a process of its own, its output shown as it runs."""
    print(f"[gpu_check] {shlex.join(['python', *PYTEST[1:]])}", flush=True)
    proc = subprocess.Popen(
        PYTEST, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return PytestRun(proc.wait(), pytest_counts("".join(lines)))


def run_ladder(scratch: Path) -> list[dict[str, Any]]:
    """The smoke ladder's rows; its results files go to `scratch` (check.json keeps the rows)."""
    return ablate.main(["ladder=smoke", f"out_dir={scratch}", "timeout_s=300"])


def speed_band(accepted: dict[str, Any]) -> tuple[float, float]:
    """The accepted row's tokens/s noise interval: the min–max of its repeats (`interval`, when
    it has one), widened to at least ±NOISE around its median."""
    tps = accepted["tokens_per_sec"]
    low, high = accepted.get("interval") or (tps, tps)
    return min(low, tps * (1 - NOISE)), max(high, tps * (1 + NOISE))


def compare_row(row: dict[str, Any], accepted: dict[str, Any] | None) -> Verdict:
    """Speed and memory of `row` against the accepted row of the same name."""
    name = row["name"]
    if row.get("status") != "ok":
        why = f"{row.get('status')}: {row.get('error', '')}"
        return Verdict(name, ["failed"], False, f"{name}: FAILED ({why})")
    if not accepted or accepted.get("status") != "ok":
        line = f"{name}: NEW (no accepted row to compare with: check it, then run with --accept)"
        return Verdict(name, ["new"], False, line)
    changes, facts = [], []
    tps, (low, high) = row["tokens_per_sec"], speed_band(accepted)
    mine_low, mine_high = row.get("interval") or (tps, tps)
    if mine_high < low:
        changes.append("slower")
    elif mine_low > high:
        changes.append("faster")
    facts.append(
        f"{tps:,.0f} tokens/s, accepted {accepted['tokens_per_sec']:,.0f} "
        f"(noise {low:,.0f}–{high:,.0f})"
    )
    peak, was = row.get("peak_allocated_gib"), accepted.get("peak_allocated_gib")
    if peak is not None and was:
        change = peak / was - 1
        if abs(change) > MEMORY:
            changes.append("more memory" if change > 0 else "less memory")
        facts.append(f"peak {peak:.2f} GiB, accepted {was:.2f} ({100 * change:+.1f}%)")
    passed = not {"slower", "more memory"} & set(changes)
    word = ", ".join(changes).upper() if changes else "ok"
    return Verdict(name, changes, passed, f"{name}: {word}: {'; '.join(facts)}")


def compare(rows: list[dict[str, Any]], accepted: list[dict[str, Any]]) -> list[Verdict]:
    by_name = {r["name"]: r for r in accepted}
    return [compare_row(row, by_name.get(row["name"])) for row in rows]


def decide(
    tests: PytestRun, rows: list[dict], verdicts: list[Verdict], accept: bool
) -> tuple[bool, bool]:
    """(passed, write): the check passes when every test and row passed, or with `accept` when
    the tests passed and every row ran; it writes check.json exactly then."""
    rows_ran = bool(rows) and all(r.get("status") == "ok" for r in rows)
    if not tests.passed or not rows_ran:
        return False, False
    passed = accept or all(v.passed for v in verdicts)
    return passed, passed


def record(
    env: dict[str, Any], tests: PytestRun, rows: list[dict], verdicts: list[Verdict], accept: bool
) -> dict[str, Any]:
    """check.json's content."""
    return {
        "commit": env["git_commit"],
        "environment": env,
        "accepted": "--accept" if accept else "every test and row passed",
        "pytest": {
            "command": shlex.join(["python", *PYTEST[1:]]),
            "returncode": tests.returncode,
            "counts": tests.counts,
        },
        "verdicts": {v.name: v.changes or ["ok"] for v in verdicts},
        "rows": rows,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--accept",
        action="store_true",
        help="write check.json even where rows differ (a first run)",
    )
    parser.add_argument(
        "--out-dir",
        default=str(ROOT / "docs" / "results"),
        help="where <gpu>/check.json lives (default: docs/results)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise SystemExit(
            f"gpu_check.py: no CUDA GPU is visible (torch {torch.__version__}, {build}): run it "
            "on a GPU machine (CUDA_VISIBLE_DEVICES and the driver decide what torch sees)"
        )
    path = Path(args.out_dir) / ladder_results.slug(device_name()) / "check.json"
    accepted = json.loads(path.read_text())["rows"] if path.exists() else []
    env = environment(["python", "scripts/gpu_check.py", *argv])
    tests = run_tests()
    with tempfile.TemporaryDirectory() as scratch:
        rows = run_ladder(Path(scratch))
    verdicts = compare(rows, accepted)
    passed, write = decide(tests, rows, verdicts, args.accept)
    print(f"\n[gpu_check] pytest -m gpu: {tests.summary()}", flush=True)
    for verdict in verdicts:
        print(f"[gpu_check] {verdict.line}", flush=True)
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record(env, tests, rows, verdicts, args.accept), indent=2))
    against = f"against {path}" if accepted else f"(no accepted {path} yet)"
    outcome = f"wrote {path}: commit it with the change" if write else f"{path} left as it was"
    print(f"[gpu_check] {'PASS' if passed else 'FAIL'} {against}; {outcome}", flush=True)
    return 0 if passed else 1
