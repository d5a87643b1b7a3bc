"""+opt=custom_op: the fused head + cross-entropy (kernels/linear_cross_entropy.py) gives the plain
head's loss and gradients, under every precision and stage it composes with, is really called
(and the full logits never exist), and compiles as one graph. CPU tests run the PyTorch
reference; the Triton kernel runs here through Triton's interpreter (if triton is installed)
and on a GPU in the `gpu`-marked tests (`pytest -m gpu tests/unit/test_custom_op.py`)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import opt
from base.distributed import Distributed
from helpers import ROOT, compiled_against_eager, logged, make_cfg, python, tiny_cfg, toy_gpt
from kernels import linear_cross_entropy
from measure import bench_head
from model import GPT
from recipe.guard import NonFiniteGuard
from train import train, train_step

CPU = torch.device("cpu")
SINGLE = Distributed(rank=0, local_rank=0, world_size=1, device=CPU)
OP = torch.ops.gpt2_recipe.linear_cross_entropy.default


def _loss_and_grads(model: GPT, idx: torch.Tensor, targets: torch.Tensor, scale: float = 1.0):
    _, loss = model(idx, targets)
    (loss * scale).backward()
    return loss.detach(), {name: p.grad / scale for name, p in model.named_parameters()}


def _plain_head(hidden, weight, targets, vocab_size):
    """The plain head's math on flat inputs, the padding masked by a -inf bias as in GPT.head."""
    mask = torch.zeros(weight.shape[0], device=hidden.device)
    mask[vocab_size:] = float("-inf")
    logits = F.linear(hidden, weight, mask.to(hidden.dtype))
    return F.cross_entropy(logits.float(), targets)


# ---- the same numbers as the plain head


@pytest.mark.parametrize("chunk_size", [0, 4, 5, 16, 100])  # all, divides 16, does not, = N, > N
def test_loss_and_every_gradient_equal_the_plain_heads(chunk_size: int) -> None:
    idx, targets = torch.randint(0, 60, (2, 8)), torch.randint(0, 60, (2, 8))
    plain_loss, plain = _loss_and_grads(toy_gpt(), idx, targets)
    fused_loss, fused = _loss_and_grads(toy_gpt(chunk_size=chunk_size), idx, targets)
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=0)
    for name, grad in plain.items():  # the tied weight, and through it every other parameter
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert not fused["transformer.wte.weight"][60:].any()  # padding rows get no gradient


def test_padding_columns_are_never_predicted() -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(12, 8, requires_grad=True), torch.randn(64, 8)
    weight[50:] *= 100  # padding rows that would dominate the softmax if they were counted
    weight.requires_grad_()
    targets = torch.randint(0, 50, (12,))
    loss = linear_cross_entropy(hidden, weight, targets, vocab_size=50, chunk_size=5)
    expected = F.cross_entropy(hidden @ weight[:50].t(), targets)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    loss.backward()
    assert not weight.grad[50:].any() and weight.grad[:50].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_matches_the_plain_head(dtype: torch.dtype) -> None:
    """Under autocast hidden and weight are cast like F.linear's inputs. float16 runs with a
    GradScaler-sized loss scale, which arrives only in backward: gradients kept unnormalised
    until then must neither underflow nor overflow."""
    idx, targets = torch.randint(0, 60, (4, 8)), torch.randint(0, 60, (4, 8))
    scale = 65536.0 if dtype == torch.float16 else 1.0
    results = []
    for model in (toy_gpt(), toy_gpt(chunk_size=12)):
        with torch.autocast("cpu", dtype=dtype):
            results.append(_loss_and_grads(model, idx, targets, scale))
    (plain_loss, plain), (fused_loss, fused) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-3, atol=0)
    for name, grad in plain.items():
        assert fused[name].dtype == torch.float32 and torch.isfinite(fused[name]).all(), name
        error = (fused[name] - grad).norm() / grad.norm()
        assert error < 2e-2, (name, error.item())


