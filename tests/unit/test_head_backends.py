"""opt.custom_op.backend=liger|cce: the field's fused head + loss behind our operator's call
(kernels/library_heads.py). Both libraries are GPU (Triton) code and not installed here, so the
wrappers are checked against fakes with each library's exact parameter list (the fakes compute
the plain math); where a library is installed, the fakes' parameter lists are checked against
the real ones, and the real functions run on the CPU (tests/unit/library_heads_probe.py: liger in
Triton's interpreter, cut-cross-entropy through its own PyTorch implementation)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import types
from argparse import Namespace
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import opt
from base.distributed import Distributed
from base.errors import ConfigError
from helpers import ROOT, custom_op_knobs, logged, python, tiny_cfg, toy_gpt
from kernels import library_heads, linear_cross_entropy
from measure import bench_head
from model import GPT
from opt.custom_op import check_custom_op
from train import train

SINGLE = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
MODULES = {"liger": "liger_kernel.transformers.functional", "cce": "cut_cross_entropy"}


# ---- fakes with the libraries' exact parameter lists (liger-kernel 0.8.5, cut-cross-entropy
# 25.1.1), computing F.cross_entropy of the logits in float32; each records its arguments.


def fake_liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None,
    ignore_index: int = -100, lse_square_scale: float = 0.0, label_smoothing: float = 0.0,
    reduction: str = "mean", softcap=None, return_z_loss: bool = False, accum_dtype=None,
    use_token_scaling: bool = False, return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False, chunk_mem_const: int = 1):  # fmt: skip
    CALLS.append(("liger", dict(locals())))
    logits = F.linear(input, weight, bias).float()
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def fake_cce_linear_cross_entropy(e, c, targets, ignore_index: int = -100, softcap=None,
    reduction: str = "mean", shift: bool = False, filter_eps="high", impl="cce"):  # fmt: skip
    CALLS.append(("cce", dict(locals())))
    logits = (e @ c.T).float()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


CALLS: list[tuple[str, dict]] = []
FAKES: dict[str, Callable[..., torch.Tensor]] = {
    "liger": fake_liger_fused_linear_cross_entropy,
    "cce": fake_cce_linear_cross_entropy,
}
REAL = {  # backend: (module, function name), for the signature check where installed
    "liger": ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy"),
    "cce": ("cut_cross_entropy", "linear_cross_entropy"),
}


@pytest.fixture
def fake_libraries(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """Both libraries importable, as the fakes above (parent packages included)."""
    for backend, (module, function) in REAL.items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setattr(sys.modules[module], function, FAKES[backend], raising=False)
    CALLS.clear()
    return CALLS


def _not_installed(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """`import <module>` raises ImportError from now on, installed or not."""
    monkeypatch.setitem(sys.modules, MODULES[backend], None)


def _loss_and_grads(model: GPT, idx: torch.Tensor, targets: torch.Tensor):
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


# ---- the knob


@pytest.mark.parametrize("backend", ["liger", "cce"])
def test_a_missing_library_is_refused_with_its_pip_line(monkeypatch, backend: str) -> None:
    _not_installed(monkeypatch, backend)
    package, version, _ = library_heads.LIBRARIES[backend]
    with pytest.raises(ConfigError, match=f"backend={backend}: .*pip install {package}=={version}"):
        check_custom_op(custom_op_knobs(backend=backend))


def test_the_plan_refuses_a_missing_library_before_any_work(monkeypatch) -> None:
    _not_installed(monkeypatch, "cce")
    cfg = tiny_cfg("+opt=custom_op", "opt.custom_op.backend=cce")
    with pytest.raises(ConfigError, match="pip install cut-cross-entropy"):
        opt.plan(cfg, SINGLE)


def test_unknown_backend_and_float8_with_a_library_are_refused(fake_libraries) -> None:
    with pytest.raises(ConfigError, match="backend must be one of ours, liger, cce, got 'triton'"):
        opt.plan(tiny_cfg("+opt=custom_op", "opt.custom_op.backend=triton"), SINGLE)
    with pytest.raises(ConfigError, match="float8=true is our kernel's"):
        check_custom_op(custom_op_knobs(backend="liger", float8=True))
    check_custom_op(custom_op_knobs(backend="liger"))  # installed (the fake): accepted


def test_the_default_backend_is_ours_and_needs_no_library(monkeypatch) -> None:
    for backend in MODULES:
        _not_installed(monkeypatch, backend)
    assert custom_op_knobs().backend == "ours"
    assert toy_gpt(chunk_size=0).fused_loss.func is linear_cross_entropy


@pytest.mark.parametrize("backend", ["liger", "cce"])
def test_the_model_loss_reaches_the_chosen_library(fake_libraries, backend: str) -> None:
    """The spy (the fake) is called once per loss, with the real vocabulary's rows of the tied
    weight and the arguments that make it our operator's math."""
    model = toy_gpt(backend=backend)
    idx, targets = torch.randint(0, 60, (2, 8)), torch.randint(0, 60, (2, 8))
    model(idx, targets)
    assert [name for name, _ in fake_libraries] == [backend]
    args = fake_libraries[0][1]
    weight = args["weight"] if backend == "liger" else args["c"]
    assert weight.shape == (60, 16) and weight.data_ptr() == model.lm_head.weight.data_ptr()
    if backend == "liger":  # W's gradient summed in float32, as ours
        assert args["accum_dtype"] == torch.float32 and args["bias"] is None
    else:
        assert args["impl"] == "cce" and args["shift"] is False  # its Triton kernels, no shift
    model(idx)  # sampling: the plain head's logits, not the library
    assert len(fake_libraries) == 1


