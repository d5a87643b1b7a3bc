"""+opt=lowbit's fused update (opt.lowbit.impl=triton, kernels/triton_adamw8bit.py): torchao's
8-bit AdamW, in one Triton launch for many tensors. Its math is torchao's: after several steps of
changing gradients and learning rates the weights, the codes and the scales equal those of
torchao's own update; a step the guard flags writes nothing. Checked in Triton's interpreter on
the CPU (when triton is installed), by Triton's compiler for an H100, and on a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
import torch

from helpers import ROOT, python

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed"
)


def _probe(device: str, interpreted: bool) -> dict[str, float]:
    """tests/unit/triton_adamw_probe.py in a process of its own (TRITON_INTERPRET is read when
    triton is first imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpreted else "0"}
    out = subprocess.run(
        [python(), "tests/unit/triton_adamw_probe.py", device],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _check(result: dict[str, float], weights: float) -> None:
    # 2 groups of 2 parameters, one call each per step: 4 steps and a skipped one; then one
    # group of 2 bfloat16 tensors, stochastic and nearest
    assert result["kernel_calls"] == 2 * 5 + 2, result
    assert result["weights_rel_error"] < weights, result
    assert result["codes_equal_fraction"] > 0.999, result  # a rounding tie may fall otherwise
    assert result["moments_rel_error"] < 0.02, result  # one code's step at most, where they differ
    assert result["skipped_step_unchanged"] == 1.0, result
    for part in ("quantized", "plain"):  # 8-bit moments, and the small tensors' unquantized
        assert result[f"nearest_triton_{part}"] == 0.0, result  # -1e-4 rounds back to 1.0
        for impl in ("triton", "torchao"):  # unbiased: the mean step survives (4 sigma band)
            assert -1.4e-4 < result[f"stochastic_{impl}_{part}"] < -0.6e-4, (impl, part, result)


@needs_triton
def test_the_fused_update_is_torchaos_in_the_interpreter() -> None:
    _check(_probe("cpu", interpreted=True), weights=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_fused_update_is_torchaos_on_the_gpu() -> None:
    _check(_probe("cuda", interpreted=False), weights=1e-5)  # inductor may fuse its math otherwise


@needs_triton
@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_the_kernels_compile_for_an_h100(param_dtype: str) -> None:
    """What the interpreter does not check: Triton's compiler (down to an sm_90 cubin with the
    ptxas that triton ships; no GPU needed) accepts both kernels."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton_adamw8bit import QBLOCK, ROWS, _adamw_8bit_kernel, _adamw_kernel

    scalars = {name: "fp32" for name in ("lr", "beta1", "beta2", "eps", "weight_decay",
                                         "bias_correction1", "bias_correction2_sqrt")}  # fmt: skip
    tables = {"table_ptr": "*i64", "work_ptr": "*i64", "param_like_ptr": f"*{param_dtype}",
              "grad_like_ptr": f"*{param_dtype}"}  # fmt: skip
    quantized = {**tables, "m_qmap_ptr": "*fp32", "v_qmap_ptr": "*fp32", "skip_ptr": "*fp32",
                 **scalars, "seed": "i32", "QBLOCK": "constexpr", "ROWS": "constexpr",
                 "STOCHASTIC_ROUND": "constexpr"}  # fmt: skip
    plain = {**tables, "moment_like_ptr": f"*{param_dtype}", "skip_ptr": "*fp32", **scalars,
             "seed": "i32", "BLOCK": "constexpr", "STOCHASTIC_ROUND": "constexpr"}  # fmt: skip
    target = GPUTarget("cuda", 90, 32)
    stochastic = param_dtype == "bf16"
    for fn, signature, constants, warps in [
        (_adamw_8bit_kernel, quantized,
         {"QBLOCK": QBLOCK, "ROWS": ROWS, "STOCHASTIC_ROUND": stochastic}, 8),
        (_adamw_kernel, plain, {"BLOCK": 1024, "STOCHASTIC_ROUND": stochastic}, 4),
    ]:  # fmt: skip
        source = ASTSource(fn=fn, signature=signature, constexprs=constants)
        compiled = triton_compile(source, target=target, options={"num_warps": warps})
        assert compiled.asm["cubin"], fn


def test_sharded_parameters_take_torchaos_update(monkeypatch) -> None:
    """A DTensor (+opt=fsdp/tp) is stepped by torchao's update, which handles its local shard;
    a plain tensor by the kernel where it runs (CUDA, or the interpreter)."""
    from torch.distributed.tensor import DTensor

    from opt.lowbit import runs_the_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plain = torch.zeros(4)
    sharded = torch.Tensor._make_wrapper_subclass(DTensor, (4,))  # the type is what counts
    assert runs_the_kernel(plain) and not runs_the_kernel(sharded)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runs_the_kernel(plain)  # a CPU tensor without the interpreter
