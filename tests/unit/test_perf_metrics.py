"""The loop's cost measurements (recipe/metrics.py's LoopMeter): cold start, compile seconds and
goodput from a fake clock, the host's wait for batches, joules per token and the GPU's busy share
from a fake NVML, and the compile cache's warm start across two launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import recipe.metrics
import train as train_module
from helpers import PERF_ARGS, ROOT, TINY, FakeBatches, FakeClock, logged, make_cfg, tiny_run
from opt.compile import apply_compile
from recipe.metrics import LoopMeter, gpu_counters

CPU = torch.device("cpu")


def _meter(clock: FakeClock, batches: FakeBatches, **kwargs) -> LoopMeter:
    args = dict(warmup_steps=2, compiled=True, started=clock())
    return LoopMeter(CPU, batches, PERF_ARGS, clock=clock, **(args | kwargs))


def _run_steps(meter: LoopMeter, clock: FakeClock, seconds: list[float], wait_s: float) -> None:
    for s in seconds:
        meter.batches.wait_s += wait_s
        clock.now += s
        meter.step()


def test_first_step_compile_and_goodput_from_a_fake_clock(monkeypatch) -> None:
    monkeypatch.setattr(recipe.metrics, "seconds_since_launch", lambda: 5.0)
    clock, batches = FakeClock(), FakeBatches()
    meter = _meter(clock, batches)
    clock.now = 2.0  # setup: data, model, the first evaluation
    meter.start()
    _run_steps(meter, clock, [1.0, 0.1, 0.1, 0.1, 0.1], wait_s=0.02)  # the first step compiles
    window = meter.window()
    assert window["perf/step_ms"] == pytest.approx(1400 / 5)
    assert window["perf/data_wait_ms"] == pytest.approx(20)
    clock.now += 1.0  # an evaluation: not a step
    meter.start()
    _run_steps(meter, clock, [0.1, 0.1, 0.1, 0.1], wait_s=0.02)
    meter.window()
    clock.now += 0.5  # the final checkpoint
    summary = meter.summary()
    assert summary["perf/measured_steps"] == 7  # steps 2..8
    assert summary["perf/step_ms"] == pytest.approx(100)
    assert summary["first_step_s"] == pytest.approx(5.0 + 1.0)  # launch -> loop, then the step
    assert summary["compile_s"] == pytest.approx(0.9)  # 1.0 s against a steady 0.1 s
    wall = 2.0 + 1.4 + 1.0 + 0.4 + 0.5
    assert summary["wall_s"] == pytest.approx(wall)
    assert summary["goodput"] == pytest.approx(9 * 0.1 / wall)  # the first step as a steady one
    assert summary["data_wait_ms"] == pytest.approx(20)
    assert summary["compile_warm"] is None  # nothing compiled
    assert summary["joules_per_token"] is None  # no GPU


def test_first_step_counts_from_train_without_proc_and_compile_needs_compile(monkeypatch) -> None:
    monkeypatch.setattr(recipe.metrics, "seconds_since_launch", lambda: None)
    clock, batches = FakeClock(), FakeBatches()
    clock.now = 10.0
    meter = _meter(clock, batches, compiled=False, warmup_steps=1)
    clock.now += 3.0
    meter.start()
    _run_steps(meter, clock, [0.5, 0.2, 0.2], wait_s=0.0)
    summary = meter.summary()  # a stop before the first log: the steps are read here
    assert summary["perf/measured_steps"] == 2
    assert summary["first_step_s"] == pytest.approx(3.5)
    assert summary["compile_s"] is None
    assert summary["goodput"] == pytest.approx(0.6 / 3.9)
    assert summary["data_wait_ms"] == 0


class FakeNVML(types.ModuleType):
    """pynvml's calls that recipe.metrics makes: the energy counter in millijoules, and the
    utilization samples ((time stamp in us, %) each) after a time stamp, as NVML's."""

    NVML_GPU_UTILIZATION_SAMPLES = 1

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):  # noqa: N801 (pynvml's name)
        pass

    def __init__(self, energy: bool = True, samples: bool = True) -> None:
        super().__init__("pynvml")
        self.millijoules, self.energy, self.has_samples = 0, energy, samples
        self.samples: list[tuple[int, int]] = []
        self.handles: list[int] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.handles.append(index)
        return f"gpu{index}"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        if not self.energy:
            raise self.NVMLError("Not Supported")
        return self.millijoules

    def nvmlDeviceGetSamples(self, handle: str, kind: int, since_us: int):
        if not self.has_samples:
            raise self.NVMLError("Not Supported")
        assert kind == self.NVML_GPU_UTILIZATION_SAMPLES
        found = [(t, v) for t, v in reversed(self.samples) if t > since_us]  # any order
        if not found:
            raise self.NVMLError_NotFound("Not Found")
        value = types.SimpleNamespace
        return 1, [value(timeStamp=t, sampleValue=value(uiVal=v)) for t, v in found]