def test_a_run_with_the_knob_trains_through_the_library(fake_libraries, tmp_path, capsys) -> None:
    """End to end from the command line's override: the plain head's losses, every step's loss
    from the library (the fake)."""
    args = ("train.max_steps=3", "train.log_interval=1", "sample.num_samples=1",
            "wandb.mode=disabled", "train.batch_size=4")  # fmt: skip
    train(tiny_cfg(*args), tmp_path / "plain")
    train(tiny_cfg(*args, "+opt=custom_op", "opt.custom_op.backend=cce"), tmp_path / "cce")
    assert "[opt] custom_op: fused head + cross-entropy from cut-cross-entropy" in (
        capsys.readouterr().out
    )
    assert len(fake_libraries) >= 3 and {name for name, _ in fake_libraries} == {"cce"}
    for key in ("train/loss", "val/loss"):
        torch.testing.assert_close(
            logged(tmp_path / "cce", key), logged(tmp_path / "plain", key), rtol=1e-5, atol=0
        )


# ---- the same numbers as the plain head (through the fakes)


@pytest.mark.parametrize("backend", ["liger", "cce"])
def test_each_wrapper_gives_the_plain_heads_loss_and_gradients(fake_libraries, backend) -> None:
    idx, targets = torch.randint(0, 60, (2, 8)), torch.randint(0, 60, (2, 8))
    plain_loss, plain = _loss_and_grads(toy_gpt(), idx, targets)
    loss, grads = _loss_and_grads(toy_gpt(backend=backend), idx, targets)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    for name, grad in plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert not grads["transformer.wte.weight"][60:].any()  # padding rows: no gradient


@pytest.mark.parametrize("backend", ["liger", "cce"])
def test_under_autocast_the_library_gets_both_inputs_in_the_autocast_dtype(
    fake_libraries, backend: str
) -> None:
    """The libraries' kernels run in their inputs' dtype: cast as autocast casts F.linear's."""
    hidden = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(64, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = library_heads.LOSSES[backend](hidden, weight, torch.randint(0, 60, (6,)), 60)
    args = list(fake_libraries[0][1].values())
    assert args[0].dtype == args[1].dtype == torch.bfloat16
    loss.backward()
    assert weight.grad.dtype == torch.float32 and not weight.grad[60:].any()


# ---- the real libraries, where installed


@pytest.mark.parametrize("backend", ["liger", "cce"])
def test_the_fakes_have_the_real_libraries_parameter_lists(backend: str) -> None:
    module, function = REAL[backend]
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"{module} not installed")
    real = getattr(pytest.importorskip(module), function)
    names = [(p.name, p.kind) for p in inspect.signature(real).parameters.values()]
    assert [(p.name, p.kind) for p in inspect.signature(FAKES[backend]).parameters.values()] == (
        names
    )


