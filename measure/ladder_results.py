"""A ladder's results files: `<out_dir>/<device>/<ladder>.{json,csv,md,png}`, written after every
run (each file on its own: one that fails does not cost the others) with the rows of other calls
that are there at that moment, and `report=`: the chart redrawn and the table printed from a
json."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig

from base.files import read_json
from measure import ladder_chart, ladder_table, ladders, stats

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "docs" / "results"  # the shipped results: written only with publish=true


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def publish(
    ladder: DictConfig, rows: list[dict], env: dict, folder: Path, segments: Sequence[dict] = ()
) -> list[str]:
    """Writes the results; returns what could not be written. Each file is tried on its own and
    a failure is reported, not raised: a chart that cannot be drawn must not cost the steps that
    are still to run, nor the other files."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / ladder.name
    errors: list[str] = []

    def attempt(what: str, write: Callable[[], Any]) -> None:
        try:
            write()
        except Exception as e:  # noqa: BLE001 -- reported with the results, the ladder goes on
            errors.append(f"{what}: {type(e).__name__}: {e}")
            print(f"[ablate] could not write the {what}: {type(e).__name__}: {e}", flush=True)

    attempt(
        "ratios", lambda: stats.with_ratios(ladder, stats.with_efficiency(rows, segments), segments)
    )
    attempt("csv", lambda: write_csv(rows, stem.with_suffix(".csv")))
    attempt(
        "table",
        lambda: stem.with_suffix(".md").write_text(
            ladder_table.markdown(ladder, rows, env, segments)
        ),
    )
    attempt("chart", lambda: ladder_chart.chart(ladder, rows, env, stem.with_suffix(".png")))
    result = {"environment": env, "steps": rows, "segments": list(segments)}
    attempt("json", lambda: stem.with_suffix(".json").write_text(
        json.dumps({**result, "report_errors": errors}, indent=2)
    ))  # fmt: skip
    print(f"[ablate] results: {stem}.{{md,csv,json,png}}", flush=True)
    return errors


CSV_COLUMNS = [
    "index", "name", "what", "status", "stages", "nproc", "nnodes", "gpus", "memory_cap_gib",
    "strategy",
    *(c for c, _ in stats.NUMBERS), "repeats", "diverged_runs", "ratio", "ratio_vs", "within_noise",
    "efficiency", "efficiency_vs", "attention_kernel", "wall_s", "git_commit", "command", "error",
]  # fmt: skip


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "stages": "+".join(row["stages"])})


class Published(NamedTuple):
    rows: list[dict]
    segments: list[dict]
    errors: list[str]  # the files that could not be written


def publish_call(
    ladder: DictConfig,
    plans: list[dict],
    mine: dict[str, dict],
    segment: dict,
    env: dict,
    folder: Path,
) -> Published:
    """Publishes one call's rows (`mine`, by step) and its segment into the ladder's results,
    merged with the rows there *now*: another call publishing the same ladder meanwhile (a
    ladder on each GPU of one host) keeps its rows. Reading and writing hold a lock on the
    folder, so the two never interleave."""
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        kept, segments = earlier_results(folder / f"{ladder.name}.json")
        call, anchor = segment["call"], segment.get("anchor")
        if anchor:
            own = kept.get(anchor["name"])
            if own is None or own.get("call") == call:  # no row of its own yet: this is it
                kept[anchor["name"]] = anchor
        kept.update(mine)
        rows = ladders.in_ladder_order(plans, kept)
        # The segments some row still comes from, this one last (its anchor stands in for rows
        # of other calls).
        calls = {r.get("call") for r in rows}
        segments = [s for s in segments if s["call"] in calls and s["call"] != call] + [segment]
        return Published(rows, segments, publish(ladder, rows, env, folder, segments))


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def earlier_results(path: Path) -> tuple[dict[str, dict], list[dict]]:
    """The rows (by step name) and segments on disk, which a call's publication merges with."""
    if not path.exists():
        return {}, []
    result = json.loads(path.read_text())
    return {r["name"]: r for r in result["steps"]}, result.get("segments", [])


def results_dir(cfg: DictConfig) -> Path:
    """Where the results go: `out_dir` (untracked), or the shipped docs/results with
    `publish=true`, so that trying a ladder never overwrites the results the README quotes."""
    return PUBLISHED if cfg.publish else Path(cfg.out_dir)


# What `report=` reads of a results json: its rows' names, status and numbers, its segments.
MAYBE_NUMBER = (float, None)
ROW = {"name": str, "status": str, "what": str, "repeats?": int, "gpus?": int, "nnodes?": int,
       "interval?": ([float], None), "tokens_per_sec_runs?": ([float], None),
       **{f"{column}?": MAYBE_NUMBER for column, _ in stats.NUMBERS}}  # fmt: skip
RESULTS = {
    "environment": {"device": str},
    "steps": [ROW],
    "segments?": [{"call": str, "steps": [str], "anchor?": (ROW, None)}],
}


def report(path: Path) -> list[dict]:
    """Redraws the chart of a results json (`<ladder>.json`) beside it and prints its table,
    running nothing: for a chart whose drawing changed, on a machine without the GPU."""
    result = read_json(path, RESULTS, "give report= a <ladder>.json that ablate.py wrote")
    ladder = ladders.read(path.stem)
    steps = ladders.in_ladder_order(
        ladders.step_plans(ladder), {r["name"]: r for r in result["steps"]}
    )
    ladder_chart.chart(ladder, steps, result["environment"], path.with_suffix(".png"))
    table = ladder_table.markdown(ladder, steps, result["environment"], result.get("segments", []))
    print(table.split("\n## ")[0] + f"\n[ablate] chart: {path.with_suffix('.png')}", flush=True)
    return steps
