"""Pictures of your own runs: training and validation loss, tokens/s and memory against steps.

    python scripts/plot.py outputs/<date>/<time>-<pid>               # one run
    python scripts/plot.py multirun/<date>/<time>-<pid>              # a sweep: its jobs compared
    python scripts/plot.py runA runB --out compare.png                # several runs

A run folder holds `metrics.jsonl`; a sweep folder (`python train.py -m ...`) holds one numbered
run folder per job beside Hydra's `multirun.yaml`. Each run is one line per panel, named by its
overrides (its `overrides.yaml`) less the ones every run shares, so a sweep's legend says what
its jobs varied. The PNG goes next to the runs: `<folder>/metrics.png` for one folder, the
folders' common parent for several (`--out` for another place). A panel with no data is left
out (memory on a CPU, validation before the first evaluation).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from launch.sweep import own_overrides
from recipe.config import OVERRIDES_FILE, saved_overrides
from recipe.rundir import METRICS, read_metrics

ROOT = Path(__file__).resolve().parents[1]

# The panels: (title, y label, [(metric, line style)]): one metric name each, as in the console,
# the JSONL file and wandb.
PANELS = (
    (
        "loss (solid: training, dashed: validation)",
        "nats",
        [("train/loss", "-"), ("val/loss", "--")],
    ),
    ("throughput", "tokens/s", [("perf/tokens_per_sec", "-")]),
    ("memory", "peak allocated GiB per GPU", [("mem/peak_allocated_gib", "-")]),
)


def runs_in(folder: Path) -> list[Path]:
    """The run folders that `folder` stands for: itself, or a sweep's jobs in job order."""
    if (folder / METRICS).is_file():
        return [folder]
    jobs = [p for p in folder.iterdir() if p.name.isdigit() and (p / METRICS).is_file()]
    if not jobs:
        raise SystemExit(
            f"plot.py: {folder}: no {METRICS} in it or in numbered job folders; give a run folder "
            "(outputs/...) or a sweep folder (multirun/...)"
        )
    return sorted(jobs, key=lambda p: int(p.name))


def overrides(run: Path) -> list[str]:
    """The command-line overrides a run was launched with (where to put it left out)."""
    path = run / OVERRIDES_FILE
    if not path.is_file():
        return []
    return [o for o in saved_overrides(path) if not o.startswith("hydra.")]


def labels(runs: list[Path]) -> list[str]:
    """Each run's name in the legend: its overrides that not every run shares (its folder's name
    where that leaves nothing, e.g. a single run)."""
    own = own_overrides([overrides(run) for run in runs])
    return [" ".join(o) or run.name for o, run in zip(own, runs, strict=True)]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """A metric's (steps, values), skipping rows that do not log it or logged null (CPU memory)."""
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def with_data(metrics: list[list[dict]]) -> list[tuple]:
    """The panels some run logged a value for: none left empty (memory on a CPU)."""
    return [p for p in PANELS if any(series(m, key)[0] for m in metrics for key, _ in p[2])]


def plot(folders: list[Path], out: Path | None = None) -> tuple[Path, list[str]]:
    """Draws the runs in `folders` (run or sweep folders); returns the PNG's path and the legend's
    run names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for folder in folders for run in runs_in(folder)]
    names = labels(runs)
    metrics = [read_metrics(run / METRICS) for run in runs]
    panels = with_data(metrics)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), sharex=True)
    axes = axes if len(panels) > 1 else [axes]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, unit, keys) in zip(axes, panels, strict=True):
        for i, (name, rows) in enumerate(zip(names, metrics, strict=True)):
            for j, (key, style) in enumerate(keys):  # a run's colour; a metric's line style
                steps, values = series(rows, key)
                label = name if j == 0 else "_nolegend_"
                ax.plot(steps, values, style, color=colors[i % len(colors)], label=label)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out = out or default_out(folders)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out, names


def default_out(folders: list[Path]) -> Path:
    """Next to the runs: in the one folder given, or in the folders' common parent."""
    if len(folders) == 1:
        return folders[0] / "metrics.png"
    return Path(os.path.commonpath([f.resolve() for f in folders])) / "compare.png"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="run folders or sweep folders")
    parser.add_argument("--out", type=Path, help="the PNG (default: next to the runs)")
    args = parser.parse_args(argv)
    for folder in args.folders:
        if not folder.is_dir():
            raise SystemExit(f"plot.py: {folder}: no such folder; give a run or sweep folder")
    out, names = plot(args.folders, args.out)
    print(f"[plot] {len(names)} run(s): {out}")
