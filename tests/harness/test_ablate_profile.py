"""`profile=true` on a ladder: after the timed runs every step runs once more under the profiler,
its trace is split by step_budget.py's families, and the row and the table gain each family's
ms per step with its change against the row before."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import ROOT
from measure import ablate, ladder_chart, ladder_profile, ladder_results, runner, step_budget

SPEED = {"baseline": [100.0, 110.0], "bs": [200.0, 210.0], "workers": [201.0, 205.0]}
MATMUL_US = {"baseline": 40_000, "bs": 30_000, "workers": 30_300}  # per step


def _event(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def gpu_trace(matmul_us: float = 40.0, steps: int = 2, scale: float = 1.0) -> dict:
    """`steps` recorded steps of 100 (x `scale`) us on the GPU's timeline, each: a GEMM, flash
    attention, a LayerNorm after 2 us idle, the loss, AdamW after 5 us idle, a GELU, then 10 us
    idle (the GEMM's length is `matmul_us`, eating into the last gap)."""
    events = [
        _event("ProfilerStep#7", 0, 1e3, cat="user_annotation"),  # the CPU's view: not the window
        _event("aten::mm", 0, 1e3, cat="cpu_op"),  # CPU time, not the GPU's
    ]
    for step in range(steps):
        t0 = 100.0 * step
        kernels = [  # name, start, length (us)
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 0, matmul_us),
            ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", 40, 10),
            ("triton_per_fused_native_layer_norm_0", 52, 8),
            ("triton_red_fused_cross_entropy_loss_1", 60, 5),
            ("multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", 70, 10),
            ("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>", 80, 10),
        ]
        events.append(_event(f"ProfilerStep#{step}", t0, 100, cat="gpu_user_annotation"))
        events += [_event(name, t0 + start, length) for name, start, length in kernels]
    for e in events:
        e["ts"], e["dur"] = e["ts"] * scale, e["dur"] * scale
    return {"traceEvents": events}


def test_gpu_kernels_fall_into_families_and_gaps_are_idle(tmp_path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(gpu_trace()))
    found = ladder_profile.families(path)
    ms = found["families_ms"]
    expected = {"matmul": 40, "attention": 10, "norm_elementwise": 18, "loss": 5, "optimizer": 10,
                "copies": 0, "communication": 0, "other": 0, "idle": 17}  # fmt: skip
    assert ms == pytest.approx({k: v / 1e3 for k, v in expected.items()})
    assert found["profile"]["steps"] == 2 and found["profile"]["step_ms"] == pytest.approx(0.1)
    assert found["profile"]["busy_ms"] == pytest.approx(0.083)


def test_cpu_operators_count_once_under_their_outermost_family() -> None:
    """On a CPU the trace has operators, nested: each counts its self time, and the ops inside
    the optimizer's step, the loss or a linear layer count for those whatever their names."""
    cpu = "cpu_op"
    trace = {
        "traceEvents": [
            _event("ProfilerStep#3", 0, 100, cat="user_annotation"),
            _event("aten::linear", 0, 30, cpu),  # 4 us of its own
            _event("aten::t", 0, 2, cpu),
            _event("aten::addmm", 2, 26, cpu),
            _event("aten::cross_entropy_loss", 30, 15, cpu),
            _event("aten::log_softmax", 30, 8, cpu),
            _event("aten::_log_softmax", 31, 6, cpu),
            _event("aten::nll_loss_nd", 38, 6, cpu),
            _event("aten::layer_norm", 45, 10, cpu),
            _event("aten::native_layer_norm", 45, 9, cpu),
            _event("aten::gelu", 55, 5, cpu),  # then 5 us of no operator
            _event("Optimizer.step#AdamW.step", 65, 25, cat="user_annotation"),
            _event("aten::add_", 66, 4, cpu),  # elementwise by name, the optimizer's here
            _event("aten::mul_", 70, 10, cpu),
            _event("aten::mm", 92, 4, cpu) | {"tid": 2},  # another thread, in the idle time
            _event("aten::mm", 150, 10, cpu),  # after the recorded step
        ]
    }
    result = step_budget.budget(trace, steps=1)
    ms = {k: round(v * 1e3, 6) for k, v in result["family_ms"].items()}  # in us
    assert ms["matmul"] == 34 and ms["loss"] == 15 and ms["optimizer"] == 25
    assert ms["norm/elementwise"] == 15 and ms["other"] == 0 and ms["idle"] == 11
    assert result["steps"] == 1 and result["busy_ms"] == pytest.approx(0.089)
    assert result["top_kernels_ms"]["aten::addmm"] == pytest.approx(0.026)  # self time
    assert step_budget.markdown({**result, "roofline_ms": {}}).startswith(
        "CPU window 0.1 ms/step (1 steps), operators busy 0.1 ms."
    )