def test_the_real_libraries_give_the_plain_heads_numbers_on_cpu() -> None:
    """tests/unit/library_heads_probe.py in a process of its own (TRITON_INTERPRET=1)."""
    installed = [b for b, m in MODULES.items() if importlib.util.find_spec(m.split(".")[0])]
    if not installed or importlib.util.find_spec("triton") is None:
        pytest.skip("neither library (with triton) is installed")
    out = subprocess.run(
        [python(), "tests/unit/library_heads_probe.py", *installed],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    for backend, (loss, grad_hidden, grad_weight, padding) in json.loads(out.stdout).items():
        assert loss < 1e-5 and grad_hidden < 1e-6 and grad_weight < 1e-6, backend
        assert padding == 0.0, backend


# ---- scripts/bench_head.py's rows for them


def test_bench_head_writes_a_not_installed_row_for_a_missing_library(monkeypatch) -> None:
    _not_installed(monkeypatch, "liger")
    _, absent = bench_head.library_variants()
    row = next(r for r in absent if r["backend"] == "liger")
    assert row["status"] == "not installed" and "pip install liger-kernel==0.8.5" in row["detail"]
    report = {
        "command": "c", "device": "cpu", "torch": "t", "triton": None, "date": "d",
        "commit": "x", "repeats": 1, "kernel": [],
        "head": [{"shape": "gpt2", "tokens": 8, "width": 4, **row}],
    }  # fmt: skip
    line = [x for x in bench_head.markdown(report).splitlines() if x.startswith("| liger-kernel")]
    assert line == [f"| liger-kernel | not installed: {row['detail']} | | | | | | |"]


def test_bench_head_times_an_installed_library_on_the_same_inputs(
    fake_libraries, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = {"liger-kernel": "0.8.5", "cut-cross-entropy": "25.1.1"}
    monkeypatch.setattr(importlib.metadata, "version", versions.__getitem__)
    variants, absent = bench_head.library_variants()
    assert absent == [] and [name for name, _, _ in variants] == [
        "liger-kernel 0.8.5", "cut-cross-entropy 25.1.1"
    ]  # fmt: skip
    cpu = torch.device("cpu")
    pool = [bench_head.make_inputs(16, 8, cpu, seed) for seed in range(2)]
    ref = bench_head.float32_reference(pool[0])
    args = Namespace(repeats=2)
    for name, step, knobs in variants:
        row = bench_head.run_variant(name, step, pool, ref, args, 1.0, cpu, **knobs)
        assert "error" not in row and row["ms"] > 0, row
        assert max(row["rel_error"].values()) < 1e-2, row  # bfloat16 against float32


# ---- on a GPU (`pytest -m gpu tests/unit/test_head_backends.py`, with the libraries installed)


def _on_gpu_with(backend: str):
    """Marks a test `gpu`; skips it without CUDA or without `backend`'s library."""
    reason = "needs a CUDA GPU" if not torch.cuda.is_available() else library_heads.missing(backend)
    return pytest.param(
        backend, marks=[pytest.mark.gpu, pytest.mark.skipif(bool(reason), reason=str(reason))]
    )


GPU_BACKENDS = [_on_gpu_with(backend) for backend in MODULES]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_each_library_matches_the_plain_head_in_bfloat16_at_gpt2_width(backend: str) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (0.02 * torch.randn(50304, 768, device="cuda")).bfloat16().requires_grad_()
    targets = torch.randint(0, 50257, (4096,), device="cuda")
    mask = torch.zeros(50304, device="cuda", dtype=torch.bfloat16)
    mask[50257:] = float("-inf")
    plain = F.cross_entropy(F.linear(hidden, weight, mask).float(), targets)
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    loss = library_heads.LOSSES[backend](hidden, weight, targets, 50257)
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, plain, rtol=2e-3, atol=0)
    for name, a, b in zip(("hidden", "weight"), grads, plain_grads, strict=True):
        assert a.dtype == torch.bfloat16, name
        error = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert error < 2e-2, (name, error)
    assert not grads[1][50257:].any()


@pytest.mark.parametrize("stages", ["+opt=[amp]", "+opt=[amp,compile]"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_training_with_each_library_on_the_gpu(tmp_path, backend: str, stages: str) -> None:
    """The knob in a bfloat16 run (eager, and compiled: whether the library's autograd function
    compiles, with or without graph breaks): the plain head's losses, within bfloat16's."""
    import torch._dynamo

    args = ("device=cuda", "train.log_interval=1", "sample.num_samples=0", "wandb.mode=disabled",
            "train.max_steps=4", "model.block_size=256", "train.batch_size=16",
            "opt.amp.dtype=bfloat16")  # fmt: skip
    library = [stages.replace("[amp", "[custom_op,amp"), f"opt.custom_op.backend={backend}"]
    for name, overrides in [("plain", [stages]), (backend, library)]:
        torch._dynamo.reset()
        train(tiny_cfg(*args, *overrides), tmp_path / name)
    torch._dynamo.reset()
    torch.testing.assert_close(
        logged(tmp_path / backend, "train/loss"), logged(tmp_path / "plain", "train/loss"),
        rtol=1e-2, atol=0,
    )  # fmt: skip