def test_float8_matmuls_stay_close_to_the_plain_head() -> None:
    """float8 changes the math: e4m3 operands (3 mantissa bits) for the logits, e5m2 for the
    hidden states' gradient. The loss and the gradients stay within a few percent; the weight's
    gradient (compute dtype) is from the float8 logits' softmax, no further rounding."""
    torch.manual_seed(0)
    hidden = torch.randn(256, 64, requires_grad=True)
    weight = (0.3 * torch.randn(128, 64)).requires_grad_()
    targets = torch.randint(0, 120, (256,))
    plain = _plain_head(hidden, weight, targets, 120)
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    fused = linear_cross_entropy(hidden, weight, targets, 120, chunk_size=100, float8=True)
    fused_grads = torch.autograd.grad(fused, (hidden, weight))
    assert 0 < abs(fused.item() - plain.item()) < 2e-2 * plain.item()  # close, and not exact
    for a, b in zip(fused_grads, plain_grads, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 0.08
    assert not fused_grads[1][120:].any()


def test_float16_gradients_survive_until_the_loss_scale_arrives() -> None:
    """Probabilities of ~1e-5 over 4096 tokens: divided by N in float16 before the scale of
    65536 arrives they would underflow to 0; kept unnormalised they are as exact as the plain
    head's scaled ones."""
    hidden, weight = 0.1 * torch.randn(4096, 16), 0.1 * torch.randn(256, 16)
    hidden[:, 0], weight[128:, 0] = 1.0, -7.0  # columns 128+: never targets, p ~ 1e-5
    hidden.requires_grad_(), weight.requires_grad_()
    targets = torch.randint(0, 128, (4096,))
    expected = torch.autograd.grad(_plain_head(hidden, weight, targets, 256), weight)[0][128:]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = linear_cross_entropy(hidden, weight, targets, vocab_size=256, chunk_size=1000)
    grad = torch.autograd.grad(loss * 65536, weight)[0][128:] / 65536
    assert (grad - expected).norm() / expected.norm() < 1e-3


def test_mixed_precision_casts_to_the_autocast_dtype() -> None:
    hidden, weight = torch.randn(6, 8), torch.randn(16, 8)
    targets = torch.randint(0, 16, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear_cross_entropy(hidden, weight, targets, vocab_size=16)
        plain = _plain_head(hidden, weight, targets, 16)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)  # the same bfloat16 logits
    assert fused != linear_cross_entropy(hidden, weight, targets, vocab_size=16)  # not float32


def test_accumulation_gives_the_full_batch_loss_and_gradients() -> None:
    batch = torch.randint(0, 60, (8, 9))
    results = []
    for overrides in ([], ["+opt=[custom_op,accum]", "opt.accum.steps=4"]):
        plan = opt.plan(tiny_cfg("train.batch_size=8", *overrides), SINGLE)
        model = toy_gpt()
        opt_cfg = make_cfg(*overrides).opt
        opt.apply_model_stages(model, opt_cfg, plan, SINGLE)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # gradients only
        scaler = plan.grad_scaler(CPU)
        guard = NonFiniteGuard(CPU, SINGLE, max_bad_steps=10)
        step = opt.build_step(opt_cfg, plan, guard, model, model, optimizer, scaler)
        losses, norm = train_step(step, batch[:, :-1], batch[:, 1:], 1e9)
        results.append((losses / plan.micro_steps, norm))
    (full_loss, full_norm), (accum_loss, accum_norm) = results
    torch.testing.assert_close(accum_loss, full_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(accum_norm, full_norm, rtol=1e-5, atol=0)


def test_evaluation_and_sampling_keep_their_paths() -> None:
    """No gradients are computed when none are needed; logits (sampling) come from the plain
    head."""
    idx, targets = torch.randint(0, 60, (2, 8)), torch.randint(0, 60, (2, 8))
    plain, fused = toy_gpt(), toy_gpt(chunk_size=5)
    with torch.no_grad(), _OpCalls() as calls:
        torch.testing.assert_close(fused(idx, targets)[1], plain(idx, targets)[1])
        torch.testing.assert_close(fused(idx)[0], plain(idx)[0])
    assert calls.with_grads == [False]  # evaluation: the loss only; sampling: no call


# ---- the stage really acts


class _OpCalls(TorchDispatchMode):
    """Records calls of the fused operator and the largest tensor any operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.with_grads: list[bool] = []
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is OP:
            self.with_grads.append(args[7])  # (hidden, weight, targets, ..., with_grads, float8)
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_stage_calls_the_operator_and_never_builds_the_full_logits() -> None:
    idx, targets = torch.randint(0, 120, (4, 8)), torch.randint(0, 120, (4, 8))
    full_logits = 4 * 8 * 128  # larger than any other tensor of this toy
    for model, calls_expected in [(toy_gpt(120), []), (toy_gpt(120, chunk_size=8), [True])]:
        with _OpCalls() as calls:
            model(idx, targets)[1].backward()
        assert calls.with_grads == calls_expected
        assert (calls.largest >= full_logits) == (not calls_expected), calls.largest


def test_bad_knobs_are_refused_naming_them() -> None:
    for knob, message in [
        ("chunk_size=-1", "opt.custom_op.chunk_size must be an integer >= 0, got -1"),
        ("block=1000", "opt.custom_op.block=1000: a power of two"),
        ("num_warps=3", "opt.custom_op.num_warps must be one of 1, 2, 4, 8, 16, 32, got 3"),
    ]:
        with pytest.raises(ValueError, match=message):
            opt.plan(make_cfg("+opt=custom_op", f"opt.custom_op.{knob}"), SINGLE)
    with pytest.raises(ValueError, match="hidden is torch.bfloat16 but weight is torch.float32"):
        linear_cross_entropy(
            torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(16, 8), torch.zeros(2).long(), 16
        )


# ---- composition with the other stages and the trainer


def test_compiled_model_is_one_graph_with_the_operator_in_it() -> None:
    import torch._dynamo

    idx, targets = torch.randint(0, 60, (2, 8)), torch.randint(0, 60, (2, 8))
    torch._dynamo.reset()
    for dtype in (torch.float32, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            explained = torch._dynamo.explain(toy_gpt(chunk_size=5))(idx, targets)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
        ops = [node.target for node in explained.graphs[0].graph.nodes]
        assert OP in ops
    torch._dynamo.reset()


def test_a_run_with_the_stage_matches_the_baseline(tmp_path, capsys) -> None:
    """End to end with stages it composes with: accumulation and activation checkpointing
    leave the losses and gradient norms of the plain head."""
    args = ("train.max_steps=3", "train.log_interval=1", "sample.num_samples=1",
            "wandb.mode=disabled", "train.batch_size=4")  # fmt: skip
    train(tiny_cfg(*args), tmp_path / "baseline")
    stages = "+opt=[custom_op,accum,ac]"
    summary = train(tiny_cfg(*args, stages, "opt.custom_op.chunk_size=24"), tmp_path / "fused")
    assert summary["stages"] == ["accum", "custom_op", "ac"]
    assert (
        "[opt] custom_op: fused head + cross-entropy, chunks of 24 tokens"
        in capsys.readouterr().out
    )
    for key in ("train/loss", "val/loss", "train/grad_norm"):
        torch.testing.assert_close(
            logged(tmp_path / "fused", key), logged(tmp_path / "baseline", key), rtol=1e-4, atol=0
        )


def test_ddp_reduces_the_fused_gradients(tmp_path) -> None:
    """DDP's hooks see the operator's gradients like any others (a world of one process; two
    processes with FSDP: tests/distributed/test_distributed.py)."""
    import torch.distributed as dist

    idx, targets = torch.randint(0, 60, (2, 8)), torch.randint(0, 60, (2, 8))
    _, plain = _loss_and_grads(toy_gpt(), idx, targets)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = toy_gpt(chunk_size=5)
        ddp = opt.ddp.apply_ddp(model, make_cfg("+opt=ddp").opt.ddp, SINGLE)
        reduced = []
        ddp.register_comm_hook(None, lambda _, bucket: reduced.append(1) or _done(bucket))
        ddp(idx, targets)[1].backward()
    finally:
        dist.destroy_process_group()
    assert reduced
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[name], rtol=1e-5, atol=1e-7, msg=name)


def _done(bucket) -> torch.futures.Future:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@pytest.mark.slow
def test_compiled_training_with_the_stage_matches_eager(tmp_path) -> None:
    args = ("train.max_steps=3", "train.log_interval=1", "sample.num_samples=0",
            "wandb.mode=disabled", "+opt=[custom_op,amp]", "opt.amp.dtype=bfloat16")  # fmt: skip
    compiled = [*args[:-2], "+opt=[custom_op,amp,compile]", "opt.amp.dtype=bfloat16"]
    counters = compiled_against_eager(tmp_path, list(args), compiled, rtol=1e-2)
    assert counters["stats"]["unique_graphs"] == 1 and not counters.get("graph_break")


def test_the_benchmark_harness_runs_and_reports(tmp_path) -> None:
    """measure/bench_head.py is a GPU benchmark; on the CPU its harness (variants, errors against
    the plain head in float32, reports, a failing variant recorded rather than fatal) still runs."""
    argv = ["--out", str(tmp_path), "--device", "cpu", "--tokens", "16", "--width", "8",
            "--repeats", "1", "--no-compile"]  # fmt: skip
    report = bench_head.main(argv)
    rows = {r["variant"]: r for r in report["head"]}
    assert max(rows["eager plain head"]["rel_error"].values()) < 1e-2  # bfloat16 vs float32
    fused = [r for name, r in rows.items() if name.startswith("op ")]
    assert len(fused) == 13
    for r in fused:  # float8 changes the math: a looser bound
        assert max(r["rel_error"].values()) < (0.15 if r.get("float8") else 1e-2), r
    assert json.loads((tmp_path / "head_op.json").read_text())["head"] == report["head"]
    assert "| eager plain head |" in (tmp_path / "head_op.md").read_text()


# ---- the Triton kernel itself, through Triton's interpreter on the CPU


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_triton_kernel_in_the_interpreter_matches_the_reference() -> None:
    """TRITON_INTERPRET must be set before triton is imported, so this runs in a fresh process
    (tests/unit/triton_interpreter_probe.py): one-pass and two-pass kernels, float32 and bfloat16,
    alone and inside the chunked operator, against the PyTorch reference."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [python(), "tests/unit/triton_interpreter_probe.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.splitlines()[-1])
    assert len(errors) == 11  # 6 kernel cases, 2 float8 gradient cases, 3 operator cases
    for case, (loss_error, grad_error, tolerance) in errors.items():
        assert loss_error < 1e-5 and grad_error < tolerance, (case, loss_error, grad_error)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_triton_kernel_compiles_for_an_h100(dtype: str) -> None:
    """What the interpreter does not check: Triton's real compiler (down to an sm_90 cubin with
    the ptxas that triton ships; no GPU needed) accepts the kernel in every variant."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton_cross_entropy import _cross_entropy_rows_kernel

    signature = {"logits_ptr": f"*{dtype}", "targets_ptr": "*i64", "losses_ptr": "*fp32",
                 "grad8_ptr": "*fp8e5", "vocab_size": "i32", "N_COLS": "constexpr",
                 "BLOCK": "constexpr", "ONE_PASS": "constexpr", "WRITE_GRAD": "constexpr",
                 "WRITE_GRAD8": "constexpr", "GRAD8_SCALE": "constexpr"}  # fmt: skip
    # (block, one pass, write the gradient, and its float8 copy): every branch of the kernel.
    variants = [(8192, False, True, False), (8192, False, False, False),
                (65536, True, True, False), (65536, True, False, False),
                (8192, False, True, True), (65536, True, True, True)]  # fmt: skip
    for block, one_pass, write_grad, write_grad8 in variants:
        constants = {"N_COLS": 50304, "BLOCK": block, "ONE_PASS": one_pass,
                     "WRITE_GRAD": write_grad, "WRITE_GRAD8": write_grad8,
                     "GRAD8_SCALE": 1024.0}  # fmt: skip
        source = ASTSource(fn=_cross_entropy_rows_kernel, signature=signature, constexprs=constants)
        compiled = triton_compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16}
        )
        assert compiled.asm["cubin"], (block, one_pass, write_grad, write_grad8)


# ---- on a GPU: the Triton path at GPT-2's shapes, and a compiled training step


def _on_gpu(test):
    """Marks a test `gpu` and skips it without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(test))


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _against_the_plain_head_at_gpt2_shapes(**op_knobs):
    """(fused loss, plain loss, fused grads, plain grads) in bfloat16 on 4096 x 768 x 50304."""
    tokens, width = 4096, 768
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (0.02 * torch.randn(50304, width, device="cuda")).bfloat16().requires_grad_()
    targets = torch.randint(0, 50257, (tokens,), device="cuda")
    plain = _plain_head(hidden, weight, targets, 50257)
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    fused = linear_cross_entropy(hidden, weight, targets, 50257, **op_knobs)
    return fused, plain, torch.autograd.grad(fused, (hidden, weight)), plain_grads


