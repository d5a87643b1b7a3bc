"""One command for the GPU: `pytest -m gpu` (every test must pass), then a three-row smoke ladder
(conf/ablate/ladder/smoke.yaml: GPT-2 124M compiled in bfloat16, + the fused head, + activation
checkpointing) compared with the last accepted `docs/results/<gpu>/check.json`.

    python scripts/gpu_check.py            # about 9 minutes on a fresh H100 (tests 4, ladder 5)
    python scripts/gpu_check.py --accept   # a first run, or numbers that moved on purpose

CI runs on CPUs only, so this is how GPU code gets run: whenever a change touches code a GPU
runs, run it and commit its check.json with the change.

Where a command may not run that long (the lent machines stop each call at 10 minutes, and the
GPU tests alone take about 12 on 2 H200s), run it in parts, on separate calls or side by side on
disjoint GPUs of one host, each writing a file to `<out-dir>/<gpu>/check_parts/`, and assemble
them on any machine, a CPU one included:

    python scripts/gpu_check.py --part tests [PYTEST_PATH ...]   # tests-<id>.json; no path: all
    python scripts/gpu_check.py --part ladder                    # ladder.json
    python scripts/gpu_check.py --assemble --gpu nvidia-h200 [--accept]

Assembling refuses, writing nothing, unless the parts come from one commit without uncommitted
changes, a ladder part is there, every test part passed, and the test parts together passed (or
skipped) every test that `pytest -m gpu --collect-only` collects here: a path left out, or a test
added since, would otherwise pass unseen. It then judges the ladder's rows as the one command
does, writes the same check.json with the parts listed, and deletes the parts.

A row passes when the min–max of its runs reaches into the accepted row's noise interval (the
min–max of its repeats, widened to at least ±2%: repeats in one call agree far more closely than
two hosts do) and its peak allocated memory is within 2% of the accepted row's; faster or smaller
passes and is reported. When every test and row passed, or with `--accept` (the tests must still
pass and every row run), a new check.json records the commit, the environment, pytest's counts
and the rows.
Prints one verdict line per row and one overall; exits 1 when a test failed or a row regressed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
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
PARTS = "check_parts"  # the parts' folder, beside check.json
DIRTY = "(with uncommitted changes)"  # how launch.provenance marks a commit that is not the tree
COVERED = {"passed", "skipped"}  # the outcomes that count a test as run by a part
SHOWN = 5  # the uncovered tests an assembly's refusal names
JUNIT = {"failure": "failed", "error": "error", "skipped": "skipped"}  # a test case's tags


@dataclass
class PytestRun:
    """`pytest -m gpu`'s exit status, its summary's counts ({"passed": 25, "skipped": 1}), the
    command as shown (its temporary junit file left out), and each test's outcome by node id."""

    returncode: int
    counts: dict[str, int]
    command: str = shlex.join(["python", *PYTEST[1:]])
    outcomes: dict[str, str] = field(default_factory=dict)

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


class Refusal(Exception):
    """Why the parts cannot be assembled, in one line."""


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (`1 failed, 25 passed, 1 skipped in 60.1s`)."""
    summaries = [line for line in output.splitlines() if COUNT.search(line) and " in " in line]
    if not summaries:
        return {}
    return {what: int(n) for n, what in COUNT.findall(summaries[-1])}


def node_id(classname: str, name: str, root: Path) -> str:
    """pytest's node id of a junit test case. junit writes `tests/x.py::TestC::name[p]` as
    classname `tests.x.TestC`, name `name[p]`: the file is the longest dotted prefix that names a
    .py file under `root`, the rest are classes. A case that names no file keeps its junit name,
    so it matches no collected id rather than losing the run's other outcomes."""
    parts = classname.split(".") if classname else []
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[end:], name])
    return "::".join([classname, name]) if classname else name


def junit_outcomes(xml: Path, root: Path) -> dict[str, str]:
    """Each test case's outcome (passed, skipped, failed or error) by node id, from pytest's
    junit file (the summary counts say how many failed, not which)."""
    outcomes = {}
    for case in ET.parse(xml).iter("testcase"):
        words = [JUNIT[child.tag] for child in case if child.tag in JUNIT]
        node = node_id(case.get("classname", ""), case.get("name", ""), root)
        outcomes[node] = words[0] if words else "passed"
    return outcomes


