"""+opt=attention (opt/attention.py): each backend runs its own kernel and computes the same
attention; the kernel is read from what ran, by a classification tested on recorded names; what
cannot run is refused in one line. The GPU tests train with each backend and check the kernel
that the run logs and that a compiled model runs."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import opt
from base.distributed import Distributed
from base.errors import ConfigError
from helpers import make_cfg, tiny_cfg, tiny_run
from model import GPT, GPTConfig
from opt import attention

CPU = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
# A CUDA rank, for the refusals that only plan (no GPU is touched).
CUDA = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", 0))

# Kernel and operator names in event order. cuDNN's from the H100 step budget (torch 2.11,
# docs/results/nvidia-h100-80gb-hbm3/step_budget_after.json); the others' kernel names as public
# profiles record them; the operators as torch 2.13 names them on a CPU.
RECORDED = {
    "cudnn": [
        "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_"
        "cga1x1x1_kernel0_0",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_"
        "cga1x1x1_kernel0_0",
    ],
    "flash": [
        "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
        "aten::_flash_attention_forward", "void pytorch_flash::flash_fwd_kernel<...>",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>",
        "void pytorch_flash::flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<(int)64, (int)64, "
        "(int)128, (int)8, (int)2, (int)4, (int)4, (bool)1, (bool)0, cutlass::bfloat16_t>>",
    ],
    "efficient": [
        "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_efficient_attention",
        "aten::_efficient_attention_forward",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
        "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "fmha_cutlassB_f32_aligned_64x64_k64_dropout_sm80",
    ],
    "math": [
        "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math",
        "aten::bmm", "ampere_bf16_s1688gemm_bf16_128x128_ldg8_f2f_stages_32x1_tn",
        "aten::_safe_softmax", "void at::native::vectorized_elementwise_kernel<4, ...>",
    ],
    "flex": [
        "Torch-Compiled Region: 0/0", "CompiledFunction", "triton_tem_fused_flex_attention_0",
        "triton_tem_fused_flex_attention_backward_transpose_view_3",
    ],
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(RECORDED))
def test_the_kernel_is_classified_from_recorded_names(kind: str) -> None:
    said = attention.classify(RECORDED[kind])
    assert said.split(": ")[0] == kind
    assert "<" not in said and "(" not in said and "void" not in said  # its name only
    assert attention.classify(["aten::add", "aten::mm"]).startswith("unknown: none of 2")


@pytest.mark.parametrize(
    "backend, op",
    [
        ("auto", "flash: aten::_scaled_dot_product_flash_attention_for_cpu"),
        ("math", "math: aten::_scaled_dot_product_attention_math"),
        ("flash", "flash: aten::_scaled_dot_product_flash_attention_for_cpu"),
    ],
)
def test_each_sdpa_backend_runs_its_own_op(backend: str, op: str) -> None:
    attend = attention.attend_with(backend)
    ran = attention.kernel_that_runs(attend, (2, 3, 16, 8), torch.float32, CPU.device, 0.0, "x")
    assert ran == op


def test_each_backend_computes_the_same_attention() -> None:
    """Under math, flash and flex the same inputs give the same outputs, and flex runs its own
    operator (forward only: FlexAttention has no backward on a CPU)."""
    q, k, v = (torch.randn(2, 3, 40, 8) for _ in "qkv")  # not a multiple of flex's blocks
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for backend in ("auto", "math", "flash", "flex"):
        with warnings.catch_warnings():  # flex uncompiled: "materializes the full scores"
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = attention.attend_with(backend)(q, k, v, 0.0)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
        if backend == "flex":
            ran = attention.classify(e.name for e in prof.events())
            assert ran.startswith("flex: ") and "scaled_dot_product" not in ran


def test_the_model_is_unchanged_by_the_backend() -> None:
    """The same model's logits under auto, math and flex, and its loss's gradients under auto
    and math, agree."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64)).eval()
    idx = torch.randint(0, 64, (2, 32))
    outputs, grads = {}, {}
    for backend in ("auto", "math", "flex"):
        attention.use(model, attention.attend_with(backend))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs[backend] = model(idx)[0]
        if backend != "flex":
            model.zero_grad()
            model(idx, idx)[1].backward()
            grads[backend] = [p.grad.clone() for p in model.parameters()]
    torch.testing.assert_close(outputs["math"], outputs["auto"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs["flex"], outputs["auto"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads["math"], grads["auto"], atol=1e-5, rtol=1e-5)


def test_a_compiled_model_runs_the_backend_asked_for() -> None:
    """Dynamo traces sdpa_kernel into the graph: the compiled forward and backward run the op of
    the backend asked for, not the dispatcher's default (flash on a CPU)."""
    import torch._dynamo

    def ops(attend: attention.Attend) -> set[str]:
        torch._dynamo.reset()

        def loss(x: torch.Tensor) -> torch.Tensor:
            return attend(x * 2, x, x, 0.0).sum()

        x = torch.randn(2, 3, 16, 8, requires_grad=True)
        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            compiled(x).backward()
        return {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot")}

    assert ops(attention.attend_with("math")) == {"aten::_scaled_dot_product_attention_math"}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops(attention.causal_attention)


def test_flex_builds_a_mask_per_length_inside_a_compiled_graph() -> None:
    """The training length's mask is built before compile traces; another length's (generation,
    a shorter evaluation row) at its first call, inside the graph, then reused."""
    import torch._dynamo

    torch._dynamo.reset()
    flex = attention.Flex()
    flex.mask(32, CPU.device)
    compiled = torch.compile(lambda x: flex(x, x, x, 0.0), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for length in (32, 7, 32, 7):
            x = torch.randn(1, 2, length, 8)
            reference = F.scaled_dot_product_attention(x, x, x, is_causal=True)
            torch.testing.assert_close(compiled(x), reference, atol=1e-5, rtol=1e-5)
    assert sorted(flex.masks) == [7, 32]


def test_a_cpu_run_logs_the_kernel_and_trains_as_without_the_stage(tmp_path) -> None:
    base = tiny_run(tmp_path / "auto", "train.max_steps=3", "sample.num_samples=0")
    math = tiny_run(
        tmp_path / "math", "train.max_steps=3", "sample.num_samples=0", "+opt=attention",
        "opt.attention.backend=math",
    )  # fmt: skip
    assert base["attention_kernel"] is None  # not probed: a CPU run without the stage
    assert math["attention_kernel"] == "math: aten::_scaled_dot_product_attention_math"
    assert math["val/loss"] == pytest.approx(base["val/loss"], rel=1e-5)


@pytest.mark.parametrize(
    "overrides, device, says",
    [
        (["opt.attention.backend=flex", "model.dropout=0.1"], CPU, "FlexAttention has no dropout"),
        (["opt.attention.backend=flex"], CUDA, "needs +opt=compile"),
        (["opt.attention.backend=flash"], CUDA, "computes in float16 or bfloat16 only"),
        (["opt.attention.backend=cudnn"], CUDA, "sm75: use efficient"),
        (["opt.attention.backend=fast"], CPU, "opt.attention.backend"),
    ],
)  # fmt: skip
def test_what_cannot_run_is_refused_in_one_line_while_planning(
    monkeypatch, overrides, device, says
) -> None:
    """On a GPU these only plan (nothing touches it), as on an H100 (sm90), or a T4 (sm75)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    if "sm75" in says:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    cfg = tiny_cfg("+opt=[amp,attention]" if "sm75" in says else "+opt=attention", *overrides)
    with pytest.raises(ConfigError, match=re.escape(says)) as refused:
        opt.plan(cfg, device)
    assert "\n" not in str(refused.value)


def test_flex_plans_once_the_plan_compiles_with_inductor() -> None:
    """The flex check asks Plan.compiled, which +opt=compile's plan sets, whatever the order."""
    flex = ("+opt=[compile,attention]", "opt.attention.backend=flex")
    assert opt.plan(tiny_cfg(*flex), CUDA).compiled
    with pytest.raises(ConfigError, match="needs \\+opt=compile with opt.compile.backend=inductor"):
        opt.plan(tiny_cfg(*flex, "opt.compile.backend=aot_eager"), CUDA)


@pytest.mark.parametrize(
    "backend, says",
    [
        ("cudnn", "cuDNN's fused attention runs on a CUDA GPU only"),
        ("efficient", "the memory-efficient kernel runs on a CUDA GPU only"),
        ("flex", "FlexAttention has no backward on a cpu"),
    ],
)
def test_a_gpu_backend_is_refused_on_a_cpu_as_the_model_is_set_up(backend, says) -> None:
    cfg = tiny_cfg("+opt=[compile,attention]", f"opt.attention.backend={backend}")
    plan = opt.plan(cfg, CPU)  # planned: a GPU ladder's steps are planned on any host
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    with pytest.raises(ConfigError, match=re.escape(says)) as refused:
        attention.apply_attention(opt.stage.Context(CPU, plan, model=model, module=model), backend)
    assert "\n" not in str(refused.value)


def test_a_backend_pytorch_cannot_run_is_refused_with_its_reason() -> None:
    def refusing(q, k, v, dropout):
        warnings.warn("Flash attention kernel not used because:", stacklevel=1)
        warnings.warn("Flash attention has been runtime disabled.", stacklevel=1)
        warnings.warn("Flash attention requires head_dim <= 256, got 512", stacklevel=1)
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(ConfigError, match=r"backend=flash cannot run .*head_dim <= 256") as e:
        attention.kernel_that_runs(refusing, (1, 1, 8, 512), torch.float16, CPU.device, 0.0,
                                   "opt.attention.backend=flash")  # fmt: skip
    assert "\n" not in str(e.value)


def test_the_stage_composes_and_its_knob_is_checked() -> None:
    cfg = make_cfg("+opt=attention", "opt.attention.backend=math")
    assert opt.plan(cfg, CPU).stages == ["attention"]
    assert cfg.opt.attention.backend == "math"


# ---- on a GPU (`pytest -m gpu`)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPT2_SHAPES = (  # GPT-2's attention (12 heads of 64, T=1024), two blocks: a quick compile
    "model=gpt2", "model.n_layer=2", "data=synthetic", "train.batch_size=8", "train.max_steps=6",
    "train.warmup_steps=2", "train.eval_interval=1000000", "train.eval_sequences=8",
    "train.checkpoint_interval=0", "device=cuda", "train.log_interval=1", "sample.num_samples=0",
    "wandb.mode=disabled", "opt.amp.dtype=bfloat16",
)  # fmt: skip


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory) -> dict:
    """PyTorch's own choice, logged like any other."""
    from train import train

    return train(make_cfg(*GPT2_SHAPES, "+opt=[amp]"), tmp_path_factory.mktemp("auto"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "math", "flex"])
def test_each_backend_trains_gpt2_at_equal_loss_and_logs_its_kernel(
    tmp_path, auto_run, backend: str
) -> None:
    from train import train

    # flex: compiled, and sampling at the end (new lengths: their masks built inside the graph)
    stages = ["+opt=[amp,attention]"]
    if backend == "flex":
        stages = ["+opt=[amp,compile,attention]", "sample.num_samples=1", "sample.max_new_tokens=3"]
    summary = train(make_cfg(*GPT2_SHAPES, *stages, f"opt.attention.backend={backend}"), tmp_path)
    assert summary["attention_kernel"].split(": ")[0] == backend, summary["attention_kernel"]
    assert summary["train/loss"] == pytest.approx(auto_run["train/loss"], rel=2e-2)
    assert not auto_run["attention_kernel"].startswith("unknown"), auto_run["attention_kernel"]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "math", "flex"])
def test_the_compiled_model_runs_the_kernel_asked_for(backend: str) -> None:
    """Inductor's graph of a GPT-2 with the backend set, profiled: its kernels are that
    backend's (the startup probe runs the attention alone, this the whole compiled model). The
    math is Inductor's own matmuls and softmax: no fused attention kernel, no SDPA operator."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2)).cuda()
    attention.use(model, attention.attend_with(backend))
    compiled = torch.compile(model)
    idx = torch.randint(0, 50257, (4, 1024), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        compiled(idx, idx)[1].backward()  # compiled before the profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            compiled(idx, idx)[1].backward()
            torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    ran = attention.classify(e.name for e in events).split(": ")[0]
    assert ran == ("unknown" if backend == "math" else backend)
