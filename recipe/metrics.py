"""Step timing without host-device syncs, and one set of metric names sent to three places: a
console line, `metrics.jsonl` in the run folder, and wandb (offline unless you are logged in).

Metric names (the same everywhere):
    step, train/loss, val/loss, train/lr, train/grad_norm, train/skipped_steps,
    perf/tokens_per_sec, perf/mfu (%), perf/hfu (%), perf/step_ms, perf/data_wait_ms,
    perf/joules_per_token, perf/gpu_busy (%), perf/matmul_ceiling_tflops (once, if asked),
    mem/peak_allocated_gib, mem/peak_reserved_gib
The run's summary adds wall_s, first_step_s, compile_s, compile_warm, goodput, data_wait_ms,
joules_per_token and gpu_busy (LoopMeter.summary).
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from base.distributed import Distributed, log
from base.files import write_text_atomically
from recipe.rundir import seconds_since_launch

GiB = 1024**3


class StepTimer:
    """Times optimizer steps. On a GPU it records a CUDA event after each step and reads them
    only when asked, at log points, so timing adds no synchronisation to the loop."""

    def __init__(
        self, device: torch.device, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.cuda, self.clock = device.type == "cuda", clock  # the clock on a CPU (tests: a fake)
        self._pending: list[tuple[Any, Any]] = []
        self._last: Any = None

    def _mark(self) -> Any:
        if not self.cuda:
            return self.clock()
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


class LossWindow:
    """The training loss over the steps since the last log, summed on the device so that a step
    waits for nothing (no `.item()` per step); `mean` reads it, over all ranks, and starts anew."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), device=device)
        self.micro_steps = 0

    def add(self, losses: torch.Tensor, micro_steps: int) -> None:
        """A step's summed micro-batch losses (train_step's), of `micro_steps` micro-batches."""
        self.total += losses
        self.micro_steps += micro_steps

    def mean(self, dist: Distributed) -> float:
        """The mean micro-batch loss since the last call, averaged over the ranks (a sync)."""
        value = dist.mean(self.total / self.micro_steps).item()
        self.total.zero_()
        self.micro_steps = 0
        return value