def _nvml_meter(monkeypatch, nvml: FakeNVML) -> tuple[LoopMeter, FakeClock]:
    """A meter on the CPU (its step timer) with `nvml`'s counters, as on GPU 0."""
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    clock = FakeClock()
    monkeypatch.setattr(recipe.metrics, "now_us", lambda: int(clock.now * 1e6))
    meter = _meter(clock, FakeBatches())
    meter.gpu = gpu_counters(torch.device("cuda", 0))
    assert nvml.handles == [0]
    return meter, clock


def test_joules_per_token_from_nvmls_energy_counter(monkeypatch) -> None:
    nvml = FakeNVML()
    meter, clock = _nvml_meter(monkeypatch, nvml)

    def steps(n: int, joules_each: float) -> None:
        for _ in range(n):
            nvml.millijoules += int(joules_each * 1e3)
            clock.now += 0.1
            meter.step()

    meter.start()
    steps(2, joules_each=50.0)  # warm-up: left out of the summary
    assert meter.window()["perf/joules_per_token"] == pytest.approx(50 / 128)
    meter.start()
    steps(4, joules_each=3.0)
    assert meter.window()["perf/joules_per_token"] == pytest.approx(3 / 128)
    meter.start()
    nvml.millijoules += 99_000  # an evaluation between two starts: not a step's energy
    meter.start()
    steps(2, joules_each=5.0)
    assert meter.window()["perf/joules_per_token"] == pytest.approx(5 / 128)
    assert meter.summary()["joules_per_token"] == pytest.approx((4 * 3 + 2 * 5) / (6 * 128))


def test_gpu_busy_from_nvmls_utilization_samples(monkeypatch) -> None:
    nvml = FakeNVML()
    meter, clock = _nvml_meter(monkeypatch, nvml)

    def steps(n: int, busy: list[int]) -> None:
        """n steps of 1 s; the driver samples every 0.5 s, each sample `busy` in turn."""
        for i in range(n):
            for half in range(2):
                clock.now += 0.5
                nvml.samples.append((int(clock.now * 1e6), busy[(2 * i + half) % len(busy)]))
            meter.step()

    meter.start()
    steps(2, busy=[50])  # warm-up: left out of the summary
    assert meter.window()["perf/gpu_busy"] == 50
    clock.now += 3.0  # an evaluation: the GPU idles, and the driver samples it
    nvml.samples.append((int(clock.now * 1e6), 0))
    meter.start()
    # The first sample after start() may cover time before it (here the evaluation's): dropped.
    steps(2, busy=[0, 90, 80, 100])
    assert meter.window()["perf/gpu_busy"] == pytest.approx(90)
    meter.start()
    steps(1, busy=[0, 70])
    assert meter.window()["perf/gpu_busy"] == 70
    assert meter.summary()["gpu_busy"] == pytest.approx((90 + 80 + 100 + 70) / 4)


