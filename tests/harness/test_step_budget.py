"""The step budget splits a GPU trace by kernel family and counts idle gaps once."""

from __future__ import annotations

import pytest

from measure import step_budget


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur}


def test_kernels_fall_into_their_families_and_gaps_are_idle() -> None:
    trace = {
        "traceEvents": [
            _kernel("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN", 0, 40),
            _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 40, 10),
            _kernel("triton_red_fused__log_softmax_nll_loss_0", 50, 5),
            _kernel("triton_per_fused_add_native_layer_norm_3", 60, 10),  # 5 us idle before
            _kernel("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 65, 10),  # overlaps
            _kernel("Memcpy HtoD (Pageable -> Device)", 75, 5, cat="gpu_memcpy"),
            _kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 80, 20),
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # not GPU time
        ]
    }
    result = step_budget.budget(trace, steps=1)
    ms = result["family_ms"]
    assert ms["matmul"] == pytest.approx(0.040) and ms["attention"] == pytest.approx(0.010)
    assert ms["loss"] == pytest.approx(0.005) and ms["norm/elementwise"] == pytest.approx(0.010)
    assert ms["optimizer"] == pytest.approx(0.010) and ms["copies"] == pytest.approx(0.005)
    assert ms["communication"] == pytest.approx(0.020)
    assert result["step_ms"] == pytest.approx(0.100) and ms["idle"] == pytest.approx(0.005)
    assert "| matmul | 0.04 |" in step_budget.markdown({**result, "roofline_ms": {}})


def test_a_trace_without_kernels_or_operators_is_refused_with_a_reason() -> None:
    with pytest.raises(SystemExit, match="no GPU kernels or CPU operators"):
        step_budget.budget({"traceEvents": [{"cat": "python_function", "dur": 3, "ts": 0}]}, 1)


def test_the_window_is_the_recorded_steps_as_the_gpu_ran_them() -> None:
    """Kernels before or after the profiler's steps (launched in a warm-up step, or still
    queued) stay out, so per-step times equal an unprofiled step's."""
    step = {"cat": "gpu_user_annotation", "name": "ProfilerStep#7", "ts": 100, "dur": 50}
    trace = {
        "traceEvents": [
            step,
            _kernel("nvjet_gemm", 80, 30),  # started before the step: not counted
            _kernel("nvjet_gemm", 110, 20),
            _kernel("triton_poi_fused_gelu_1", 140, 5),
            _kernel("nvjet_gemm", 160, 40),  # after the step
        ]
    }
    result = step_budget.budget(trace, steps=3)  # the trace's own step count wins
    assert result["steps"] == 1 and result["step_ms"] == pytest.approx(0.050)
    assert result["family_ms"]["matmul"] == pytest.approx(0.020)
    assert result["family_ms"]["idle"] == pytest.approx(0.025)
