"""Op-level benchmark of +opt=custom_op: GPT-2's vocabulary head + cross-entropy, forward and
backward, as the plain head computes it (eager and torch.compile'd), as the fused operator
does (kernels/linear_cross_entropy.py) at several chunk sizes and Triton kernel configurations,
and as the libraries a user would pick instead do (liger-kernel's fused linear cross-entropy,
Apple's cut-cross-entropy: kernels/library_heads.py, the `opt.custom_op.backend` choices; a
library not installed gets a "not installed" row); then the Triton kernel alone against a
device-to-device copy of the same bytes.

    python scripts/bench_head.py --out docs/results/<gpu>            # GPT-2 124M: 32768 x 768
    python scripts/bench_head.py --out <dir> --shapes gpt2 gpt2-xl   # and GPT-2 XL: 16384 x 1600

Each variant: the median of `--repeats` timed forward+backward passes (CUDA events; warm-up
excluded), inputs cycling over a few random sets; the extra peak memory of one pass over the
inputs already allocated; and its largest error relative to the plain head computed in float32
on the same inputs (max |x - ref| / max |ref| for the loss and both gradients). A variant that
fails is reported, not fatal.
Writes <out>/head_op.json and <out>/head_op.md and prints the table last.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from kernels.library_heads import LIBRARIES, LOSSES, missing
from kernels.linear_cross_entropy import (
    _cross_entropy_rows_torch_,
    chunked_linear_cross_entropy,
    linear_cross_entropy,
)
from launch.provenance import git_commit

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"gpt2": (32768, 768), "gpt2-xl": (16384, 1600)}  # (tokens = batch x 1024, width)
VOCAB, PADDED_VOCAB = 50257, 50304
CHUNKS = (0, 16384, 8192, 4096, 2048)  # 0: all tokens at once
# (block, num_warps): two passes over blocks of 4096-16384 columns, or one pass (65536 >= row).
KERNELS = ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (65536, 16), (65536, 32))
DEFAULT_CHUNK, DEFAULT_KERNEL = 8192, (8192, 16)  # the chunk kernel configs are compared at
GiB = 1024**3
T = TypeVar("T")  # what time_ms's pool holds and its step takes


@dataclass
class Inputs:
    hidden: torch.Tensor  # (tokens, width), requires grad
    weight: torch.Tensor  # (padded vocab, width), requires grad: the tied embedding
    targets: torch.Tensor  # (tokens,)


Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # loss, grad of hidden, of weight
Step = Callable[[Inputs], Result]


def make_inputs(tokens: int, width: int, device: torch.device, seed: int) -> Inputs:
    g = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(tokens, width, device=device, generator=g, dtype=torch.bfloat16)
    weight = 0.02 * torch.randn(PADDED_VOCAB, width, device=device, generator=g)
    targets = torch.randint(0, VOCAB, (tokens,), device=device, generator=g)
    return Inputs(hidden.requires_grad_(), weight.bfloat16().requires_grad_(), targets)


def plain_head(hidden, weight, targets, vocab_size: int = VOCAB) -> torch.Tensor:
    """GPT.head's loss path: the padding masked by a -inf bias, the cross-entropy in float32."""
    mask = torch.zeros(weight.shape[0], device=hidden.device, dtype=hidden.dtype)
    mask[vocab_size:] = float("-inf")
    return F.cross_entropy(F.linear(hidden, weight, mask).float(), targets)


def float32_reference(x: Inputs) -> Result:
    """The plain head in float32 on the same (bfloat16) inputs: what every variant is judged by,
    the eager bfloat16 plain head included."""
    hidden = x.hidden.detach().float().requires_grad_()
    weight = x.weight.detach().float().requires_grad_()
    loss = plain_head(hidden, weight, x.targets)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad  # type: ignore[return-value]


