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

from omegaconf import DictConfig

from measure import step_budget

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
    """What a row gains from its profiled run's traces: `families_ms` (rank 0's ms per recorded
    step, every family of step_budget.ORDER), `profile` (the trace, steps recorded, window and
    busy time per step: on a GPU the kernels' time, on a CPU the operators') and, from a GPU,
    `breakdown` (`parallel_breakdown`: every rank's step as compute, exposed communication,
    pipeline wait and idle, and their mean over the ranks)."""
    if not trace_path.exists():
        raise FileNotFoundError(f"the profiled run wrote no {trace_path}")
    traces = [json.loads(path.read_text()) for path in rank_traces(trace_path)]
    result = step_budget.budget(traces[0], ACTIVE)
    found: dict[str, Any] = {
        "families_ms": {key(f): round(result["family_ms"][f], 3) for f in FAMILIES},
        "profile": {
            "status": "ok",
            "trace": str(trace_path),
            "steps": result["steps"],
            "step_ms": round(result["step_ms"], 3),
            "busy_ms": round(result["busy_ms"], 3),
        },
    }
    per_rank = [step_budget.parallel_breakdown(trace) for trace in traces]
    if all(parts is not None for parts in per_rank):
        found["breakdown"] = breakdown(per_rank)  # type: ignore[arg-type]
    return found


def rank_traces(trace_path: Path) -> list[Path]:
    """Rank 0's trace and, beside it, the other ranks' (recipe/profiling.py's names), by rank."""
    others = trace_path.parent.glob("trace-rank*.json")
    return [trace_path, *sorted(others, key=lambda p: int(p.stem.removeprefix("trace-rank")))]


def breakdown(per_rank: list[dict[str, float]]) -> dict[str, Any]:
    """The ranks' parts of a step, their mean (the row's numbers) and each rank's."""
    names = (*step_budget.PARTS, "comm", "step")
    mean = {k: round(sum(r[k] for r in per_rank) / len(per_rank), 3) for k in names}
    ranks = [{k: round(r[k], 3) for k in names} for r in per_rank]
    return {**mean, "ranks": ranks}


def explained_efficiency(row: dict, reference: dict) -> dict[str, float] | None:
    """How a row's per-GPU efficiency follows from its profiled step and its 1-GPU reference's:
    efficiency = (its compute share / the reference's) / (its compute per token per GPU / the
    reference's). `compute_ratio` above 1: the same tokens cost more kernel time (smaller
    matmuls under tp, FSDP's copies, recomputation); a share below the reference's: time lost
    to exposed communication, the bubble or the host. None without both breakdowns."""
    mine, theirs = row.get("breakdown"), reference.get("breakdown")
    measured = row.get("tokens_per_sec") and reference.get("tokens_per_sec")
    if not mine or not theirs or not measured:
        return None

    def compute_per_token(r: dict, parts: dict) -> float:
        tokens_per_gpu_step = r["tokens_per_sec"] * r["step_ms"] / 1e3 / r.get("gpus", 1)
        return parts["compute"] / tokens_per_gpu_step

    share = (mine["compute"] / mine["step"]) / (theirs["compute"] / theirs["step"])
    ratio = compute_per_token(row, mine) / compute_per_token(reference, theirs)
    return {"compute_share_ratio": round(share, 4), "compute_ratio": round(ratio, 4),
            "explained": round(share / ratio, 4)}  # fmt: skip


def parallel_table(pairs: list[tuple[dict, dict | None]]) -> list[str]:
    """The markdown lines of "where a parallel step's time went": for each profiled row (with the
    1-GPU row its efficiency is against) the mean over its ranks of compute, exposed
    communication, pipeline wait and idle, in ms per step and as a share of it, the compute per
    token against the reference, and the efficiency those explain beside the measured one.
    Empty when no profiled row has several GPUs."""
    shown = [(row, ref) for row, ref in pairs if row.get("breakdown") and row.get("gpus", 1) > 1]
    if not shown:
        return []
    lines = [
        "",
        "### Where a parallel step's time went",
        "",
        "| # | step | profiled step ms | compute | exposed comm | pipeline wait | idle "
        "| compute per token vs 1 GPU | explained efficiency | measured efficiency |",
        "|" + "---|" * 10,
    ]
    for row, ref in [*((r, f) for r, f in pairs if r.get("gpus", 1) == 1 and r.get("breakdown")),
                     *shown]:  # fmt: skip
        b = row["breakdown"]
        parts = [f"{b[p]:.2f} ({100 * b[p] / b['step']:.0f}%)" for p in step_budget.PARTS]
        found = explained_efficiency(row, ref) if ref and ref is not row else None
        efficiency = row.get("efficiency")
        cells = [
            str(row["index"]), f"`{row['name']}`", f"{b['step']:.2f}", *parts,
            _fmt_ratio(found, "compute_ratio"), _fmt_ratio(found, "explained"),
            "–" if efficiency is None else f"{efficiency:.3f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "The mean over a row's ranks of one extra run after the timed ones, with the profiler on "
        "every rank: ms per step and share of it. compute: some kernel other than NCCL's runs; "
        "exposed comm: a collective runs and nothing else (communication no computation hides); "
        "pipeline wait: only a send/recv runs (the stage waits for its neighbour: the bubble); "
        "idle: no kernel runs (the GPU waits for the host). Explained efficiency = (compute share "
        "/ the 1-GPU row's) / (compute per token per GPU / the 1-GPU row's): what the parts "
        "account for of the measured per-GPU efficiency (the profiler slows every step a little).",
    ]
    return lines


def _fmt_ratio(found: dict[str, float] | None, name: str) -> str:
    return "–" if found is None else f"{found[name]:.3f}"


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
