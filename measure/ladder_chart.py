"""A ladder's results as a chart: tokens/s per step with its spread (grey where within noise),
and peak memory against the ladder's target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from measure import stats


def chart(ladder: DictConfig, rows: list[dict], env: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    x = range(len(rows))
    alloc = [r.get("peak_allocated_gib") or 0 for r in rows]
    reserved = [r.get("peak_reserved_gib") or 0 for r in rows]
    has_memory = any(alloc) or any(reserved)  # a CPU ladder has none: no empty panel
    fig, axes = plt.subplots(
        1 + has_memory, 1, figsize=(max(6, 0.9 * len(rows)), 7 if has_memory else 4), sharex=True
    )
    speed, memory = (axes[0], axes[1]) if has_memory else (axes, None)
    tps = [(r.get("tokens_per_sec") or 0) / 1e3 for r in rows]
    bars = [_error_bar(r) for r in rows]
    low, high = [b[0] for b in bars], [b[1] for b in bars]
    noise = [any(r.get(k) for k in ("within_noise", "within_noise_ref")) for r in rows]
    speed.bar(
        x,
        tps,
        yerr=[low, high],
        color=["lightgray" if n else "tab:blue" for n in noise],
        hatch=["//" if n else "" for n in noise],
        edgecolor=["gray" if n else "tab:blue" for n in noise],
        capsize=3,
    )
    speed.set_ylabel("thousand tokens/s\n(median; bars: min–max of runs, or p10–p90)")
    if any(noise):
        grey = Patch(facecolor="lightgray", hatch="//", edgecolor="gray")
        speed.legend([grey], ["within noise of the row it is compared with"], loc="upper left")
    if memory is not None:
        memory_bars(memory, ladder, alloc, reserved)
    for i, row in enumerate(rows):
        if row["status"] != "ok":
            speed.annotate(row["status"], (i, 0), ha="center", va="bottom", color="red")
    (memory or speed).set_xticks(
        list(x), [f"{r['index']} {r['name']}" for r in rows], rotation=30, ha="right"
    )
    speed.set_title(f"ladder {ladder.name}: {env['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_bars(ax: Any, ladder: DictConfig, alloc: list[float], reserved: list[float]) -> None:
    """Peak allocated and reserved memory per row, and the ladder's target (`target_gib`) as a
    line: a row under it met the memory goal."""
    x = range(len(alloc))
    ax.bar([i - 0.2 for i in x], alloc, width=0.4, label="peak allocated", color="tab:orange")
    ax.bar([i + 0.2 for i in x], reserved, width=0.4, label="peak reserved", color="tab:gray")
    target = ladder.get("target_gib")
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="--", label=f"target: {target:g} GiB")
    ax.set_ylabel("GiB per GPU")
    ax.legend()


def _error_bar(row: dict) -> tuple[float, float]:
    """How far the chart's error bar reaches below and above the row's bar, in thousand tokens/s:
    never negative (matplotlib refuses that), and none where a run too short for its p10/p90 has
    no spread."""
    low, high = stats.spread(row)
    tps = row.get("tokens_per_sec")
    if tps is None or low is None or high is None:
        return 0.0, 0.0
    return max(0.0, tps - low) / 1e3, max(0.0, high - tps) / 1e3