def reset_memory_peaks(device: torch.device) -> None:
    """Peaks count from here: a second run in one process (a test, a notebook) reports its own,
    not the largest of all runs so far."""
    if device.type == "cuda" and torch.cuda.is_initialized():  # else: nothing allocated yet
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(dist: Distributed) -> dict[str, float | None]:
    """Peak allocated and reserved memory of the caching allocator since the run's start, the
    largest over the ranks (a pipeline's differ: its first stage keeps the most micro-batches,
    its last the head). A collective on a GPU: every rank calls it."""
    device = dist.device
    if device.type != "cuda":
        return {"mem/peak_allocated_gib": None, "mem/peak_reserved_gib": None}
    mine = (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
    allocated, reserved = (max(peaks) for peaks in zip(*dist.gather(mine), strict=True))
    return {"mem/peak_allocated_gib": allocated / GiB, "mem/peak_reserved_gib": reserved / GiB}


def throughput(
    step_ms: list[float],
    tokens_per_step: int,
    flops_per_token: float,
    hardware_flops_per_token: float,
    peak_flops: float | None,
    world_size: int,
) -> dict[str, float | None]:
    """Tokens/s over all ranks, mean step time, and MFU and HFU (% of the summed peaks of all
    GPUs): the model's FLOPs per second, and those the GPUs do (with +opt=ac's recomputation)."""
    seconds = sum(step_ms) / 1e3
    tokens_per_sec = tokens_per_step * len(step_ms) / seconds
    out: dict[str, float | None] = {
        "perf/tokens_per_sec": tokens_per_sec,
        "perf/step_ms": seconds * 1e3 / len(step_ms),
        "perf/mfu": None,
        "perf/hfu": None,
    }
    if not peak_flops:
        return out
    peak = peak_flops * world_size
    mfu, hfu = (
        100 * tokens_per_sec * f / peak for f in (flops_per_token, hardware_flops_per_token)
    )
    if max(mfu, hfu) > 100:  # impossible: reported, it would be believed
        log(
            f"[warning] utilization {max(mfu, hfu):.0f}% > 100%: the peak ({peak / 1e12:.0f} "
            f"TFLOP/s, {world_size} GPU(s)) or the FLOPs per token ({hardware_flops_per_token:.3g})"
            " is wrong; perf/mfu and perf/hfu left out (perf.peak_tflops sets the GPU's peak)"
        )
        return out
    return out | {"perf/mfu": mfu, "perf/hfu": hfu}


def summarize(step_ms: list[float], **kwargs: Any) -> dict[str, float | None]:
    """Throughput from the median step (robust to stalls), with the 10th/90th percentile spread
    of tokens/s; for the run summary and the ablation tables."""
    median = statistics.median(step_ms)
    out = throughput([median], **kwargs)
    deciles = statistics.quantiles(step_ms, n=10) if len(step_ms) > 1 else [median] * 9
    tokens_per_s = kwargs["tokens_per_step"] * 1e3
    out["perf/tokens_per_sec_p90"] = tokens_per_s / deciles[0]
    out["perf/tokens_per_sec_p10"] = tokens_per_s / deciles[-1]
    out["perf/measured_steps"] = len(step_ms)
    return out


class LoopMeter:
    """The training loop's measurements, kept out of the loop: step times (StepTimer), the host's
    wait for batches (`batches.wait_s`, data.DeviceBatches), the GPU's energy and busy share
    (NVML), and the run's cold
    start and goodput. The loop calls `start()` when steps begin, `step()` after each step,
    `window()` at log points (its only sync) and `summary()` at the end; work that is not a step
    (logging, an evaluation, a checkpoint) runs under `with meter.paused():`. The summary's steps
    are this run's after its first `warmup_steps`. `started`: `clock()` at train()'s start, where
    goodput's wall time begins."""

    def __init__(
        self,
        device: torch.device,
        batches: Any,
        perf_args: dict[str, Any],
        *,
        warmup_steps: int,
        compiled: bool,
        started: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.timer = StepTimer(device, clock)
        self.batches, self.perf_args, self.clock = batches, perf_args, clock
        self.compiled, self.started = compiled, started
        self.first_measured = max(0, warmup_steps)  # the first measured step's index in step_ms
        self.step_ms: list[float] = []  # each step of this process, read at log points
        self.wait_ms: list[float] = []  # the host's wait for each step's batch
        self.gpu = gpu_counters(device)  # NVML's energy and utilization samples, or None
        self._waited = batches.wait_s
        self._loop_start: float | None = None  # seconds from launch to the first start()
        # At the last start(): (joules, steps, the host's clock in us), or None after a window.
        self._stretch: tuple[float | None, int, int] | None = None
        self._measured_joules, self._measured_steps = 0.0, 0
        self._measured_busy: list[float] = []  # the utilization samples of measured stretches
        self._cache = compile_cache_counts()

    def start(self) -> None:
        """Steps begin: at the loop's start, and after work that is not a step."""
        self.timer.start()
        if self._loop_start is None:  # after step 0's evaluation (its .item() syncs): GPU idle
            since_launch = seconds_since_launch()
            self._loop_start = self.clock() - self.started if since_launch is None else since_launch
        if self.gpu:
            self._stretch = (self.gpu.joules(), len(self.wait_ms), now_us())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work that is not a step (logging, an evaluation, a checkpoint): left out of the step
        times and of joules per token, the next step timed from its end."""
        yield
        self.start()

    def step(self) -> None:
        self.timer.step()
        self.wait_ms.append((self.batches.wait_s - self._waited) * 1e3)
        self._waited = self.batches.wait_s

    def window(self) -> dict[str, float | None]:
        """The steps since the last log: throughput, the host's mean wait for a batch, joules per
        token, the GPU's busy share. Waits for the GPU to finish them."""
        step_ms = self.timer.read_ms()
        self.step_ms += step_ms
        return {
            **throughput(step_ms, **self.perf_args),
            "perf/data_wait_ms": statistics.fmean(self.wait_ms[-len(step_ms) :]),
            **self._gpu_window(),
        }

    def _gpu_window(self) -> dict[str, float | None]:
        """NVML's readings over the steps since the last `start()`, after a sync (work between
        two starts, an evaluation, is left out); the stretches wholly measured add up for the
        summary. This GPU's energy per token it trained on (the ranks alike), and the mean % of
        time a kernel ran (`perf/gpu_busy`: 100 - the idle a trace would show, untraced)."""
        out: dict[str, float | None] = {"perf/joules_per_token": None, "perf/gpu_busy": None}
        if self.gpu is None or self._stretch is None or len(self.wait_ms) == self._stretch[1]:
            return out
        (then, first, since_us), self._stretch = self._stretch, None
        steps, busy = len(self.wait_ms) - first, self.gpu.busy_since(since_us)
        now = self.gpu.joules()
        joules = now - then if now is not None and then is not None else None
        if first >= self.first_measured:
            self._measured_busy += busy
            if joules is not None:
                self._measured_joules += joules
                self._measured_steps += steps
        out["perf/joules_per_token"] = None if joules is None else joules / self._tokens(steps)
        out["perf/gpu_busy"] = statistics.fmean(busy) if busy else None
        return out

    def _tokens(self, steps: int) -> float:
        return steps * self.perf_args["tokens_per_step"] / self.perf_args["world_size"]

    def summary(self) -> dict[str, Any]:
        """The run's numbers for summary.json: throughput over the measured steps, the wall time
        since train() began, cold start, goodput, the host's mean wait for a batch, joules per
        token and the GPU's busy share over the measured steps."""
        self.step_ms += self.timer.read_ms()  # steps after the last log (a stop) ran too
        measured = self.step_ms[self.first_measured :]
        out: dict[str, Any] = summarize(measured, **self.perf_args) if measured else {}
        steady = statistics.median(measured or self.step_ms[1:]) if len(self.step_ms) > 1 else None
        wall_s = self.clock() - self.started
        out["wall_s"] = wall_s
        out |= cold_start(self.step_ms, steady, self._loop_start, wall_s, self.compiled)
        out["compile_warm"] = compile_warm(self._cache) if self.compiled else None
        waits = self.wait_ms[self.first_measured :]
        out["data_wait_ms"] = statistics.fmean(waits) if waits else None
        tokens = self._tokens(self._measured_steps)
        out["joules_per_token"] = self._measured_joules / tokens if tokens else None
        busy = self._measured_busy
        out["gpu_busy"] = statistics.fmean(busy) if busy else None
        return out


def cold_start(
    step_ms: list[float],
    steady_ms: float | None,
    loop_start_s: float | None,
    wall_s: float,
    compiled: bool,
) -> dict[str, float | None]:
    """`first_step_s`: from the launch to the end of the first step (the loop's start, then the
    first step's timed length); `compile_s`: the first step's excess over a steady step (`None`
    unless compiled); `goodput`: the time in steps, the first counted as a steady one, over the
    wall time `wall_s` since train() began (evaluation, checkpoints, compile, setup are the
    rest). Without a steady step (a single step) the last two are None."""
    first_ms = step_ms[0] if step_ms else None
    out: dict[str, float | None] = {"first_step_s": None, "compile_s": None, "goodput": None}
    if first_ms is not None and loop_start_s is not None:
        out["first_step_s"] = loop_start_s + first_ms / 1e3
    if first_ms is not None and steady_ms is not None:
        excess_ms = max(0.0, first_ms - steady_ms)
        out["compile_s"] = excess_ms / 1e3 if compiled else None
        out["goodput"] = (sum(step_ms) - excess_ms) / 1e3 / wall_s
    return out


# Dynamo's counters of the on-disk compile caches (FX graphs, AOTAutograd): hits and misses.
_CACHE_COUNTERS = {
    "hits": (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit")),
    "misses": (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss")),
}


def compile_cache_counts() -> dict[str, int]:
    """Hits and misses of the compile caches so far in this process (dynamo's counters)."""
    from torch._dynamo.utils import counters

    return {
        kind: sum(counters[group][name] for group, name in keys)
        for kind, keys in _CACHE_COUNTERS.items()
    }


def compile_warm(before: dict[str, int]) -> bool | None:
    """Whether every compilation since `before` came from the cache (a warm start); None when
    nothing compiled since."""
    now = compile_cache_counts()
    hits, misses = (now[kind] - before[kind] for kind in ("hits", "misses"))
    return None if hits + misses == 0 else misses == 0


class GpuCounters:
    """NVML's counters of one GPU (`pip install nvidia-ml-py`, the `gpu` extra), read only at the
    loop's sync points: its energy (joules since the driver loaded) and its utilization samples
    (the driver samples the GPU every 1/6 s to 1 s, the period depends on the product: each sample
    is the % of its period in which a kernel ran, without a profiler's cost per launch). Either
    is None where the GPU lacks it (energy before Volta; MIG slices have neither)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle
        self.has_energy = self._works(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        self.has_busy = self._works(lambda: self._samples(0))

    def _works(self, read: Callable[[], Any]) -> bool:
        try:
            read()
        except self.nvml.NVMLError_NotFound:  # no samples yet: supported
            return True
        except self.nvml.NVMLError:
            return False
        return True

    def _samples(self, since_us: int) -> list[tuple[int, int]]:
        kind = self.nvml.NVML_GPU_UTILIZATION_SAMPLES
        _, samples = self.nvml.nvmlDeviceGetSamples(self.handle, kind, since_us)
        return [(s.timeStamp, s.sampleValue.uiVal) for s in samples]

    def joules(self) -> float | None:
        if not self.has_energy:
            return None
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3  # mJ

    def busy_since(self, since_us: int) -> list[float]:
        """The utilization samples (%) whose periods began after `since_us` (the host's wall
        clock in microseconds, NVML's time stamps): the first sample after it is dropped, as its
        period may begin before. [] when there are none or the GPU has no samples."""
        if not self.has_busy:
            return []
        try:
            samples = sorted(self._samples(since_us))
        except self.nvml.NVMLError_NotFound:
            return []
        return [float(value) for stamp, value in samples[1:] if stamp > since_us]


def now_us() -> int:
    """The host's wall clock in microseconds, the clock of NVML's sample time stamps."""
    return time.time_ns() // 1000


def gpu_counters(device: torch.device) -> GpuCounters | None:
    """NVML's counters of `device`, or None on a CPU, without pynvml, or where the GPU has
    neither an energy counter nor utilization samples."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        log("[perf] no pynvml (pip install nvidia-ml-py): joules_per_token and gpu_busy are null")
        return None
    try:
        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(device)  # CUDA_VISIBLE_DEVICES taken into account
        counters = GpuCounters(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
    except (pynvml.NVMLError, RuntimeError, ValueError) as e:  # torch: an unmapped device
        log(f"[perf] no NVML on {device} ({e}): joules_per_token and gpu_busy are null")
        return None
    if not counters.has_energy:
        log(f"[perf] no energy counter on {device}: joules_per_token is null")
    if not counters.has_busy:
        log(f"[perf] no utilization samples on {device}: gpu_busy is null")
    return counters if counters.has_energy or counters.has_busy else None


# How each metric appears on the console: label and format.
_CONSOLE = (
    ("train/loss", "loss", "{:.4f}"),
    ("val/loss", "val/loss", "{:.4f}"),
    ("val/hellaswag_acc_norm", "hellaswag", "{:.4f}"),
    ("train/lr", "lr", "{:.2e}"),
    ("train/grad_norm", "norm", "{:.2f}"),
    ("perf/step_ms", "", "{:.1f} ms"),
    ("perf/tokens_per_sec", "", "{:,.0f} tok/s"),
    ("perf/mfu", "mfu", "{:.1f}%"),
    ("perf/gpu_busy", "busy", "{:.0f}%"),
    ("mem/peak_allocated_gib", "mem", "{:.2f} GiB"),
    ("perf/checkpoint_s", "checkpoint", "{:.2f} s"),
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
        self.latest_step: dict[str, int] = {}  # and the step it was logged at
        for row in history:
            self._remember({k: v for k, v in row.items() if k != "step"}, row["step"])
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

    def _remember(self, metrics: dict[str, float | None], step: int) -> None:
        self.latest |= metrics
        self.latest_step |= dict.fromkeys(metrics, step)

    def log(self, metrics: dict[str, float | None], step: int) -> None:
        if not self.enabled:
            return
        self._remember(metrics, step)
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
        """Writes `summary.json`: the last value of every metric, updated with `summary`, and
        `val/loss_step`, the step the last val loss was measured at (a stopped run's may be older
        than its last step)."""
        summary = {**self.latest, "val/loss_step": self.latest_step.get("val/loss"), **summary}
        if not self.enabled:
            return summary
        text = json.dumps(json_safe(summary), indent=2, allow_nan=False)
        write_text_atomically(run_dir / "summary.json", text)  # never through a planted link
        self.jsonl.close()
        if self.run is not None:
            # wandb holds the last step's row until the next step or finish(), and a row sets the
            # summary's keys: written now, so that the run's numbers (the median tokens/s, ...)
            # overwrite the last window's, and wandb's summary is summary.json.
            self.run.log({}, commit=True)
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
        sync = shlex.join(["wandb", "sync", str(Path(run.dir).parent)])
        print(f"[wandb] offline run in {run.dir}; upload later: {sync}")
    return run
