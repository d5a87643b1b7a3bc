"""`+opt=attention`: which kernel computes causal attention.

- `auto`: PyTorch's dispatcher chooses, as without the stage. On an H100/H200 with torch 2.11 it
  picks cuDNN's fused attention (for bfloat16/float16 inputs, head_dim 64): PyTorch puts cuDNN
  first on sm90 and newer when cuDNN is recent enough, ahead of flash and memory-efficient.
- `cudnn`, `flash`, `efficient`, `math`: that SDPA backend only, through
  `torch.nn.attention.sdpa_kernel` around the call. Dynamo traces the context manager into the
  graph and picks the concrete op (`aten._scaled_dot_product_cudnn_attention`, ...) while
  tracing, so a compiled model runs the backend asked for; the backward is that op's own. Such
  a graph skips AOTAutograd's cache (the manager's node is not on its list of cacheable calls):
  a warm launch re-traces it, while Inductor's kernels still come from the cache.
- `flex`: FlexAttention with a causal `BlockMask`, one per sequence length (the training
  length's built here, before any compile traces it; another length's at its first call).
  Inductor generates its fused kernel when it compiles the model (`+opt=compile`, required:
  without it FlexAttention runs a reference that materialises every T x T score).

The process reports the kernel that ran (`attention_kernel`: the [opt] line, wandb's config,
summary.json): one forward and backward of the attention at the run's shapes, under the
profiler, and the names of what ran, classified by `classify`. A CUDA library on the path
(cuDNN's version, a custom build) can change what PyTorch picks, so the names are read, not
assumed. Done on every GPU run (a few milliseconds), and on a CPU when the stage is selected.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from base.distributed import log
from base.errors import ConfigError
from model.gpt import GPT, Attend, causal_attention
from opt.stage import Context, Stage
from recipe.metrics import reset_memory_peaks

Backend = Literal["auto", "cudnn", "flash", "efficient", "math", "flex"]
SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
CUDA_ONLY = {"cudnn": "cuDNN's fused attention", "efficient": "the memory-efficient kernel"}
# Kernels that compute in float16/bfloat16 only, and need an Ampere (sm80) or newer GPU.
HALF_ONLY = {"cudnn": "cuDNN's fused attention", "flash": "FlashAttention-2"}

# What ran, first match wins: the GPU's kernel names first (what the library ran), then the
# operators (what PyTorch dispatched to: all a CPU shows, and the math backend's only trace).
# cuDNN's as the H100 step budget recorded them (torch 2.11: `cudnn_generated_fort_native_sdpa_
# sm90_flash_fprop_wgmma_f16_knob_7_...`, `..._bprop_...`; `..._sdpa_sm80_knob_...` on an A100),
# the others as public profiles do: `void pytorch_flash::flash_fwd_kernel<...>`, `flash_bwd_*`;
# `fmha_cutlassF_bf16_aligned_64x64_rf_sm80(...)`, `fmha_cutlassB_*`; Inductor's FlexAttention
# `triton_tem_fused_flex_attention_0`, `triton_tem_fused_flex_attention_backward_transpose_view_3`.
KINDS = (
    ("cudnn", re.compile(r"cudnn.*sdpa|sdpa.*cudnn|cudnn.*[fb]prop", re.I)),
    ("flash", re.compile(r"pytorch_flash::|flash_(fwd|bwd)_", re.I)),
    ("efficient", re.compile(r"fmha_cutlass|MemEffAttention", re.I)),
    ("flex", re.compile(r"triton\w*flex_attention", re.I)),
    ("cudnn", re.compile(r"^aten::_scaled_dot_product_cudnn_attention$")),
    ("flash", re.compile(r"^aten::_scaled_dot_product_flash_attention(_for_cpu)?$")),
    ("efficient", re.compile(r"^aten::_scaled_dot_product_efficient_attention$")),
    ("math", re.compile(r"^aten::_scaled_dot_product_attention_math$")),
    ("flex", re.compile(r"^FlexAttention|flex_attention", re.I)),
)


def classify(names: Iterable[str]) -> str:
    """What ran, from a profile's event names in order: `<kind>: <name>`, the kind one of
    cudnn, flash, efficient, math, flex, the name the first event that shows it (templates and
    arguments cut); `unknown: ...` when nothing does."""
    names = list(names)
    for kind, pattern in KINDS:
        name = next((n for n in names if pattern.search(n)), None)
        if name is not None:
            return f"{kind}: {re.split(r'[<(]', name.removeprefix('void '), maxsplit=1)[0]}"
    return f"unknown: none of {len(names)} events names an attention kernel"


class SDPA:
    """Causal SDPA with one backend allowed."""

    def __init__(self, backend: SDPBackend) -> None:
        self.backends = [backend]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float
    ) -> torch.Tensor:
        with sdpa_kernel(self.backends):
            return causal_attention(q, k, v, dropout)


def _causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q >= kv


class Flex:
    """Causal FlexAttention; its block masks by sequence length, each built once. Dropout is
    refused before it gets here (FlexAttention has none)."""

    def __init__(self) -> None:
        self.masks: dict[int, BlockMask] = {}

    def mask(self, length: int, device: torch.device) -> BlockMask:
        if length not in self.masks:
            self.masks[length] = create_block_mask(_causal, None, None, length, length, device)
        return self.masks[length]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float
    ) -> torch.Tensor:
        out = flex_attention(q, k, v, block_mask=self.mask(q.shape[-2], q.device))
        assert isinstance(out, torch.Tensor)  # no log-sum-exp asked for
        return out


def attend_with(backend: str) -> Attend:
    """The attention function of `backend` (a Knobs.backend)."""
    if backend == "auto":
        return causal_attention
    return Flex() if backend == "flex" else SDPA(SDPA_BACKENDS[backend])


def use(model: GPT, attend: Attend) -> None:
    """Every block of `model` attends with `attend` (one object: FlexAttention's masks shared)."""
    for block in model.transformer.h:
        block.attn.attend = attend


def kernel_that_runs(
    attend: Attend,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    dropout: float,
    what: str,
) -> str:
    """One forward and backward of `attend` on random q, k, v of `shape` (B, heads, T,
    head_dim), profiled: `classify` of what ran. A backend that cannot run these inputs is
    refused in one line, with PyTorch's reason (`what`: the setting that asked for it)."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    with torch.random.fork_rng(devices=[device] if cuda else []):  # the run's RNG untouched
        q, k, v = (torch.randn(shape, dtype=dtype, device=device).requires_grad_() for _ in "qkv")
        with (
            warnings.catch_warnings(record=True) as said,
            torch.profiler.profile(activities=activities) as prof,
        ):
            warnings.simplefilter("always")
            try:
                attend(q, k, v, dropout).sum().backward()
            except RuntimeError as e:
                reason = _reason([str(w.message) for w in said], str(e))
                raise ConfigError(
                    f"{what} cannot run this model's attention here ({dtype}, head_dim "
                    f"{shape[-1]}, dropout {dropout}): {reason}; choose another backend "
                    "(auto lets PyTorch pick)"
                ) from None
            if cuda:
                torch.cuda.synchronize(device)
    del q, k, v
    if cuda:  # the probe's blocks are not the run's memory
        torch.cuda.empty_cache()
        reset_memory_peaks(device)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return classify(e.name for e in events)


def _reason(warned: list[str], error: str) -> str:
    """PyTorch's reason for refusing a backend: its first warning that says one (it warns a
    heading, "... not used because:", then the reason, for each backend), else the error's first
    line."""
    reasons = [
        line.strip()
        for text in warned
        for line in text.splitlines()
        if line.strip()
        and not line.rstrip().endswith("because:")
        and "runtime disabled" not in line
    ]
    return reasons[0] if reasons else error.splitlines()[0]


@dataclass
class Knobs:
    backend: Backend


def _check(ctx: Context) -> None:
    """Refuses, in one line, what the device or the model cannot run."""
    backend, device, cfg = ctx.knobs.backend, ctx.dist.device, ctx.cfg
    key = f"opt.attention.backend={backend}"
    if device.type == "cuda" and backend in HALF_ONLY:
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise ConfigError(
                f"{key}: {HALF_ONLY[backend]} needs an Ampere (sm80) or newer GPU, this one is "
                f"sm{major}{minor}: use efficient (or auto)"
            )
    if backend == "flex" and cfg.model.dropout:
        raise ConfigError(
            f"{key} with model.dropout={cfg.model.dropout}: FlexAttention has no dropout; "
            "set model.dropout=0 (GPT-2's pretraining uses none) or use an SDPA backend"
        )


def refuse_off_gpu(backend: str, device: torch.device) -> None:
    """Refuses, in one line, a GPU-only backend on a CPU. Checked as the model is set up, with
    the probe that refuses what PyTorch itself cannot run, rather than while planning: a GPU
    ladder's steps are planned on any host (their device `auto`)."""
    key = f"opt.attention.backend={backend}"
    if device.type != "cuda" and backend in CUDA_ONLY:
        raise ConfigError(
            f"{key}: {CUDA_ONLY[backend]} runs on a CUDA GPU only, this run is on a "
            f"{device.type}: use auto, math or flash (PyTorch's CPU kernel) here"
        )
    if device.type != "cuda" and backend == "flex":
        raise ConfigError(
            f"{key}: FlexAttention has no backward on a {device.type} (torch "
            f"{torch.__version__}): train with it on a GPU, or use auto or math here"
        )