def run_tests(paths: Sequence[str] = (), root: Path = ROOT) -> PytestRun:
    """`pytest -m gpu PATHS` (no paths: all of tests/) in a process of its own under `root`, its
    output shown as it runs; the junit file it writes gives each test's outcome."""
    command = shlex.join(["python", *PYTEST[1:], *paths])
    print(f"[gpu_check] {command}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        xml = Path(scratch) / "junit.xml"
        proc = subprocess.Popen(
            [*PYTEST, f"--junit-xml={xml}", *paths],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        returncode = proc.wait()
        outcomes = junit_outcomes(xml, root) if xml.exists() else {}
    return PytestRun(returncode, pytest_counts("".join(lines)), command, outcomes)


def collected_ids(root: Path = ROOT) -> list[str]:
    """The node ids `pytest -m gpu --collect-only -q` lists under `root`: the tests the parts
    must cover. Collecting needs no GPU."""
    done = subprocess.run([*PYTEST, "--collect-only"], cwd=root, capture_output=True, text=True)
    if done.returncode not in (0, 5):  # 5: nothing collected
        raise Refusal(f"`pytest -m gpu --collect-only` failed here (exit {done.returncode})")
    ids = done.stdout.split("\n\n")[0].splitlines()  # the ids, then a blank line, the summary
    return [line for line in ids if "::" in line]


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
    env: dict[str, Any],
    tests: PytestRun,
    rows: list[dict],
    verdicts: list[Verdict],
    accept: bool,
    parts: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """check.json's content; assembled from parts, it lists them."""
    content = {
        "commit": env["git_commit"],
        "environment": env,
        "accepted": "--accept" if accept else "every test and row passed",
        "pytest": {
            "command": tests.command,
            "returncode": tests.returncode,
            "counts": tests.counts,
        },
        "verdicts": {v.name: v.changes or ["ok"] for v in verdicts},
        "rows": rows,
    }
    if parts:
        content["parts"] = [
            {key: part.get(key) for key in ("kind", "paths", "command", "counts")}
            | {"date": part["environment"].get("date")}
            for part in parts
        ]
    return content


def conclude(
    path: Path,
    env: dict[str, Any],
    tests: PytestRun,
    rows: list[dict],
    accept: bool,
    parts: Sequence[dict[str, Any]] = (),
) -> bool:
    """Judges `rows` against the accepted check.json at `path`, prints the verdicts, and writes
    check.json when the check passed; whether it passed. The one command and an assembly end
    here alike, so that their check.json and lines cannot drift apart."""
    accepted = json.loads(path.read_text())["rows"] if path.exists() else []
    verdicts = compare(rows, accepted)
    passed, write = decide(tests, rows, verdicts, accept)
    print(f"\n[gpu_check] pytest -m gpu: {tests.summary()}", flush=True)
    for verdict in verdicts:
        print(f"[gpu_check] {verdict.line}", flush=True)
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        content = record(env, tests, rows, verdicts, accept, parts)
        path.write_text(json.dumps(content, indent=2))
    against = f"against {path}" if accepted else f"(no accepted {path} yet)"
    outcome = f"wrote {path}: commit it with the change" if write else f"{path} left as it was"
    print(f"[gpu_check] {'PASS' if passed else 'FAIL'} {against}; {outcome}", flush=True)
    return passed


def require_gpu() -> None:
    """Exits in one line without a GPU: on a CPU every GPU test skips and no row runs."""
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise SystemExit(
            f"gpu_check.py: no CUDA GPU is visible (torch {torch.__version__}, {build}): run it "
            "on a GPU machine (CUDA_VISIBLE_DEVICES and the driver decide what torch sees)"
        )


def part_name(kind: str, paths: Sequence[str]) -> str:
    """A part's file name: the ladder's one, or one per set of test paths, so that lanes running
    different paths never overwrite each other and running the same paths again replaces them."""
    if kind == "ladder":
        return "ladder.json"
    digest = hashlib.sha256("\n".join(sorted(paths)).encode()).hexdigest()
    return f"tests-{digest[:8]}.json"


def run_part(kind: str, paths: Sequence[str], folder: Path, argv: list[str]) -> int:
    """Runs one part on this GPU and writes it to `folder`/check_parts, failed or not (an
    assembly names what failed); exits 1 when a test failed or a row did not run."""
    env = environment(["python", "scripts/gpu_check.py", *argv])
    part: dict[str, Any] = {"kind": kind, "commit": env["git_commit"], "environment": env}
    if kind == "tests":
        tests = run_tests(paths)
        part |= {
            "paths": list(paths),
            "command": tests.command,
            "returncode": tests.returncode,
            "counts": tests.counts,
            "outcomes": tests.outcomes,
        }
        passed, summary = tests.passed, f"pytest -m gpu: {tests.summary()}"
    else:
        with tempfile.TemporaryDirectory() as scratch:
            rows = run_ladder(Path(scratch))
        part |= {"command": env["command"], "rows": rows}
        passed = bool(rows) and all(r.get("status") == "ok" for r in rows)
        summary = ", ".join(f"{r['name']} {r.get('status')}" for r in rows) or "no rows"
    path = folder / PARTS / part_name(kind, paths)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(part, indent=2))
    print(f"\n[gpu_check] {summary}\n[gpu_check] wrote {path}", flush=True)
    return 0 if passed else 1


def gpu_folder(out_dir: Path, gpu: str) -> Path:
    """`out_dir`'s folder for the GPU named `gpu` (a name or its slug), which must exist."""
    folder = out_dir / ladder_results.slug(gpu)
    if not folder.is_dir():
        there = sorted(p.name for p in out_dir.iterdir() if p.is_dir()) if out_dir.is_dir() else []
        raise Refusal(f"no {folder}: the GPU folders in {out_dir} are {', '.join(there) or 'none'}")
    return folder


def read_parts(folder: Path) -> dict[str, dict[str, Any]]:
    """The parts in `folder`/check_parts by file name; there must be some."""
    parts = {p.name: json.loads(p.read_text()) for p in sorted((folder / PARTS).glob("*.json"))}
    if not parts:
        raise Refusal(
            f"no parts in {folder / PARTS}: run --part tests and --part ladder on the GPU"
        )
    return parts


def check_parts(parts: dict[str, dict[str, Any]]) -> None:
    """Refuses parts that do not make one check: from an uncommitted tree or several commits (the
    numbers would belong to no commit), without the ladder, or with a test failed."""
    commits = {name: part["commit"] for name, part in parts.items()}
    dirty = [f"{name} ({commit})" for name, commit in commits.items() if DIRTY in commit]
    if dirty:
        raise Refusal(f"parts from a tree with uncommitted changes: {', '.join(dirty)}")
    if len(set(commits.values())) > 1:
        named = ", ".join(f"{name} {commit}" for name, commit in commits.items())
        raise Refusal(f"parts from different commits: {named}")
    if not any(part["kind"] == "ladder" for part in parts.values()):
        raise Refusal("no ladder part: run --part ladder on the GPU")
    for name, part in parts.items():
        if part["kind"] == "tests" and part["returncode"] != 0:
            counts = ", ".join(f"{n} {what}" for what, n in part["counts"].items())
            raise Refusal(f"{name} failed (pytest exit {part['returncode']}: {counts or '-'})")


def check_coverage(parts: dict[str, dict[str, Any]], collected: Sequence[str]) -> None:
    """Refuses test parts that together leave a collected test unrun: a path left out of every
    part, or a GPU test added after they ran."""
    covered = {
        node
        for part in parts.values()
        if part["kind"] == "tests"
        for node, outcome in part["outcomes"].items()
        if outcome in COVERED
    }
    missing = [node for node in collected if node not in covered]
    if missing:
        more = ", ..." if len(missing) > SHOWN else ""
        raise Refusal(
            f"{len(missing)} of the {len(collected)} GPU tests collected here are in no part: "
            f"{', '.join(missing[:SHOWN])}{more}"
        )


def summed(tests: Sequence[dict[str, Any]]) -> PytestRun:
    """The test parts as one pytest run: their counts added, their commands listed."""
    counts: dict[str, int] = {}
    for part in tests:
        for what, n in part["counts"].items():
            counts[what] = counts.get(what, 0) + n
    returncode = max((part["returncode"] for part in tests), default=0)
    return PytestRun(returncode, counts, "; ".join(part["command"] for part in tests))


def assemble(folder: Path, accept: bool) -> bool:
    """Judges the parts in `folder` as one check (no GPU needed) and, when it passes, writes
    check.json and deletes the parts; refuses parts that do not make one check."""
    parts = read_parts(folder)
    check_parts(parts)
    check_coverage(parts, collected_ids())
    tests = [part for part in parts.values() if part["kind"] == "tests"]
    ladder = next(part for part in parts.values() if part["kind"] == "ladder")
    check = folder / "check.json"
    run = summed(tests)
    passed = conclude(check, ladder["environment"], run, ladder["rows"], accept, [*tests, ladder])
    if passed:
        for name in parts:
            (folder / PARTS / name).unlink()
        if not any((folder / PARTS).iterdir()):
            (folder / PARTS).rmdir()
        print(f"[gpu_check] deleted the {len(parts)} parts it assembled", flush=True)
    return passed


def parse(argv: list[str]) -> argparse.Namespace:
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
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--part",
        choices=["tests", "ladder"],
        help="run one part on this GPU and write it to <out-dir>/<gpu>/check_parts",
    )
    mode.add_argument(
        "--assemble",
        action="store_true",
        help="judge the parts in <out-dir>/<gpu>/check_parts as one check (no GPU needed)",
    )
    parser.add_argument("--gpu", help="with --assemble: the GPU's folder (nvidia-h200) or name")
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="PYTEST_PATH",
        help="with --part tests: the test files or folders to run (default: all of tests/)",
    )
    args = parser.parse_intermixed_args(argv)
    if args.paths and args.part != "tests":
        parser.error("test paths go with --part tests")
    if args.assemble != bool(args.gpu):
        parser.error("--assemble needs --gpu NAME, and --gpu needs --assemble (a GPU names itself)")
    if args.part and args.accept:
        parser.error("--accept goes with the whole check or --assemble, not a part")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    out_dir = Path(args.out_dir)
    if args.assemble:
        try:
            return 0 if assemble(gpu_folder(out_dir, args.gpu), args.accept) else 1
        except Refusal as refusal:
            raise SystemExit(f"gpu_check.py: cannot assemble: {refusal}") from None
    require_gpu()
    folder = out_dir / ladder_results.slug(device_name())
    if args.part:
        return run_part(args.part, args.paths, folder, argv)
    env = environment(["python", "scripts/gpu_check.py", *argv])
    tests = run_tests()
    with tempfile.TemporaryDirectory() as scratch:
        rows = run_ladder(Path(scratch))
    return 0 if conclude(folder / "check.json", env, tests, rows, args.accept) else 1
