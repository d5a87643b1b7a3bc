"""The statistics of the measurements: a row as the median of its runs with their min–max and a
bootstrap interval, the tokens/s ratio of two rows paired run by run (within noise when its
interval includes 1.00x), per-GPU efficiency, and the difference of two arms' mean losses
(Welch's t-test, or a seeded bootstrap without scipy)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np
from omegaconf import DictConfig

# The per-step numbers, from the run's summary.json: (column, summary key).
NUMBERS = (
    ("tokens_per_sec", "perf/tokens_per_sec"),
    ("tokens_per_sec_p10", "perf/tokens_per_sec_p10"),
    ("tokens_per_sec_p90", "perf/tokens_per_sec_p90"),
    ("mfu", "perf/mfu"),
    ("step_ms", "perf/step_ms"),
    ("peak_allocated_gib", "mem/peak_allocated_gib"),
    ("peak_reserved_gib", "mem/peak_reserved_gib"),
    ("train_loss", "train/loss"),
    ("val_loss", "val/loss"),
    ("measured_steps", "perf/measured_steps"),
    # Cold start, goodput, and over the measured steps: input waits, energy and the GPU's busy
    # share (null where the trainer does not report them). Not perf/data_wait_ms and the like:
    # those are the last log window's.
    ("first_step_s", "first_step_s"),
    ("compile_s", "compile_s"),
    ("goodput", "goodput"),
    ("data_wait_ms", "data_wait_ms"),
    ("joules_per_token", "joules_per_token"),
    ("gpu_busy", "gpu_busy"),
)
# A run diverged when its last logged training loss ends this far above its lowest: its tokens/s
# then time a broken model, not the step (on an H100, bf16 runs that diverged ran 5.5% faster
# than converged runs of the same command: docs/results/.../speed_bf16_cache.md).
DIVERGED = 0.10

RESAMPLES = 10_000  # difference_of_means's bootstrap, without scipy


def diverged(rise: float | None) -> bool:
    """Whether a run's `loss_rise` (see loss_rise) says it diverged."""
    return rise is not None and rise > DIVERGED