@pytest.mark.parametrize(
    "chunk_size,block,num_warps", [(0, 8192, 16), (1000, 4096, 8), (4096, 65536, 32)]
)
@_on_gpu
def test_triton_path_matches_the_plain_head_in_bfloat16_at_gpt2_shapes(
    chunk_size: int, block: int, num_warps: int
) -> None:
    fused, plain, fused_grads, plain_grads = _against_the_plain_head_at_gpt2_shapes(
        chunk_size=chunk_size, block=block, num_warps=num_warps
    )
    vocab = 50257
    torch.testing.assert_close(fused, plain, rtol=2e-3, atol=0)
    for name, a, b in zip(("hidden", "weight"), fused_grads, plain_grads, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16
        assert _relative_error(a, b) < 1e-2, (name, _relative_error(a, b))
    assert not fused_grads[1][vocab:].any()


@_on_gpu
def test_float8_triton_path_at_gpt2_shapes() -> None:
    fused, plain, fused_grads, plain_grads = _against_the_plain_head_at_gpt2_shapes(
        chunk_size=2048, float8=True
    )
    torch.testing.assert_close(fused, plain, rtol=2e-2, atol=0)
    for name, a, b in zip(("hidden", "weight"), fused_grads, plain_grads, strict=True):
        assert _relative_error(a, b) < 0.1, (name, _relative_error(a, b))


@_on_gpu
def test_float16_with_a_grad_scaler_on_the_gpu() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2048, 768, device="cuda", requires_grad=True)
    weight = (0.02 * torch.randn(50304, 768, device="cuda")).requires_grad_()
    targets = torch.randint(0, 50257, (2048,), device="cuda")
    grads = []
    for loss_fn in (_plain_head, functools.partial(linear_cross_entropy, chunk_size=1000)):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(hidden, weight, targets, 50257)
        grads.append([g / 65536 for g in torch.autograd.grad(loss * 65536, (hidden, weight))])
    for a, b in zip(*grads, strict=True):
        assert torch.isfinite(a).all() and _relative_error(a, b) < 1e-2