def test_without_nvmls_counters_their_metrics_are_null(monkeypatch) -> None:
    gpu = torch.device("cuda", 0)
    assert gpu_counters(CPU) is None
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(energy=False, samples=False))  # MIG
    assert gpu_counters(gpu) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    assert gpu_counters(gpu) is None
    nvml = FakeNVML(samples=False)  # an energy counter, but no utilization samples
    meter, clock = _nvml_meter(monkeypatch, nvml)
    meter.start()
    nvml.millijoules += 1280
    clock.now += 1.0
    meter.step()
    window = meter.window()
    assert window["perf/gpu_busy"] is None and window["perf/joules_per_token"] == 0.01
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(energy=False))  # no sample taken yet
    counters = gpu_counters(gpu)
    assert counters is not None and counters.has_busy and counters.busy_since(0) == []


class SlowLoader:
    """A loader whose every batch takes `sleep_s` to arrive."""

    def __init__(self, loader, sleep_s: float) -> None:
        self.loader, self.sleep_s = loader, sleep_s

    def __iter__(self):
        for batch in self.loader:
            time.sleep(self.sleep_s)
            yield batch


def test_data_wait_is_the_loaders_delay_and_cpu_runs_have_no_joules(tmp_path, monkeypatch) -> None:
    build_loaders = train_module.build_loaders

    def slow_loaders(*args, **kwargs):
        train_loader, val_loader = build_loaders(*args, **kwargs)
        return SlowLoader(train_loader, sleep_s=0.03), val_loader

    monkeypatch.setattr(train_module, "build_loaders", slow_loaders)
    summary = tiny_run(
        tmp_path, "train.max_steps=8", "train.log_interval=4", "perf.warmup_steps=2",
        "sample.num_samples=0",
    )  # fmt: skip
    assert 30 <= summary["data_wait_ms"] < 45
    assert all(30 <= ms < 45 for ms in logged(tmp_path, "perf/data_wait_ms"))
    assert summary["joules_per_token"] is None
    assert logged(tmp_path, "perf/joules_per_token") == [None, None]
    assert summary["compile_s"] is None and summary["compile_warm"] is None
    assert summary["first_step_s"] > 0 and 0 < summary["goodput"] < 1
    saved = json.loads((tmp_path / "summary.json").read_text())
    keys = {"first_step_s", "compile_s", "goodput", "data_wait_ms", "joules_per_token"}
    assert keys <= set(saved)  # the ablation harness copies them into its rows


def test_compile_cache_dir_is_inductors(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # restored after the test
    knobs = make_cfg("+opt=compile").opt.compile
    assert knobs.cache_dir == os.environ["GPT2_RECIPE_COMPILE_CACHE"]  # apart from the data
    knobs.cache_dir = str(tmp_path / "kernels")
    apply_compile(torch.nn.Linear(2, 2), knobs)  # no autocast: the float32 graphs' folder
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kernels" / "float32")
    # One folder per autocast dtype: torch 2.11's AOTAutograd cache would hand a bfloat16 run the
    # graph a float16 run traced (its key says whether autocast is on, not in which dtype).
    apply_compile(torch.nn.Linear(2, 2), knobs, amp_dtype=torch.bfloat16)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kernels" / "bfloat16")
    assert (tmp_path / "kernels" / "bfloat16").stat().st_mode & 0o777 == 0o700  # private
    knobs.cache_dir = None  # Inductor's own default: left alone
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    apply_compile(torch.nn.Linear(2, 2), knobs)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "elsewhere")


def _compiled_launch(run_dir: Path, cache_dir: Path) -> dict:
    """`python train.py <TINY> +opt=compile ...` in its own process: a real second launch."""
    command = [
        sys.executable, "train.py", *TINY, "+opt=compile", f"opt.compile.cache_dir={cache_dir}",
        "train.max_steps=4", "train.log_interval=2", "perf.warmup_steps=1",
        "opt.compile.scope=block", "sample.num_samples=0", "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_a_second_launch_compiles_from_the_cache(tmp_path) -> None:
    cache = tmp_path / "inductor"
    cold = _compiled_launch(tmp_path / "cold", cache)
    warm = _compiled_launch(tmp_path / "warm", cache)
    assert (cache / "float32" / "fxgraph").is_dir()  # no autocast: the float32 graphs
    assert cold["compile_warm"] is False and warm["compile_warm"] is True
    assert warm["compile_s"] < cold["compile_s"] / 2
    assert warm["first_step_s"] < cold["first_step_s"]
