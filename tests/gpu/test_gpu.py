"""What only a GPU can show: pinned batches and side-stream copies, float16 autocast with a live
scaler, the fused AdamW kernel, compile modes, memory and MFU metrics. Skipped without CUDA;
run on a GPU machine with `pytest -m gpu`."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import data
import opt
from base.distributed import Distributed
from helpers import compiled_against_eager, make_cfg, tiny_cfg
from measure import step_budget
from model import GPT, GPTConfig
from recipe.guard import NonFiniteGuard
from recipe.hardware import peak_flops
from recipe.metrics import gpu_counters, now_us
from train import build_optimizer, train, train_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPU_ARGS = ("device=cuda", "train.log_interval=1", "sample.num_samples=0", "wandb.mode=disabled")


@pytest.fixture
def gpu() -> Distributed:
    return Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", 0))


def test_non_blocking_pins_batches_and_copies_on_a_side_stream(gpu) -> None:
    plan = opt.plan(tiny_cfg("+opt=[workers,non_blocking]", "opt.workers.num_workers=2"), gpu)
    assert plan.loader.pin_memory and plan.loader.non_blocking
    dataset = data.load_splits(make_cfg("data=synthetic").data, block_size=16, seed=0)["train"]
    loader = data.build_loader(
        dataset, 4, rank=0, world_size=1, seed=0, options=plan.loader, num_steps=3
    )
    assert next(iter(loader)).is_pinned()
    batches = data.DeviceBatches(loader, gpu.device, non_blocking=True)
    assert batches.copy_stream is not None and batches.copy_stream != torch.cuda.current_stream()
    inputs, targets = next(batches)
    assert inputs.is_cuda and targets.is_cuda and torch.equal(inputs[:, 1:], targets[:, :-1])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_amp_on_the_gpu(gpu, dtype: str) -> None:
    cfg = tiny_cfg("+opt=amp", f"opt.amp.dtype={dtype}")
    plan = opt.plan(cfg, gpu)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)).cuda()
    seen = set()
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = plan.grad_scaler(gpu.device)
    batch = torch.randint(0, 50257, (4, 33), device="cuda")
    guard = NonFiniteGuard(gpu.device, gpu, max_bad_steps=10)
    step = opt.build_step(cfg.opt, plan, guard, model, model, optimizer, scaler)
    _, norm = train_step(step, batch[:, :-1], batch[:, 1:], 1.0)
    assert seen == {getattr(torch, dtype)} and torch.isfinite(norm)
    assert scaler.is_enabled() == (dtype == "float16")
    if dtype == "float16":
        assert scaler.get_scale() == 65536.0


def test_fused_adamw_runs_its_kernel_on_the_gpu(gpu, monkeypatch) -> None:
    from torch.optim import adam as adam_module

    calls = []
    original = adam_module._fused_adam
    monkeypatch.setattr(
        adam_module, "_fused_adam", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    cfg = tiny_cfg("+opt=fused")
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)).cuda()
    optimizer = build_optimizer(model, cfg.train, opt.plan(cfg, gpu).optimizer_kwargs)
    model(
        torch.zeros(2, 16, dtype=torch.long, device="cuda"),
        torch.zeros(2, 16, dtype=torch.long, device="cuda"),
    )[1].backward()
    optimizer.step()
    assert calls and optimizer.defaults["fused"]


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_modes_on_the_gpu(tmp_path, mode: str) -> None:

    args = (*GPU_ARGS, "train.max_steps=4", "opt.amp.dtype=bfloat16")
    compiled = [*args, "+opt=[amp,compile]", f"opt.compile.mode={mode}"]
    counters = compiled_against_eager(tmp_path, [*args, "+opt=amp"], compiled, rtol=2e-2)
    assert counters["stats"]["unique_graphs"] >= 1


def test_gpu_metrics_are_reported(tmp_path) -> None:
    summary = train(tiny_cfg(*GPU_ARGS, "train.max_steps=12", "perf.warmup_steps=2"), tmp_path)
    assert (
        summary["mem/peak_allocated_gib"] > 0
        and summary["mem/peak_reserved_gib"] >= summary["mem/peak_allocated_gib"]
    )
    name = torch.cuda.get_device_name()
    if peak_flops(torch.device("cuda")) is not None:
        assert 0 < summary["perf/mfu"] < 100, name
    assert summary["perf/measured_steps"] == 10


def test_nvml_busy_share_tells_a_busy_gpu_from_an_idle_one() -> None:
    """perf/gpu_busy's source on this driver: samples of a GPU kept busy read near 100%, of an
    idle one near 0, with time stamps on the host's clock (now_us)."""
    pytest.importorskip("pynvml")
    counters = gpu_counters(torch.device("cuda", 0))
    assert counters is not None and counters.has_busy
    x = torch.randn(4096, 4096, device="cuda")
    busy_from, until = now_us(), time.monotonic() + 2.0
    while time.monotonic() < until:
        for _ in range(50):  # a queue of ~50 ms of work: never empty between the syncs
            x = torch.nn.functional.normalize(x @ x, dim=-1)
        torch.cuda.synchronize()
    busy = counters.busy_since(busy_from)
    idle_from = now_us()
    time.sleep(2.0)
    idle = counters.busy_since(idle_from)
    print(f"busy samples {busy}, idle samples {idle}")
    assert busy and statistics.fmean(busy) > 90
    assert idle and statistics.fmean(idle) < 10


def test_ac_saves_gpu_memory(tmp_path) -> None:
    peaks = {}
    for name, stages in [("plain", []), ("ac", ["+opt=ac"])]:
        torch.cuda.reset_peak_memory_stats()
        cfg = make_cfg(*GPU_ARGS, "model=gpt2", "train.batch_size=8", "train.max_steps=2",
                       "train.eval_sequences=8", *stages)  # fmt: skip
        peaks[name] = train(cfg, tmp_path / name)["mem/peak_allocated_gib"]
    assert peaks["ac"] < 0.8 * peaks["plain"], peaks


def test_prof_memory_writes_a_snapshot(tmp_path) -> None:
    import pickle

    train(tiny_cfg(*GPU_ARGS, "train.max_steps=4", "+prof=memory", "prof.memory.steps=2"), tmp_path)
    snapshot = pickle.loads((tmp_path / "memory_snapshot.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]


def test_prof_trace_of_the_kernels_only(tmp_path) -> None:
    """prof.trace.cpu=false: the trace holds the GPU's kernels and no CPU operator, and
    step_budget splits it over the active steps (first to last kernel)."""
    import json

    overrides = ("train.max_steps=8", "+prof=trace", "prof.trace.wait=2", "prof.trace.warmup=1",
                 "prof.trace.active=2", "prof.trace.cpu=false")  # fmt: skip
    train(tiny_cfg(*GPU_ARGS, *overrides), tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    categories = {event.get("cat") for event in trace["traceEvents"]}
    assert "kernel" in categories and "cpu_op" not in categories, categories
    result = step_budget.budget(trace, steps=2)
    assert result["timeline"] == "GPU" and 0 < result["busy_ms"] <= result["step_ms"]
