"""Step timing without host-device syncs, and one set of metric names sent to three places: a
console line, `metrics.jsonl` in the run folder, and wandb (offline unless you are logged in).

Metric names (the same everywhere):
    step, train/loss, val/loss, train/lr, train/grad_norm, train/skipped_steps,
    perf/tokens_per_sec, perf/mfu (%), perf/step_ms, mem/peak_allocated_gib, mem/peak_reserved_gib
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

GiB = 1024**3


class StepTimer:
    """Times optimizer steps. On a GPU it records a CUDA event after each step and reads them
    only when asked, at log points, so timing adds no synchronisation to the loop."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[Any, Any]] = []
        self._last: Any = None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """Starts a new interval: at the loop's start and after work that is not a step."""
        self._last = self._mark()

    def step(self) -> None:
        mark = self._mark()
        self._pending.append((self._last, mark))
        self._last = mark

    def read_ms(self) -> list[float]:
        """Durations of the steps since the last read, in ms (waits for the last one to end)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        if not self.cuda:
            return [(end - begin) * 1e3 for begin, end in pending]
        pending[-1][1].synchronize()
        return [begin.elapsed_time(end) for begin, end in pending]


def reset_memory_peaks(device: torch.device) -> None:
    """Peaks count from here: a second run in one process (a test, a notebook) reports its own,
    not the largest of all runs so far."""
    if device.type == "cuda" and torch.cuda.is_initialized():  # else: nothing allocated yet
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device: torch.device) -> dict[str, float | None]:
    """Peak allocated and reserved memory of the caching allocator since the run's start."""
    if device.type != "cuda":
        return {"mem/peak_allocated_gib": None, "mem/peak_reserved_gib": None}
    return {
        "mem/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB,
        "mem/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB,
    }


def throughput(
    step_ms: list[float],
    tokens_per_step: int,
    flops_per_token: float,
    peak_flops: float | None,
    world_size: int,
) -> dict[str, float | None]:
    """Tokens/s over all ranks, mean step time and MFU (% of the summed peaks of all GPUs)."""
    seconds = sum(step_ms) / 1e3
    tokens_per_sec = tokens_per_step * len(step_ms) / seconds
    mfu = None
    if peak_flops:
        mfu = 100 * tokens_per_sec * flops_per_token / (peak_flops * world_size)
    return {
        "perf/tokens_per_sec": tokens_per_sec,
        "perf/step_ms": seconds * 1e3 / len(step_ms),
        "perf/mfu": mfu,
    }


def summarize(step_ms: list[float], **kwargs: Any) -> dict[str, float | None]:
    """Throughput from the median step (robust to stalls), with the 10th/90th percentile spread
    of tokens/s; for the run summary and the ablation tables."""
    median = statistics.median(step_ms)
    out = throughput([median], **kwargs)
    deciles = statistics.quantiles(step_ms, n=10) if len(step_ms) > 1 else [median] * 9
    fast, slow = throughput([deciles[0]], **kwargs), throughput([deciles[-1]], **kwargs)
    out["perf/tokens_per_sec_p90"] = fast["perf/tokens_per_sec"]
    out["perf/tokens_per_sec_p10"] = slow["perf/tokens_per_sec"]
    out["perf/measured_steps"] = len(step_ms)
    return out


# How each metric appears on the console: label and format.
_CONSOLE = (
    ("train/loss", "loss", "{:.4f}"),
    ("val/loss", "val/loss", "{:.4f}"),
    ("train/lr", "lr", "{:.2e}"),
    ("train/grad_norm", "norm", "{:.2f}"),
    ("perf/step_ms", "", "{:.1f} ms"),
    ("perf/tokens_per_sec", "", "{:,.0f} tok/s"),
    ("perf/mfu", "mfu", "{:.1f}%"),
    ("mem/peak_allocated_gib", "mem", "{:.2f} GiB"),
)


class MetricLogger:
    """Writes metrics on rank 0 only (the values are already reduced over ranks). Non-finite
    values are written as null in the JSON files (JSON has no NaN) and shown as nan on the
    console. On resume it appends to the metrics kept so far (`history`) and continues the same
    wandb run (`wandb_id`)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        max_steps: int,
        wandb_cfg: DictConfig,
        run_name: str,
        config: dict,
        wandb_id: str | None = None,
        history: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.enabled, self.max_steps = enabled, max_steps
        self._origin: tuple[float, int] | None = None  # (time, step) of the first log, for the ETA
        self.latest: dict[str, float | None] = {}  # the last value of each metric, for the summary
        for row in history:
            self.latest |= {k: v for k, v in row.items() if k != "step"}
        self.run = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115
        if wandb_cfg.mode != "disabled":
            self.run = _init_wandb(run_dir, wandb_cfg, run_name, config, wandb_id)

    @property
    def wandb_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    def log(self, metrics: dict[str, float | None], step: int) -> None:
        if not self.enabled:
            return
        self.latest |= metrics
        record = json_safe({"step": step, **metrics})
        self.jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self.jsonl.flush()
        if self.run is not None:
            self.run.log(metrics, step=step)
        parts = [f"step {step:>6}/{self.max_steps} {100 * step / self.max_steps:3.0f}%"]
        for key, label, fmt in _CONSOLE:
            if metrics.get(key) is not None:
                parts.append(f"{label} {fmt.format(metrics[key])}".strip())
        if metrics.get("train/skipped_steps"):
            parts.append(f"skipped {metrics['train/skipped_steps']}")
        if self._origin is None:
            self._origin = (time.time(), step)
        elif step > self._origin[1]:
            rate = (time.time() - self._origin[0]) / (step - self._origin[1])
            parts.append(f"eta {rate * (self.max_steps - step) / 60:.1f} min")
        print(" | ".join(parts), flush=True)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        """Writes `summary.json`: the last value of every metric, updated with `summary`."""
        summary = {**self.latest, **summary}
        if not self.enabled:
            return summary
        text = json.dumps(json_safe(summary), indent=2, allow_nan=False)
        (run_dir / "summary.json").write_text(text)
        self.jsonl.close()
        if self.run is not None:
            self.run.summary.update(summary)
            self.run.finish()
        return summary


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (null), at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _init_wandb(run_dir: Path, cfg: DictConfig, name: str, config: dict, run_id: str | None) -> Any:
    """The wandb run: online with an API key (mode auto) or when asked, offline otherwise. In
    auto mode a server that does not answer within `wandb.init_timeout_s` means offline."""
    import wandb

    mode = cfg.mode  # checked with the config (recipe/config.py): auto, online or offline here
    if mode == "auto":  # online only when an API key is configured (env or `wandb login`)
        mode = "online" if wandb.login(prompt=False, verify=False) else "offline"

    def start(mode: str) -> Any:
        settings = wandb.Settings(console="off", quiet=True, init_timeout=cfg.init_timeout_s)
        return wandb.init(
            project=cfg.project, group=cfg.group, name=name, mode=mode, config=config,  # type: ignore[arg-type]
            dir=str(run_dir), id=run_id, resume="allow" if run_id else None, settings=settings,
        )  # fmt: skip

    try:
        run = start(mode)
    except wandb.errors.Error as e:  # a timeout, a refused connection, a rejected key
        if cfg.mode != "auto" or mode != "online":
            raise
        print(f"[wandb] the server did not answer ({type(e).__name__}): logging offline instead")
        mode = "offline"
        run = start(mode)
    if mode == "offline":
        print(f"[wandb] offline run in {run.dir}; upload later: wandb sync {Path(run.dir).parent}")
    return run