def _check_plan(ctx: Context) -> None:
    """Refuses what the other stages' decisions leave a backend unable to run: FlexAttention
    uncompiled, the GPU's half-precision kernels in a float32 run (PyTorch's CPU flash kernel
    computes in float32 too)."""
    backend, cuda, plan = ctx.knobs.backend, ctx.dist.device.type == "cuda", ctx.plan
    key = f"opt.attention.backend={backend}"
    if backend == "flex" and not (plan.compiled and ctx.cfg.opt.compile.backend == "inductor"):
        raise ConfigError(
            f"{key} needs +opt=compile with opt.compile.backend=inductor: Inductor generates "
            "FlexAttention's fused kernel; without it FlexAttention runs a reference that "
            "materialises every T x T score"
        )
    if cuda and backend in HALF_ONLY and plan.amp_dtype is None:
        raise ConfigError(
            f"{key}: {HALF_ONLY[backend]} computes in float16 or bfloat16 only, and this run "
            "computes in float32: add +opt=amp, or use efficient or math"
        )


def apply_attention(ctx: Context, backend: str, selected: bool = True) -> None:
    """Sets every block's attention to `backend`'s, then probes and logs what runs (every GPU
    run; on a CPU only if the stage was `selected`)."""
    model, plan, device = ctx.model, ctx.plan, ctx.dist.device
    refuse_off_gpu(backend, device)
    attend = attend_with(backend)
    use(model, attend)
    c = model.config
    if isinstance(attend, Flex):  # the training length's mask, before compile traces a call
        attend.mask(c.block_size, device)
    if not selected and device.type != "cuda":
        return
    what = f"opt.attention.backend={backend}" if selected else "PyTorch's attention (auto)"
    if torch.autograd._profiler_enabled():  # +prof=trace's profiler: its trace names it
        plan.attention_kernel = "not probed: the run's profiler is on (see its trace)"
    else:
        heads = c.n_head // plan.parallel.tp  # this rank's, under +opt=tp
        shape = (plan.micro_batch_size, heads, c.block_size, c.n_embd // c.n_head)
        # FlexAttention's kernel is Inductor's: probed compiled, as the compiled model runs it
        probe = torch.compile(attend.__call__) if isinstance(attend, Flex) else attend
        dtype = plan.amp_dtype or torch.float32
        plan.attention_kernel = kernel_that_runs(probe, shape, dtype, device, c.dropout, what)
    log(f"[opt] attention: backend={backend}; ran {plan.attention_kernel}")


STAGE = Stage(
    "attention", "model", lambda ctx: apply_attention(ctx, ctx.knobs.backend), Knobs,
    check=_check, check_plan=_check_plan,
    unselected=lambda ctx: apply_attention(ctx, "auto", selected=False),  # PyTorch's, on a GPU
)  # fmt: skip
