"""The sweep's callbacks (conf/config.yaml's hydra.callbacks), for `python train.py -m ...`.

`SweepStop` stops a sweep as a whole, as launch/torchrun.py stops torchrun's processes: it lets
the job that was signalled (SIGTERM, Ctrl-C) save its checkpoint and return, then ends the
process before the next job starts, with 128 + the signal's number (a sweep cut short did not
succeed) and a line saying where it stopped. `SweepTable` prints the sweep's results at its end:
one line per job. `SweepNames` records what the sweep varies, so that each job's wandb run is
named after it and all of them share one group (`job_wandb`).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from recipe.rundir import resume_command


class SweepStop(Callback):
    """Ends a sweep after a job that a stop signal (SIGTERM, Ctrl-C) ended early: without it,
    Hydra would start the remaining jobs, and a preempted sweep would run to its end and exit 0.
    The job reports the signal in its summary (`stopped_by`); single runs are left alone."""

    def __init__(self) -> None:
        self.jobs: int | None = None  # set for a sweep only

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.jobs = sweep_size(config)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.jobs is None or job_return.status != JobStatus.COMPLETED:
            return
        summary = job_return.return_value
        name = summary.get("stopped_by") if isinstance(summary, dict) else None
        if name is None:
            return
        job, run_dir = config.hydra.job.num, Path(config.hydra.runtime.output_dir)
        left = self.jobs - job - 1
        print(
            f"[train] sweep stopped by {name} after job {job} of {self.jobs}; its checkpoint is "
            f"saved (continue it: {resume_command(run_dir)})"
            + (f"; the {left} later job(s) did not start" if left else ""),
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + signal.Signals[name])  # not an Exception: Hydra lets it through


class SweepTable(Callback):
    """Prints a sweep's results when its last job ends, or when a stop signal ends it early: one
    line per job, with the overrides that job does not share with the others, its final
    validation loss, tokens/s and status. (Per job, not at Hydra's multirun end, which a failed
    job or a stop never reaches.)"""

    def __init__(self) -> None:
        self.jobs: int | None = None  # set for a sweep only
        self.rows: list[dict[str, Any]] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.jobs = sweep_size(config)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.jobs is None:
            return
        self.rows.append(job_row(config.hydra.job.num, job_return))
        if len(self.rows) == self.jobs or self.rows[-1]["status"].startswith("stopped"):
            print(sweep_table(self.rows, self.jobs), flush=True)


# The keys the sweep running in this process varies (SweepNames). Hydra's basic launcher runs
# the jobs in this process, after `on_multirun_start`: a job reads them from here because the
# config a callback sees is a copy of the one the job is given.
SWEPT: list[str] = []
NAMED_ALREADY = ("model", "opt")  # the default wandb name shows the model and the stages


class SweepNames(Callback):
    """Records the keys a sweep varies (`train.lr=1e-3,3e-3`: train.lr) for `job_wandb`."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        SWEPT[:] = sorted(
            {o.key_or_group for o in sweep_overrides(config) if o.is_sweep_override()}
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        SWEPT.clear()


def job_wandb(wandb_cfg: DictConfig, overrides: list[str], name: str, sweep_dir: str) -> dict:
    """The wandb settings of a sweep's job that the command line leaves unset: its name, `name`
    followed by the value of each key the sweep varies (`tiny-baseline-lr=0.003`: jobs that
    differ only in train.lr get different names), and one group for all the sweep's jobs, the
    sweep folder's name. Without them every job of a sweep would share one name and no group."""
    values = dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    varied = [
        f"{key.rpartition('.')[2]}={values[key]}"
        for key in SWEPT
        if key in values and key not in NAMED_ALREADY
    ]
    found: dict[str, str] = {}
    if wandb_cfg.name is None and varied:
        found["name"] = "-".join([name, *varied])
    if wandb_cfg.group is None:
        found["group"] = Path(sweep_dir).name
    return found


def job_row(num: int, job_return: JobReturn) -> dict[str, Any]:
    """A sweep job's line: its overrides, and from the summary the trainer returned, its final
    validation loss, tokens/s and how it ended."""
    summary = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
    summary = summary if isinstance(summary, dict) else {}
    if job_return.status != JobStatus.COMPLETED:
        status = "failed"
    elif summary.get("stopped_by"):
        status = f"stopped by {summary['stopped_by']}"
    else:
        status = "ok" if summary.get("completed") else "incomplete"
    return {
        "job": num,
        "overrides": list(job_return.overrides or []),
        "val_loss": summary.get("val/loss"),
        "tokens_per_sec": summary.get("perf/tokens_per_sec"),
        "status": status,
    }


def own_overrides(each: list[list[str]]) -> list[list[str]]:
    """Each list of overrides without the ones every list has: what one job of a sweep varied."""
    shared = set.intersection(*map(set, each)) if len(each) > 1 else set()
    return [[o for o in own if o not in shared] for own in each]


def sweep_table(rows: list[dict[str, Any]], jobs: int) -> str:
    names = [" ".join(o) or "-" for o in own_overrides([r["overrides"] for r in rows])]
    width = max(len("overrides"), *map(len, names))
    lines = [f"[train] sweep: {len(rows)} of {jobs} job(s) ran",
             f"  job  {'overrides':<{width}}  val/loss   tokens/s  status"]  # fmt: skip
    for row, name in zip(rows, names, strict=True):
        loss, tps = row["val_loss"], row["tokens_per_sec"]
        lines.append(
            f"  {row['job']:<3}  {name:<{width}}  {'-' if loss is None else f'{loss:.4f}':>8}"
            f"  {'-' if tps is None else f'{tps:,.0f}':>9}  {row['status']}"
        )
    return "\n".join(lines)


def sweep_overrides(config: DictConfig) -> list[Any]:
    """The sweep's overrides, parsed: conf's `hydra.sweeper.params`, then the command line's."""
    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    return OverridesParser.create().parse_overrides([*arguments, *config.hydra.overrides.task])


def sweep_size(config: DictConfig) -> int:
    """How many jobs Hydra's basic sweeper makes of the sweep's command line."""
    (jobs,) = BasicSweeper.split_arguments(sweep_overrides(config), max_batch_size=None)
    return len(jobs)
