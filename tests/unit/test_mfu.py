"""MFU you can trust. Its numerator: the model's FLOP formula (model/gpt.py's `flops_per_token`,
and `recompute_flops_per_token` added for HFU) against what `torch.utils.flop_counter` counts in
one training step (forward and backward), at every model size in conf/model/ and under the stages
that change the work: activation checkpointing (its recompute is hardware FLOPs, not model FLOPs)
and the fused head + loss (a custom operator that declares its FLOPs to the counter). Its
denominator: the GPU's dense peak in the run's matmul format from recipe/hardware.py's table, or
none (never another GPU's). And the guard: a utilization above 100% is refused, not reported.

The counter counts attention as the full T×T products (its SDPA formula ignores `is_causal`; on
the meta device SDPA runs as the math backend's two bmm, counted in full too), while the formula
counts causal attention half, as a causal kernel computes only the lower triangle: the counter's
attention FLOPs are halved here, explicitly. The models live on the meta device: no memory, no
arithmetic, so a step at the full context of the 4B model takes a second or two."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from helpers import CONF, make_cfg
from model import GPT
from opt.ac import apply_ac
from opt.custom_op import apply_custom_op
from recipe.hardware import PEAKS, matmul_ceiling, matmul_tflops, peak_flops
from recipe.metrics import throughput
from train import build_model

aten = torch.ops.aten
# The ops of attention's scores and values: the math backend's (meta, CPU math) and the fused
# kernels' forward and backward (CUDA). In this model only attention multiplies with bmm: the
# Linear layers run as mm/addmm.
ATTENTION_OPS = (
    aten.bmm,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
)
SIZES = sorted(path.stem for path in (CONF / "model").glob("*.yaml"))
TOLERANCE = 0.02


def meta_model(size: str, *overrides: str) -> GPT:
    with torch.device("meta"):
        return build_model(make_cfg(f"model={size}", *overrides).model)


def counted_per_token(model: GPT, batch: int = 1) -> float:
    """FLOPs per token of one training step as the counter sees them, causal attention halved."""
    T = model.config.block_size
    idx = torch.zeros(batch, T, dtype=torch.long, device=model.lm_head.weight.device)
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    counts = counter.get_flop_counts()["Global"]
    attention = sum(flops for op, flops in counts.items() if op in ATTENTION_OPS)
    assert attention > 0, f"no attention FLOPs among {list(counts)}: a new SDPA op?"
    return (counter.get_total_flops() - attention / 2) / (batch * T)


def knobs(stage: str, **overrides):
    return OmegaConf.merge(OmegaConf.load(CONF / f"opt/{stage}.yaml")[stage], overrides)


@pytest.mark.parametrize("size", SIZES)
def test_the_formula_agrees_with_the_counter_at_every_size(size: str) -> None:
    model = meta_model(size)
    formula, counted = model.flops_per_token(), counted_per_token(model)
    assert formula == pytest.approx(counted, rel=TOLERANCE), size
    assert model.recompute_flops_per_token() == 0


@pytest.mark.parametrize(
    "ac",
    [
        dict(mode="full"),
        dict(mode="full", use_reentrant=True),
        dict(mode="selective", every=2, target="block"),
        dict(mode="selective", every=2, target="attn"),
        dict(mode="selective", every=3, target="mlp"),
        dict(mode="op"),
    ],
    ids=lambda ac: "-".join(map(str, ac.values())),
)
def test_checkpointing_recompute_counts_as_hardware_flops_only(ac: dict) -> None:
    model = meta_model("gpt2", "model.n_layer=6")  # GPT-2's widths; fewer blocks count faster
    plain = model.flops_per_token()
    apply_ac(model, knobs("ac", **ac))
    assert model.flops_per_token() == plain  # MFU's numerator: the model's work, whatever reruns
    hardware = plain + model.recompute_flops_per_token()
    assert hardware == pytest.approx(counted_per_token(model), rel=TOLERANCE)
    assert (hardware > plain) == (ac["mode"] != "op")  # op keeps every matmul's output


def test_the_fused_head_declares_its_flops_to_the_counter() -> None:
    model = meta_model("gpt2", "model.n_layer=2")
    apply_custom_op(model, knobs("custom_op"))
    assert model.flops_per_token() == pytest.approx(counted_per_token(model), rel=TOLERANCE)


CUDA = torch.device("cuda")  # a name only: the tests below fake the device's name


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),  # SXM: nanoGPT measured it against 312
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5),
        ("NVIDIA H100 NVL", torch.float16, 835.5),
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA GH200 480GB", torch.bfloat16, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A100-SXM4-80GB", None, 19.5),  # float32 on the CUDA cores
        ("NVIDIA A10G", torch.bfloat16, 125.0),
        ("NVIDIA L40S", torch.bfloat16, 362.1),  # not the L4's
        ("NVIDIA L4", torch.bfloat16, 121.0),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2),
        ("Tesla V100-SXM2-16GB", torch.float16, 125.0),
        ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bfloat16 tensor cores
        ("NVIDIA GeForce GTX 1080", torch.bfloat16, None),  # not in the table
    ],
)
def test_the_peak_is_this_gpus_in_the_runs_format(monkeypatch, capsys, name, dtype, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak = peak_flops(CUDA, None, dtype)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))
    if tflops is None:  # MFU n/a, with the setting that gives it
        line = capsys.readouterr().out
        assert line.startswith("[perf] MFU n/a") and "set perf.peak_tflops" in line
    assert peak_flops(CUDA, 500.0, dtype) == 500e12  # perf.peak_tflops overrides the table


def test_tf32_has_its_own_peak(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100 80GB PCIe")
    torch.set_float32_matmul_precision("high")  # what +opt=tf32 sets (reset after each test)
    assert peak_flops(CUDA, None, None) == pytest.approx(156e12)


def test_the_table_holds_dense_peaks() -> None:
    """TF32 runs at half the bf16 rate on every tensor core listed: a row that breaks it mixes a
    sparse figure (twice the dense one, the datasheets' headline) with dense ones."""
    for name, bf16, fp16, tf32, fp32 in PEAKS:
        assert fp32 < (fp16 or 0) and (bf16 is None or bf16 == fp16), name
        assert tf32 is None or tf32 == pytest.approx(bf16 / 2, rel=0.02), name


def test_an_impossible_utilization_is_refused(capsys) -> None:
    """nanoGPT's 104% on an H100 (its peak was the A100's): GPT-2 124M at 500K tokens/s against
    312 TFLOP/s is 128%. Flagged and left out, never reported."""
    model = meta_model("gpt2")
    flops = model.flops_per_token()

    def measured(peak_flops: float) -> dict[str, float | None]:
        return throughput([1000.0], 500_000, flops, flops, peak_flops, world_size=1)  # 1 s steps

    out = measured(312e12)
    assert out["perf/mfu"] is None and out["perf/hfu"] is None
    assert "[warning] utilization 128% > 100%" in capsys.readouterr().out
    out = measured(989.4e12)  # the H100's: 40%
    assert out["perf/mfu"] == pytest.approx(100 * 500_000 * flops / 989.4e12)
    assert out["perf/hfu"] == out["perf/mfu"]


def test_the_matmul_ceiling_measures_tflops(capsys) -> None:
    """Its shape only: what it measures needs a GPU (perf.matmul_ceiling)."""
    assert matmul_tflops(torch.device("cpu"), n=64, dtype=torch.float32) > 0
    assert matmul_ceiling(torch.device("cpu")) == {}
    assert "no effect on a cpu run" in capsys.readouterr().out