H100 = ROOT / "docs/results/nvidia-h100-80gb-hbm3"


@pytest.mark.parametrize("when", ["before", "after"])
def test_the_published_h100_traces_still_give_their_budgets(when: str) -> None:
    """The CPU's operator names added to the families leave a GPU trace's split as it was."""
    trace = json.loads(gzip.decompress((H100 / f"step_budget_{when}.trace.json.gz").read_bytes()))
    published = json.loads((H100 / f"step_budget_{when}.json").read_text())
    result = step_budget.budget(trace, steps=3)
    assert result["family_ms"] == pytest.approx(published["family_ms"])
    assert result["kernels_per_step"] == published["kernels_per_step"]


class FakeRuns:
    """Stands in for `launch`: a timed run answers with tokens/s, a profiled run (`-profile`
    folder) writes a GPU trace whose GEMM takes MATMUL_US[step] (x `machine`: another call on
    a slower machine); `broken` profiles fail."""

    def __init__(self, broken: tuple[str, ...] = (), machine: float = 1.0) -> None:
        self.order: list[tuple[str, str]] = []
        self.broken, self.machine = broken, machine

    def __call__(self, agents, run_dir: Path, timeout_s: float):
        _, name, *tag = run_dir.name.split("-", 2)  # <index>-<step>[-r<repeat>|-profile]
        kind = tag[0] if tag else "r0"
        self.order.append((name, kind))
        if kind != "profile":
            tps = SPEED[name][int(kind[1:])]
            return "ok", "", {"perf/tokens_per_sec": tps, "perf/step_ms": 1e3 / tps}
        command = agents[0][0]
        assert "+prof=trace" in command and "train.max_steps=15" in command
        if name in self.broken:
            return "failed", "RuntimeError: profiler exploded\n", {}
        run_dir.mkdir(parents=True, exist_ok=True)
        # 100 ms steps: the kernels of gpu_trace, in ms.
        trace = gpu_trace(matmul_us=self.machine * MATMUL_US[name] / 1e3, scale=1e3)
        (run_dir / "trace.json").write_text(json.dumps(trace))
        return "ok", "", {}


def _ablate(monkeypatch, tmp_path, fake: FakeRuns, *args: str):
    monkeypatch.setattr(runner, "launch", fake)
    monkeypatch.setattr(ladder_chart, "chart", lambda *args: None)
    argv = ["ladder=quick", f"out_dir={tmp_path / 'results'}", f"runs_dir={tmp_path / 'runs'}",
            "steps=[baseline,bs,workers]", *args]  # fmt: skip
    rows = ablate.main(argv)
    folder = tmp_path / "results" / ladder_results.slug(ablate.device_name())
    return rows, json.loads((folder / "quick.json").read_text()), (folder / "quick.md").read_text()


def test_profiled_rows_gain_families_and_the_table_their_changes(monkeypatch, tmp_path) -> None:
    fake = FakeRuns()
    rows, result, table = _ablate(monkeypatch, tmp_path, fake, "repeats=2", "profile=true")
    timed = [(name, f"r{r}") for r in range(2) for name in ("baseline", "bs", "workers")]
    profiled = [(name, "profile") for name in ("baseline", "bs", "workers")]
    assert fake.order == timed + profiled  # after every timed run: none of them is profiled
    bs = result["steps"][1]
    assert bs["families_ms"]["matmul"] == pytest.approx(30.0)
    assert bs["families_ms"]["idle"] == pytest.approx(27.0)  # the GEMM's 10 ms less are idle
    assert bs["profile"]["status"] == "ok" and bs["profile"]["step_ms"] == pytest.approx(100.0)
    assert bs["tokens_per_sec_runs"] == [200.0, 210.0]  # the timed runs' numbers only
    assert bs["profile"]["trace"].endswith("01-bs-profile/trace.json")

    part = table.split("### Where the step's time went")[1]
    header = next(line for line in part.splitlines() if line.startswith("| #"))
    assert header == ("| # | step | profiled step ms | matmul | norm/elementwise | attention | "
                      "loss | optimizer | idle |")  # fmt: skip
    baseline_line = next(line for line in part.splitlines() if "| `baseline` |" in line)
    assert "| 40.00 |" in baseline_line and "(" not in baseline_line  # nothing before it
    bs_line = next(line for line in part.splitlines() if "| `bs` |" in line)
    assert "| 30.00 (−10.00) |" in bs_line and "| 27.00 (+10.00) |" in bs_line
    workers_line = next(line for line in part.splitlines() if "| `workers` |" in line)
    assert "| 30.30 (+0.30) |" in workers_line and "| 10.00 (+0.00) |" in workers_line
    assert "### Where" in table.split("\n## Environment")[0]  # printed with the table