def autograd_step(loss_fn: Callable) -> Step:
    def step(x: Inputs) -> Result:
        x.hidden.grad = x.weight.grad = None
        loss = loss_fn(x.hidden, x.weight, x.targets, VOCAB)
        loss.backward()  # sets both gradients (their type says Optional)
        return loss.detach(), x.hidden.grad, x.weight.grad  # type: ignore[return-value]

    return step


def reference_step(chunk_size: int) -> Step:
    """The operator's PyTorch path on the GPU (no Triton): what the kernel replaces."""

    def rows(logits, targets, losses, vocab_size, write_grad, grad8):
        _cross_entropy_rows_torch_(logits, targets, losses, vocab_size, grad8)

    def step(x: Inputs) -> Result:
        h, w = x.hidden.detach(), x.weight.detach()
        loss, grad_h, grad_w = chunked_linear_cross_entropy(
            h, w, x.targets, VOCAB, chunk_size, True, rows
        )
        scale = 1.0 / len(h)  # what the operator's backward does
        return loss, (grad_h.float() * scale).to(h.dtype), (grad_w * scale).to(w.dtype)

    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    step: Callable[[T], object], pool: list[T], repeats: int, device: torch.device
) -> list[float]:
    for i in range(3):  # warm-up: compilation, autotuning, the allocator
        step(pool[i % len(pool)])
    synchronize(device)
    times: list[tuple[torch.cuda.Event, torch.cuda.Event] | float] = []
    for i in range(repeats):
        x = pool[i % len(pool)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(x)
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            step(x)
            times.append((time.perf_counter() - t0) * 1e3)
    synchronize(device)
    return [t if isinstance(t, float) else t[0].elapsed_time(t[1]) for t in times]


def extra_peak_gib(step: Step, x: Inputs, device: torch.device) -> float | None:
    """Peak memory of one pass above what is allocated before it (inputs, their gradients)."""
    if device.type != "cuda":
        return None
    step(x)  # gradients exist before the measured pass, as in training
    gc.collect()
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step(x)
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / GiB


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run_variant(name: str, step: Step, pool: list[Inputs], ref: Result, args, flops: float,
                device: torch.device, **knobs) -> dict:  # fmt: skip
    row = {"variant": name, **knobs}
    try:
        result = step(pool[0])
        keys = ("loss", "grad_hidden", "grad_weight")
        row["rel_error"] = {
            k: relative_error(a, b) for k, a, b in zip(keys, result, ref, strict=True)
        }
        del result
        times = time_ms(step, pool, args.repeats, device)
        ms = statistics.median(times)
        row |= {
            "ms": ms,
            "ms_p10_p90": [sorted(times)[len(times) // 10], sorted(times)[-1 - len(times) // 10]],
            "tflops": flops / ms / 1e9,
            "extra_peak_gib": extra_peak_gib(step, pool[0], device),
        }
    except Exception as e:  # noqa: BLE001 - a failed variant is a finding, not the end
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"  {name}: {row.get('ms', float('nan')):.2f} ms {row.get('error', '')}", flush=True)
    return row


def library_variants() -> tuple[list[tuple[str, Step, dict]], list[dict]]:
    """The libraries' fused heads (`opt.custom_op.backend`) to time, and a "not installed" row
    for each that cannot be imported here."""
    variants, absent = [], []
    for backend, (package, _, _) in LIBRARIES.items():
        why = missing(backend)
        if why:
            print(f"  {package}: not installed ({why})", flush=True)
            absent.append({"variant": package, "backend": backend, "status": "not installed",
                           "detail": why})  # fmt: skip
            continue
        name = f"{package} {importlib.metadata.version(package)}"
        variants.append((name, autograd_step(LOSSES[backend]), {"backend": backend}))
    return variants, absent


def bench_shape(shape: str, tokens: int, width: int, args, device: torch.device) -> list[dict]:
    print(f"[{shape}] {tokens} tokens x {width} -> {PADDED_VOCAB} (real {VOCAB}), bfloat16")
    pool = [make_inputs(tokens, width, device, seed) for seed in range(args.input_sets)]
    flops = 6 * tokens * width * PADDED_VOCAB  # forward GEMM + two backward GEMMs
    variants: list[tuple[str, Step, dict]] = [("eager plain head", autograd_step(plain_head), {})]
    if not args.no_compile:
        compiled = torch.compile(plain_head)
        variants.append(("compiled plain head", autograd_step(compiled), {}))
    configs = [(c, *DEFAULT_KERNEL) for c in CHUNKS]
    configs += [(DEFAULT_CHUNK, b, w) for b, w in KERNELS if (b, w) != DEFAULT_KERNEL]
    for chunk, block, warps in configs:
        op = functools.partial(linear_cross_entropy, chunk_size=chunk, block=block, num_warps=warps)
        knobs = {"chunk_size": chunk, "block": block, "num_warps": warps}
        variants.append((f"op chunk={chunk} block={block} warps={warps}", autograd_step(op), knobs))
    for chunk in (0, DEFAULT_CHUNK):  # float8 matmuls for the logits and grad_hidden
        op = functools.partial(linear_cross_entropy, chunk_size=chunk, float8=True)
        knobs = {"chunk_size": chunk, "float8": True}
        variants.append((f"op chunk={chunk} float8", autograd_step(op), knobs))
    default_op = functools.partial(linear_cross_entropy, chunk_size=DEFAULT_CHUNK)
    if not args.no_compile:
        step = autograd_step(torch.compile(default_op))
        variants.append((f"op chunk={DEFAULT_CHUNK}, torch.compile'd", step, {}))
    name = f"PyTorch reference chunk={DEFAULT_CHUNK} (no Triton)"
    variants.append((name, reference_step(DEFAULT_CHUNK), {"chunk_size": DEFAULT_CHUNK}))
    libraries, absent = library_variants()

    ref = float32_reference(pool[0])
    rows = []
    for name, step, knobs in variants + libraries:
        row = run_variant(name, step, pool, ref, args, flops, device, **knobs)
        rows.append({"shape": shape, "tokens": tokens, "width": width, **row})
    rows += [{"shape": shape, "tokens": tokens, "width": width, **row} for row in absent]
    del pool, ref
    return rows


def bench_kernel(tokens: int, args, device: torch.device) -> list[dict]:
    """The Triton kernel alone on a (tokens, 50304) bfloat16 buffer: it must read and write it
    once, so its bandwidth is compared with a copy moving the same bytes."""
    print(f"[kernel] {tokens} x {PADDED_VOCAB} bfloat16 logits")
    logits = torch.randn(tokens, PADDED_VOCAB, device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, VOCAB, (tokens,), device=device)
    losses = torch.empty(tokens, device=device)
    moved = 2 * logits.numel() * logits.element_size()  # read + write
    out = torch.empty_like(logits)
    candidates: list[tuple[str, Callable[[None], object]]] = [
        ("copy (same bytes)", lambda _: out.copy_(logits))
    ]
    rows: list[dict[str, Any]] = []
    try:
        from kernels.triton_cross_entropy import cross_entropy_rows_

        for block, warps in KERNELS:
            run = functools.partial(
                cross_entropy_rows_, logits, targets, losses, VOCAB, block, warps
            )
            # (mypy cannot infer a lambda with a default argument)
            candidates.append((f"kernel block={block} warps={warps}", lambda _, r=run: r()))  # type: ignore[misc]
    except Exception as e:  # noqa: BLE001
        rows.append({"variant": "Triton kernel", "error": f"{type(e).__name__}: {e}"})
    for name, fn in candidates:
        try:
            ms = statistics.median(time_ms(fn, [None], args.repeats, device))
            rows.append({"variant": name, "ms": ms, "gb_per_s": moved / ms / 1e6})
        except Exception as e:  # noqa: BLE001
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
        print(f"  {name}: {rows[-1].get('ms', float('nan')):.3f} ms {rows[-1].get('error', '')}")
    copy_rate = next((r.get("gb_per_s") for r in rows if r["variant"].startswith("copy")), None)
    for row in rows:
        if copy_rate and "gb_per_s" in row:
            row["vs_copy"] = row["gb_per_s"] / copy_rate
    return rows


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else format(value, spec) + suffix


def markdown(report: dict) -> str:
    lines = [
        "# The fused head + cross-entropy (+opt=custom_op): op-level benchmark",
        "",
        f"`{report['command']}` on {report['device']}, torch {report['torch']}, "
        f"triton {report['triton']}, {report['date']}, commit {report['commit']}.",
        "Forward + backward of GPT-2's head and loss in bfloat16 (vocabulary 50257 padded to "
        f"50304); median of {report['repeats']} passes; extra peak = the pass's peak memory above "
        "its inputs and their gradients; errors relative to the plain head in float32 on the "
        "same inputs.",
        "",
    ]
    for shape in dict.fromkeys(r["shape"] for r in report["head"]):
        rows = [r for r in report["head"] if r["shape"] == shape]
        compiled = next((r["ms"] for r in rows if r["variant"] == "compiled plain head"
                         and "ms" in r), None)  # fmt: skip
        lines += [
            f"## {shape}: {rows[0]['tokens']} tokens x {rows[0]['width']}",
            "",
            "| variant | ms | TFLOP/s | vs compiled | extra peak GiB | loss err | "
            "grad_hidden err | grad_weight err |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if "error" in r or "status" in r:
                why = f"failed: {r['error']}" if "error" in r else f"{r['status']}: {r['detail']}"
                lines.append(f"| {r['variant']} | {why} | | | | | | |")
                continue
            err = r.get("rel_error", {})
            speedup = compiled / r["ms"] if compiled else None
            lines.append(
                f"| {r['variant']} | {r['ms']:.2f} | {r['tflops']:.0f} "
                f"| {_fmt(speedup, '.2f', 'x')} "
                f"| {_fmt(r['extra_peak_gib'], '.2f')} | {_fmt(err.get('loss'), '.1e')} "
                f"| {_fmt(err.get('grad_hidden'), '.1e')} | {_fmt(err.get('grad_weight'), '.1e')} |"
            )
        lines.append("")
    if report["kernel"]:
        lines += [
            f"## The Triton kernel alone: {report['kernel_tokens']} x 50304 bfloat16 logits, "
            "read and overwritten once",
            "",
            "| variant | ms | GB/s | vs copy |",
            "|---|---|---|---|",
        ]
        for r in report["kernel"]:
            if "error" in r:
                lines.append(f"| {r['variant']} | failed: {r['error']} | | |")
            else:
                lines.append(
                    f"| {r['variant']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} "
                    f"| {_fmt(r.get('vs_copy'), '.2f')} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for head_op.{json,md}")
    parser.add_argument("--shapes", nargs="+", default=["gpt2"], choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=20, help="timed passes per variant")
    parser.add_argument("--input-sets", type=int, default=2, help="random input sets cycled")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the harness")
    parser.add_argument("--tokens", type=int, help="override the tokens of every shape (smoke)")
    parser.add_argument("--width", type=int, help="override the width of every shape (smoke)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(
            "no CUDA GPU here: this benchmark is for a GPU (--device cpu only smoke-tests)"
        )
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "date": date.today().isoformat(),
        "commit": git_commit(),
        "command": "python scripts/bench_head.py " + " ".join(argv or sys.argv[1:]),
        "repeats": args.repeats,
        "head": [],
    }
    for shape in args.shapes:
        tokens, width = SHAPES[shape]
        tokens, width = args.tokens or tokens, args.width or width
        report["head"] += bench_shape(shape, tokens, width, args, device)
    report["kernel_tokens"] = args.tokens or SHAPES["gpt2"][0]
    report["kernel"] = bench_kernel(report["kernel_tokens"], args, device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_op.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out / "head_op.md").write_text(text)
    print(text)
    return report