@pytest.mark.parametrize("width", [128, 1280])
@_on_gpu
def test_compiled_training_step_with_the_stage_on_the_gpu(tmp_path, width: int) -> None:
    """A compiled bfloat16 run with the stage: the same losses as without it, one graph, and at
    the narrow width a lower peak (GPT-2's vocabulary, 16 x 256 tokens; at 1280 the operator's
    float32 weight gradient, V x C, outweighs these few tokens' logits). At gpt2-large's width
    the final norm is a looped reduction whose kernel reloads what it stored (opt/compile.py,
    the reload race): without a barrier its rows reached the operator 30% off."""
    import torch._dynamo

    args = ("device=cuda", "train.log_interval=1", "sample.num_samples=0", "wandb.mode=disabled",
            "train.max_steps=4", "model.block_size=256", "train.batch_size=16",
            "opt.amp.dtype=bfloat16", f"model.n_embd={width}", f"model.n_head={width // 32}",
            "model.n_layer=2")  # fmt: skip
    peaks = {}
    for name, stages in [
        ("plain", "+opt=[amp,compile]"),
        ("fused", "+opt=[custom_op,amp,compile]"),
    ]:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.cuda.reset_peak_memory_stats()
        train(tiny_cfg(*args, stages), tmp_path / name)
        assert not torch._dynamo.utils.counters["graph_break"], name
        peaks[name] = torch.cuda.max_memory_allocated()
    torch.testing.assert_close(
        logged(tmp_path / "fused", "train/loss"),
        logged(tmp_path / "plain", "train/loss"),
        rtol=1e-2,
        atol=0,
    )
    assert peaks["fused"] < peaks["plain"] or width > 128, peaks
    torch._dynamo.reset()