def test_a_segment_is_compared_with_its_anchor_profiled_beside_it(monkeypatch, tmp_path) -> None:
    _ablate(monkeypatch, tmp_path, FakeRuns(), "profile=true")
    # Another call, on a machine whose GEMMs take twice as long: workers' change is against bs
    # as profiled beside it (60.00), not against bs's row of the first call (30.00).
    fake = FakeRuns(machine=2.0)
    _, result, table = _ablate(monkeypatch, tmp_path, fake, "profile=true", "steps=[workers]")
    assert fake.order == [("bs", "r0"), ("workers", "r0"), ("bs", "profile"),
                          ("workers", "profile")]  # fmt: skip
    bs, workers = result["steps"][1], result["steps"][2]
    assert bs["families_ms"]["matmul"] == pytest.approx(30.0)  # the first call's row, kept
    assert result["segments"][-1]["anchor"]["families_ms"]["matmul"] == pytest.approx(60.0)
    assert workers["families_ms"]["matmul"] == pytest.approx(60.6)
    workers_line = next(line for line in table.splitlines() if "| 2 | `workers` | 100" in line)
    assert "| 60.60 (+0.60) |" in workers_line


def test_a_failed_profile_keeps_the_row_and_says_why(monkeypatch, tmp_path) -> None:
    rows, result, table = _ablate(monkeypatch, tmp_path, FakeRuns(broken=("bs",)), "profile=true")
    bs = result["steps"][1]
    assert bs["status"] == "ok" and bs["tokens_per_sec"] == 200.0 and "families_ms" not in bs
    assert bs["profile"] == {"status": "failed", "error": "RuntimeError: profiler exploded"}
    assert result["report_errors"] == []
    # workers is compared with bs, which has no profile: its numbers stand alone.
    part = table.split("### Where the step's time went")[1]
    workers_line = next(line for line in part.splitlines() if "| `workers` |" in line)
    assert workers_line.startswith("| 2 | `workers` | 100.00 | 30.30 |") and "(" not in workers_line
    assert "- `bs`: no profile (failed): RuntimeError: profiler exploded" in table


def test_without_profile_nothing_changes(monkeypatch, tmp_path) -> None:
    fake = FakeRuns()
    rows, result, table = _ablate(monkeypatch, tmp_path, fake)
    assert [kind for _, kind in fake.order] == ["r0"] * 3
    assert all("families_ms" not in row for row in rows) and "### Where" not in table


def test_profile_comes_from_the_command_line_or_the_ladder_and_refuses_a_second_prof() -> None:
    on, off = OmegaConf.create({"profile": True}), OmegaConf.create({})
    assert ladder_profile.enabled(OmegaConf.create({"profile": None, "extra": []}), on)
    assert not ladder_profile.enabled(OmegaConf.create({"profile": False, "extra": []}), on)
    assert ladder_profile.enabled(OmegaConf.create({"profile": True, "extra": []}), off)
    assert not ladder_profile.enabled(OmegaConf.create({"profile": None, "extra": []}), off)
    with pytest.raises(SystemExit, match=r"drop the prof override from extra=\['\+prof=trace'\]"):
        ladder_profile.enabled(OmegaConf.create({"profile": True, "extra": ["+prof=trace"]}), off)


@pytest.mark.slow
def test_a_real_cpu_ladder_records_a_trace_and_fills_the_families(tmp_path) -> None:
    argv = ["ladder=quick", "steps=[baseline]", "profile=true", "profile_wait=1",
            "extra=['wandb.mode=disabled']", f"out_dir={tmp_path / 'results'}",
            f"runs_dir={tmp_path / 'runs'}"]  # fmt: skip
    row = ablate.main(argv)[0]
    assert row["status"] == "ok" and row["profile"]["status"] == "ok", row.get("profile")
    assert (
        Path(row["profile"]["trace"]).exists() and row["profile"]["steps"] == ladder_profile.ACTIVE
    )
    families = row["families_ms"]
    assert families["matmul"] > 0 and families["optimizer"] > 0 and families["loss"] > 0
    assert families["norm_elementwise"] > 0 and families["attention"] > 0
    assert sum(families.values()) == pytest.approx(row["profile"]["step_ms"], rel=0.05)


def parallel_trace(all_reduce: tuple[float, float], send_recv: tuple[float, float]) -> dict:
    """One recorded step of 100 us on a rank's GPU: compute 0-40 and 50-70, an all-reduce and a
    send/recv at the given (start, length), nothing after 90 us."""
    kernels = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 0, 40),
        ("triton_per_fused_native_layer_norm_0", 50, 20),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", *all_reduce),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", *send_recv),
    ]
    events = [_event("ProfilerStep#3", 0, 100, cat="gpu_user_annotation")]
    events += [_event(name, start, length) for name, start, length in kernels]
    return {"traceEvents": events}


