"""What each rung of a ladder changed, by kernel family: with `profile=true` (or `profile: true` in
the ladder), scripts/ablate.py runs every step once more after all its timed runs, briefly, under
`+prof=trace`, and splits the trace into step_budget.py's families (`budget()`, the one
implementation). The row gains `families_ms` (ms per recorded step: matmul, norm_elementwise,
attention, loss, optimizer, copies, communication, other, idle) and `profile` (the trace, its
window per step); the table gains "where the step's time went", each family with its change
against the row it is compared with: step_budget.md's before/after, for every rung.

Why a run of its own, after the timed ones: the profiler slows the steps it records (a callback on
every kernel launch, the CPU-side record, the trace written at the end), and the trainer's meter
would count those steps in tokens/s. Profiling the last steps of a timed run would need the meter
to leave them out and would still put the trace's export inside the run's wall time (goodput);
a separate run leaves every timed number exactly what it is without profiling, for the price of
one short run per row (start-up and compilation: Inductor's cache makes the latter cheap).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import step_budget  # a sibling script: its folder is first on sys.path
from omegaconf import DictConfig

# The families in the row and the table, largest first in a GPT-2 step (step_budget.md).
FAMILIES = ("matmul", "norm/elementwise", "attention", "loss", "optimizer", "copies",
            "communication", "other", "idle")  # fmt: skip
# The profiled run: `wait` steps (compilation, CUDA graphs, the allocator settling), WARMUP
# profiled but discarded (the profiler's own start-up), ACTIVE recorded.
WARMUP, ACTIVE = 2, 3


def enabled(cfg: DictConfig, ladder: DictConfig) -> bool:
    """`profile=true` on the command line, else the ladder's `profile`, else off. A `+prof` in
    `extra` would be added to the profiled run twice: refused before anything runs."""
    chosen = cfg.get("profile")
    on = bool(ladder.get("profile", False) if chosen is None else chosen)
    if on and any(str(o).lstrip("+~").startswith("prof") for o in cfg.extra):
        raise SystemExit(
            f"ablate.py: profile=true adds +prof=trace to a run of its own; drop the prof "
            f"override from extra={list(cfg.extra)}"
        )
    return on


def overrides(wait: int) -> list[str]:
    """The profiled run's overrides, after the step's own: a trace of ACTIVE steps after `wait` +
    WARMUP, and then nothing a ladder does not measure (no checkpoint, samples or wandb run)."""
    return [
        "+prof=trace",
        f"prof.trace.wait={wait}",
        f"prof.trace.warmup={WARMUP}",
        f"prof.trace.active={ACTIVE}",
        "prof.trace.record_shapes=false",  # a smaller trace, less overhead
        f"train.max_steps={wait + WARMUP + ACTIVE}",
        "train.checkpoint_interval=0",
        "sample.num_samples=0",
        "wandb.mode=disabled",
    ]


def key(family: str) -> str:
    """A family's name in a row (`norm/elementwise` -> `norm_elementwise`)."""
    return family.replace("/", "_")


def families(trace_path: Path) -> dict[str, Any]:
    """What a row gains from its profiled run's trace: `families_ms` (ms per recorded step, every
    family of step_budget.ORDER) and `profile` (the trace, steps recorded, window and busy time
    per step: on a GPU the kernels' time, on a CPU the operators')."""
    if not trace_path.exists():
        raise FileNotFoundError(f"the profiled run wrote no {trace_path}")
    result = step_budget.budget(json.loads(trace_path.read_text()), ACTIVE)
    return {
        "families_ms": {key(f): round(result["family_ms"][f], 3) for f in FAMILIES},
        "profile": {
            "status": "ok",
            "trace": str(trace_path),
            "steps": result["steps"],
            "step_ms": round(result["step_ms"], 3),
            "busy_ms": round(result["busy_ms"], 3),
        },
    }


def _cell(value: float | None, before: float | None) -> str:
    if value is None:
        return "–"
    if before is None:
        return f"{value:.2f}"
    return f"{value:.2f} ({value - before:+.2f})".replace("-", "−")  # a minus sign, as in print


def table(pairs: list[tuple[dict, dict | None]], anchors: dict[str, dict]) -> list[str]:
    """The markdown lines of "where the step's time went": each profiled row's families in ms per
    step with the change against the row it is compared with (`pairs`: row, that row). A row of
    an earlier call is stood in for by the anchor of the row's own call when that is its step,
    so a change comes from one machine where it can. Empty when no row was profiled."""
    profiled = [row for row, _ in pairs if row.get("families_ms")]
    failed = [
        f"- `{row['name']}`: no profile ({row['profile']['status']}): {row['profile'].get('error')}"
        for row, _ in pairs
        if (row.get("profile") or {}).get("status", "ok") != "ok"
    ]
    if not profiled:
        return ["", *failed] if failed else []
    shown = [  # the families some row spends time in, idle last
        f for f in FAMILIES if any(row["families_ms"].get(key(f), 0) >= 0.005 for row in profiled)
    ]
    lines = [
        "",
        "### Where the step's time went",
        "",
        "| # | step | profiled step ms | " + " | ".join(shown) + " |",
        "|" + "---|" * (3 + len(shown)),
    ]
    for row, other in pairs:
        if not row.get("families_ms"):
            continue
        anchor = anchors.get(row.get("call", ""))
        if other and anchor and anchor["name"] == other["name"] and anchor.get("families_ms"):
            other = anchor  # measured beside this row
        theirs = other.get("families_ms") if other else None
        window = (row.get("profile") or {}).get("step_ms")
        before = ((other or {}).get("profile") or {}).get("step_ms") if theirs else None
        cells = [_cell(window, before)] + [
            _cell(row["families_ms"].get(key(f)), theirs.get(key(f)) if theirs else None)
            for f in shown
        ]
        lines.append(f"| {row['index']} | `{row['name']}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "ms per step of one extra run per step, after the timed ones, with the profiler on "
        f"(`+prof=trace`, {ACTIVE} steps recorded; its steps are a little slower than the timed "
        "ones); in brackets the change against the row it is compared with. Families as in "
        "`scripts/step_budget.py` (on a CPU: operators' self time); idle: no kernel running.",
    ]
    return lines + (["", *failed] if failed else [])