def _median(values: list) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def bootstrap_ci(values: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """A 95% confidence interval of the median (percentile bootstrap, seeded: reproducible)."""
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, size=(resamples, len(values))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return [float(low), float(high)]


def aggregate(runs: list[dict], call: str) -> dict[str, Any]:
    """A step's row from its runs: every number the median over the runs that completed, with
    tokens/s per run, their min–max `interval` and, from 3 runs, `ci95` (a bootstrap 95% CI of
    the median); the status and error of the first run that did not complete, if one did not."""
    done = [r for r in runs if r["status"] == "ok"]
    failed = next((r for r in runs if r["status"] != "ok"), None)
    row = {k: v for k, v in (failed or runs[0]).items() if k != "repeat"}
    for column in [*(c for c, _ in NUMBERS), "wall_s"]:
        row[column] = _median([r.get(column) for r in (done or runs)])
    tps = [r["tokens_per_sec"] for r in done if r.get("tokens_per_sec") is not None]
    rises = [r.get("loss_rise") for r in done]
    row.update(
        call=call,
        repeats=len(done),
        tokens_per_sec_runs=tps,
        train_loss_runs=[r.get("train_loss") for r in done],
        loss_rise=max((x for x in rises if x is not None), default=None),
        diverged_runs=sum(map(diverged, rises)),
        interval=[min(tps), max(tps)] if tps else None,
        ci95=bootstrap_ci(tps) if len(tps) >= 3 else None,
    )
    return row


def comparisons(
    ladder: DictConfig, rows: list[dict]
) -> list[tuple[dict, dict | None, dict | None]]:
    """Each row with the ones it is compared with: the last row above it that ran, and the
    baseline (the step the row's ladder step names as its `vs`, else the ladder's `reference`
    row, else step 0), None where there is none."""
    ok = [r for r in rows if r["status"] == "ok"]
    reference = ladder.get("reference")
    if reference:
        baseline = next((r for r in ok if r["name"] == reference), None)
    else:
        baseline = ok[0] if ok and ok[0].get("index") == 0 else None
    versus = compared_with(ladder)
    out: list[tuple[dict, dict | None, dict | None]] = []
    previous = None
    for row in rows:
        vs = versus.get(row["name"])
        own = next((r for r in ok if r["name"] == vs), None) if vs else baseline
        out.append((row, previous, own))
        if row["status"] == "ok":
            previous = row
    return out


def compared_with(ladder: DictConfig) -> dict[str, str]:
    """The steps that name the step their gains compare with (`vs:`), instead of the baseline:
    a lever measured on top of another step's settings (float8 with tuned kernels against
    bfloat16 with the same tuning)."""
    return {step.name: step.vs for step in ladder.get("steps", []) if step.get("vs")}


def speed_ratio(row: dict, other: dict | None, anchors: dict[str, dict]) -> dict | None:
    """The row's tokens/s over the other's. Runs of one call pair up, repeat i with repeat i
    (they ran side by side): the ratio is the median of the per-repeat ratios, the interval
    their min–max; a row measured in another call is stood in for by this call's anchor when
    it is that step. Else the rows ran in different calls, perhaps on machines 2-5% apart
    (`across_calls`): the ratio of medians, with no interval and no verdict on noise, as one
    call's spread says nothing of another machine's. `within_noise`: the interval includes 1.00x
    (None with a single run: nothing to judge)."""
    if row["status"] != "ok" or not other or other["status"] != "ok":
        return None
    beside = measured_beside(row, other, anchors)
    mine, theirs = _runs(row), _runs(beside)
    if not mine or not theirs:
        return None
    if not same_call(row, beside):
        ratio = statistics.median(mine) / statistics.median(theirs)
        return {"vs": other["name"], "ratio": round(ratio, 4), "interval": None,
                "within_noise": None, "across_calls": True}  # fmt: skip
    if len(mine) == len(theirs):  # paired: run i of both ran side by side
        ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
        ratio, interval = statistics.median(ratios), [min(ratios), max(ratios)]
    else:
        ratio = statistics.median(mine) / statistics.median(theirs)
        interval = [min(mine) / max(theirs), max(mine) / min(theirs)]
    several = max(len(mine), len(theirs)) > 1
    return {
        "vs": other["name"],
        "ratio": round(ratio, 4),
        "interval": [round(v, 4) for v in interval],
        "within_noise": (interval[0] <= 1 <= interval[1]) if several else None,
        "across_calls": False,
    }


def measured_beside(row: dict, other: dict, anchors: dict[str, dict]) -> dict:
    """`other` as measured in `row`'s call: that call's anchor (`anchors_by_call`) where `other`
    ran in another call and the anchor is the same step and ran; else `other` itself."""
    anchor = anchors.get(row.get("call") or "")
    if anchor and anchor["name"] == other["name"] and anchor["status"] == "ok":
        return other if same_call(row, other) else anchor
    return other


def same_call(row: dict, other: dict) -> bool:
    """Whether two rows ran in one call (one machine): the same call id, or, for rows written
    before calls were recorded, the same commit."""
    if row.get("call") or other.get("call"):
        return row.get("call") == other.get("call")
    return row.get("git_commit") == other.get("git_commit")


def _runs(row: dict) -> list[float]:
    """A row's tokens/s per run (a row written before repeats: its one number)."""
    runs = row.get("tokens_per_sec_runs")
    if runs:
        return list(runs)
    return [row["tokens_per_sec"]] if row.get("tokens_per_sec") else []


def anchors_by_call(segments: Sequence[dict]) -> dict[str, dict]:
    """Each segment's anchor row (the step re-measured beside its steps), by its call."""
    return {s["call"]: s["anchor"] for s in segments if s.get("anchor")}


def with_ratios(ladder: DictConfig, rows: list[dict], segments: Sequence[dict] = ()) -> list[dict]:
    """Sets each row's `ratio` (tokens/s over the row it is compared with: the one above it in a
    cumulative ladder, else the baseline), `ratio_vs`, `ratio_interval` and `within_noise`, and
    with a `reference` row the same against it (`ratio_ref`, ...)."""
    anchors = anchors_by_call(segments)
    for row, previous, baseline in comparisons(ladder, rows):
        targets = {"": previous if ladder.cumulative else baseline}
        if ladder.get("reference"):
            targets["_ref"] = baseline
        for suffix, other in targets.items():
            # The baseline is not compared with itself (a ratio of 1 "within noise" says nothing).
            found = (speed_ratio(row, other, anchors) if other is not row else None) or {}
            row[f"ratio{suffix}"] = found.get("ratio")
            row[f"ratio{suffix}_vs"] = found.get("vs")
            row[f"ratio{suffix}_interval"] = found.get("interval")
            row[f"within_noise{suffix}"] = found.get("within_noise")
            row[f"ratio{suffix}_across_calls"] = found.get("across_calls")
    return rows


def with_efficiency(rows: list[dict], segments: Sequence[dict] = ()) -> list[dict]:
    """Sets each row's per-GPU `efficiency`: its tokens/s over `gpus` times those of the nearest
    1-GPU row above it (`efficiency_vs`), the same workload on one GPU of this host; 1.0 for a
    1-GPU row that ran; None where there is nothing to compare, also below a 1-GPU row that did
    not run (out of memory, say): the 1-GPU rows above it are another workload's. A row measured
    in a later call than that 1-GPU row is compared with its own call's anchor where the anchor
    is that step (`measured_beside`): one machine's numbers; else `efficiency_across_calls`
    says that the two ran on different machines (2-5% apart)."""
    anchors = anchors_by_call(segments)
    reference = None
    for row in rows:
        gpus = row.setdefault("gpus", row.get("nproc", 1))
        ran = row["status"] == "ok" and row.get("tokens_per_sec")
        if gpus == 1:
            reference = row if ran else None
        ref = measured_beside(row, reference, anchors) if reference else None
        ref_tps = ref["tokens_per_sec"] if ref else None
        row["efficiency"] = (
            round(row["tokens_per_sec"] / (gpus * ref_tps), 4) if ran and ref_tps else None
        )
        row["efficiency_vs"] = reference["name"] if row["efficiency"] is not None else None
        row["efficiency_across_calls"] = bool(
            row["efficiency"] is not None and ref and not same_call(row, ref)
        )
    return rows


def efficiency_reference(row: dict, rows: list[dict], segments: Sequence[dict]) -> dict | None:
    """The 1-GPU row that `row`'s efficiency is against, as measured in `row`'s call where that
    call re-measured it and profiled it too (else as the ladder has it)."""
    reference = next((r for r in rows if r["name"] == row.get("efficiency_vs")), None)
    if reference is None:
        return None
    beside = measured_beside(row, reference, anchors_by_call(segments))
    return beside if beside.get("breakdown") else reference


def spread(row: dict) -> tuple[float | None, float | None]:
    """A row's tokens/s spread: the min–max of its runs, else its one run's p10–p90."""
    if row.get("repeats", 1) > 1 and row.get("interval"):
        low, high = row["interval"]
        return low, high
    return row.get("tokens_per_sec_p10"), row.get("tokens_per_sec_p90")


# ---- two arms, and repeats of one configuration


def median_interval(values: list[float]) -> dict[str, Any]:
    """Median over repeats and its min-max interval."""
    return {
        "median": statistics.median(values) if values else None,
        "interval": [min(values), max(values)] if values else None,
        "repeats": len(values),
    }


def mean_spread(values: list[float]) -> dict[str, float | None]:
    """Mean, sample standard deviation (None for one value), min and max."""
    x = np.asarray(values, dtype=np.float64)
    std = float(x.std(ddof=1)) if len(x) > 1 else None
    return {"mean": float(x.mean()), "std": std, "min": float(x.min()), "max": float(x.max())}


def difference_of_means(
    reference: list[float], candidate: list[float], confidence: float = 0.95
) -> dict:
    """The difference of the candidate's mean final loss from the reference's, its p-value and
    `confidence` interval: Welch's t-test with scipy, else a seeded bootstrap. None for p and
    the interval with one seed in an arm (no spread to test against)."""
    a, b = np.asarray(reference, np.float64), np.asarray(candidate, np.float64)
    delta = float(b.mean() - a.mean())
    if min(len(a), len(b)) < 2:
        return {"delta": delta, "p": None, "interval": None, "test": None}
    if a.var(ddof=1) + b.var(ddof=1) == 0:  # every seed gave the same loss: no spread at all
        return {"delta": delta, "p": float(delta == 0), "interval": [delta, delta],
                "test": "exact"}  # fmt: skip
    try:
        from scipy import stats as scipy_stats
    except ImportError:
        return _bootstrap(a, b, delta, confidence)
    test = scipy_stats.ttest_ind(b, a, equal_var=False)
    low, high = test.confidence_interval(confidence)
    return {"delta": delta, "p": float(test.pvalue), "interval": [float(low), float(high)],
            "test": "welch", "df": float(test.df)}  # fmt: skip


def _bootstrap(a: np.ndarray, b: np.ndarray, delta: float, confidence: float) -> dict:
    """The difference of means resampled (each arm with replacement, a fixed seed: the same
    answer every time): its percentile interval, and the two-sided p of a zero difference."""
    rng = np.random.default_rng(0)
    draws = [rng.choice(x, size=(RESAMPLES, len(x))).mean(axis=1) for x in (a, b)]
    diffs = draws[1] - draws[0]
    tail = (1 - confidence) / 2
    low, high = np.quantile(diffs, [tail, 1 - tail])
    p = min(1.0, 2 * min(np.mean(diffs <= 0), np.mean(diffs >= 0)))
    return {"delta": delta, "p": float(p), "interval": [float(low), float(high)],
            "test": "bootstrap"}  # fmt: skip