def test_a_parallel_step_splits_into_compute_exposed_comm_pipeline_wait_and_idle() -> None:
    """The all-reduce 30-55 is hidden by compute but for 40-50 (exposed); the send/recv 72-90
    runs alone (the stage waits for its neighbour: the bubble); 70-72 and 90-100 no kernel runs
    (idle); the parts add up to the step."""
    parts = step_budget.parallel_breakdown(parallel_trace((30, 25), (72, 18)))
    assert parts is not None
    expected = {"compute": 60, "exposed_comm": 10, "pipeline_wait": 18, "idle": 12,
                "comm": 25, "step": 100}  # fmt: skip
    assert parts == pytest.approx({k: v / 1e3 for k, v in expected.items()})
    assert sum(parts[p] for p in step_budget.PARTS) == pytest.approx(parts["step"])
    assert step_budget.parallel_breakdown(gpu_trace())["exposed_comm"] == 0  # no NCCL: none
    cpu_only = {"traceEvents": [_event("aten::mm", 0, 10, cat="cpu_op")]}
    assert step_budget.parallel_breakdown(cpu_only) is None  # a CPU run shows no overlap


def test_a_step_marked_on_two_streams_counts_once() -> None:
    """With a side stream copying the next batch, the profiler marks each step on both streams
    (one mark a few us long): the parts are still per step, not per mark."""
    trace = parallel_trace((30, 25), (72, 18))
    trace["traceEvents"].append(_event("ProfilerStep#3", 95, 0.01, cat="gpu_user_annotation"))
    parts = step_budget.parallel_breakdown(trace)
    assert parts is not None and parts["step"] == pytest.approx(0.1)
    assert parts["compute"] == pytest.approx(0.06)


def test_every_ranks_trace_gives_the_rows_breakdown(tmp_path) -> None:
    """A row's breakdown is the mean over the traces of its ranks (trace.json, trace-rankN.json),
    each rank's kept too: a rank that waits for the others is seen."""
    (tmp_path / "trace.json").write_text(json.dumps(parallel_trace((30, 25), (72, 18))))
    (tmp_path / "trace-rank1.json").write_text(json.dumps(parallel_trace((30, 5), (72, 2))))
    found = ladder_profile.families(tmp_path / "trace.json")["breakdown"]
    assert [r["exposed_comm"] for r in found["ranks"]] == [0.01, 0.0]
    assert [r["pipeline_wait"] for r in found["ranks"]] == [0.018, 0.002]
    assert found["exposed_comm"] == pytest.approx(0.005) and found["step"] == pytest.approx(0.1)


def test_the_parallel_table_explains_the_efficiency_by_its_parts() -> None:
    """efficiency = (compute share / the 1-GPU row's) / (compute per token per GPU / its): a row
    whose compute is 76% of its step against 95% on one GPU, at 1.1x the compute per token,
    explains 0.76 / 0.95 / 1.1 = 0.727 of the 1-GPU row's speed per GPU: its measured one."""
    one = {"index": 0, "name": "one_gpu", "gpus": 1, "tokens_per_sec": 1000.0, "step_ms": 100.0,
           "breakdown": {"compute": 95.0, "exposed_comm": 0.0, "pipeline_wait": 0.0, "idle": 5.0,
                         "comm": 0.0, "step": 100.0}}  # fmt: skip
    # 2 GPUs, 100 tokens per GPU a step as on one GPU, 1.1x the compute per token: 104.5 ms.
    two = {"index": 1, "name": "ddp", "gpus": 2, "tokens_per_sec": 0.0, "step_ms": 137.5,
           "efficiency": 0.727,
           "breakdown": {"compute": 104.5, "exposed_comm": 20.0, "pipeline_wait": 0.0,
                         "idle": 13.0, "comm": 30.0, "step": 137.5}}  # fmt: skip
    two["tokens_per_sec"] = 200 / 0.1375  # 200 tokens a step over both GPUs
    found = ladder_profile.explained_efficiency(two, one)
    assert found is not None
    assert found["compute_share_ratio"] == pytest.approx(0.8, abs=1e-4)
    assert found["compute_ratio"] == pytest.approx(1.1)
    assert found["explained"] == pytest.approx(two["tokens_per_sec"] / 2 / 1000, abs=1e-4)
    lines = ladder_profile.parallel_table([(one, one), (two, one)])
    row = next(line for line in lines if "`ddp`" in line)
    assert "20.00 (15%)" in row and "| 1.100 | 0.727 | 0.727 |" in row
    assert ladder_profile.parallel_table([(one, one)]) == []  # no parallel row: no table
