"""Where a training step's GPU time goes: a profiler trace (`+prof=trace`) split by kernel family,
each family set against what it would cost at the GPU's roofline.

    python scripts/step_budget.py outputs/run/trace.json --n-layer 12 --n-embd 768 \\
        --batch 32 --block 1024 --json budget.json

Families, from the kernel names: matmul (cuBLAS/CUTLASS/Triton GEMMs), attention (flash, cuDNN
and memory-efficient SDPA), loss (cross-entropy and the fused head), optimizer (AdamW and the
gradient-norm clip), norm/elementwise (LayerNorm, GELU, residual adds, bias gradients, the
embedding: mostly Inductor's fused Triton kernels), copies (memcpy/memset/cat), communication
(NCCL), other. Idle is the part of the recorded window in which no kernel runs.

A trace recorded on a CPU has no kernels: its operators are split by the same rules, each by its
self time (nested operators count once) under the family of its outermost operator that has one
(everything under `Optimizer.step#AdamW.step` is the optimizer's); idle is then the time in no
operator (Python, waiting for a batch). `scripts/ablate.py ... profile=true` uses `budget()` for
every row of a ladder.

Recording costs host time per CPU operator and per kernel launch; in a step whose host barely
keeps ahead of the GPU that cost shows as GPU idle (GPT-2 XL's lowbit row: traced 1.2-1.3x its
untraced step, with or without the CPU's operators). A trace of the kernels only
(`prof.trace.cpu=false`) has no step marks: its window is the first to the last kernel, over
`--steps` (the trace's `active` steps).

The roofline column is a floor computed from the model's shapes (assumptions below), at the
measured ceilings of the GPU (`--tflops`, `--tbps`): it says how far each family is from what
the hardware allows, not what any kernel could reach.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

# First match wins. The GPU's kernel names, then (`aten::...`, autograd's `...Backward0`) the
# CPU's operator names: on a CPU, the aten operators no other family claims are pointwise ops and
# reductions (add, mul, gelu, embedding, sum), so they are norm/elementwise.
FAMILIES = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|cudnn", re.I)),
    ("optimizer", re.compile(r"adam|lpnorm|multi_tensor_apply|_foreach_", re.I)),
    ("loss", re.compile(r"log_?softmax|nll_?loss|cross_entropy|linear_ce", re.I)),
    (
        "matmul",
        re.compile(
            r"gemm|nvjet|xmma|cutlass|cublas|wgmma|splitk|triton_tem_"
            r"|aten::(addmm|mm|bmm|matmul|linear)\b|(addmm|mm|bmm)backward",
            re.I,
        ),
    ),
    ("copies", re.compile(r"memcpy|memset|copy_kernel|catarray|aten::(copy_|cat|stack)\b", re.I)),
    (
        "norm/elementwise",
        re.compile(r"triton_|norm|elementwise|vectorized|reduce|gelu|aten::", re.I),
    ),
)
ORDER = [name for name, _ in FAMILIES] + ["other", "idle"]
# NCCL's point-to-point kernels (a pipeline's activations and gradients between stages): while
# one runs and nothing else does, the stage is waiting for its neighbour, i.e. in the bubble.
P2P = re.compile(r"nccl.*(sendrecv|_send|_recv)", re.I)
# The parts of a parallel step, on one rank's GPU timeline (`parallel_breakdown`).
PARTS = ("compute", "exposed_comm", "pipeline_wait", "idle")


class Op(NamedTuple):
    """A kernel (or, in a CPU trace, an operator) with its family and the time counted for it
    (`self_us`: a kernel's duration, an operator's less the operators it calls)."""

    name: str
    family: str
    ts: float
    dur: float
    self_us: float


def family(name: str, category: str) -> str:
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    for fam, pattern in FAMILIES:
        if pattern.search(name):
            return fam
    return "other"


def gpu_events(trace: dict) -> list[Op]:
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    return [
        Op(e.get("name", ""), family(e.get("name", ""), e["cat"]), e["ts"], e["dur"], e["dur"])
        for e in trace["traceEvents"]
        if e.get("cat") in kinds and e.get("dur", 0) > 0
    ]


def cpu_events(trace: dict) -> list[Op]:
    """The operators of a CPU trace (and the `record_function` ranges around them, such as
    `Optimizer.step#AdamW.step`), each with its self time and the family of its outermost
    enclosing operator that has one, so that the ops inside the optimizer's step, the loss or a
    linear layer count for those, whatever their own names."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in trace["traceEvents"]:
        step = e.get("name", "").startswith("ProfilerStep#")
        if e.get("cat") in ("cpu_op", "user_annotation") and e.get("dur", 0) > 0 and not step:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    ops: list[Op] = []
    for events in by_thread.values():
        stack: list[int] = []  # the enclosing ops, as positions in `ops`
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):  # outer before inner
            while stack and ops[stack[-1]].ts + ops[stack[-1]].dur <= e["ts"]:
                stack.pop()
            fam = ops[stack[-1]].family if stack else "other"
            if stack:  # the parent's own time is what its children leave
                parent = ops[stack[-1]]
                ops[stack[-1]] = parent._replace(self_us=parent.self_us - e["dur"])
            if fam == "other":
                fam = family(e.get("name", ""), e["cat"])
            stack.append(len(ops))
            ops.append(Op(e.get("name", ""), fam, e["ts"], e["dur"], e["dur"]))
    return ops


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def parallel_breakdown(trace: dict) -> dict[str, float] | None:
    """Where one rank's recorded steps went, in ms per step, the parts adding up to the step:
    `compute` (some kernel other than NCCL's runs), `exposed_comm` (a collective runs and no
    computation: communication that nothing overlaps), `pipeline_wait` (only a send/recv runs:
    the stage waits for its neighbour, the pipeline's bubble), `idle` (no kernel at all: the GPU
    waits for the host). Also `comm` (every collective's time) and `step`. None for a trace
    without GPU kernels (a CPU run), whose operators do not show what overlaps."""
    kernels = gpu_events(trace)
    spans = step_spans(trace)
    if not kernels or not spans:
        return None
    start, end = min(a for a, _ in spans), max(b for _, b in spans)

    def clipped(ops: list[Op]) -> list[tuple[float, float]]:
        inside = [(max(o.ts, start), min(o.ts + o.dur, end)) for o in ops]
        return [(a, b) for a, b in inside if b > a]

    comm = [k for k in kernels if k.family == "communication"]
    p2p = clipped([k for k in comm if P2P.search(k.name)])
    collectives = clipped([k for k in comm if not P2P.search(k.name)])
    compute = clipped([k for k in kernels if k.family != "communication"])
    busy_compute = busy_time(compute)
    busy_with_collectives = busy_time(compute + collectives)
    busy_all = busy_time(compute + collectives + p2p)
    steps, window = len(spans), end - start
    us = {
        "compute": busy_compute,
        "exposed_comm": busy_with_collectives - busy_compute,
        "pipeline_wait": busy_all - busy_with_collectives,
        "idle": window - busy_all,
        "comm": busy_time(collectives),
        "step": window,
    }
    return {k: v / 1e3 / steps for k, v in us.items()}


def roofline_ms(a: argparse.Namespace) -> dict[str, float]:
    """Per-step floors (ms). Assumptions: matmuls 6 x weight-matmul params x tokens FLOPs;
    causal attention 7 T^2 C FLOPs per layer and sequence (forward 2, backward 5 of the T^2 C
    products, half the square skipped); the loss reads the logits once and writes their gradient
    once in bf16 (2 x 2 bytes x tokens x V); fused AdamW + clipping move ~40 bytes per fp32
    parameter (read p, g, m, v; write p, m, v; read g for the norm; scale g); norm/elementwise
    traffic is ~132 bytes x C per layer and token (forward ~44 C: LayerNorms reading the fp32
    residual and writing bf16, the GELU's 4C in and out, two residual adds; backward about twice
    that), with the biases' gradient reductions fused into it."""
    tokens, C, L, V = a.batch * a.block, a.n_embd, a.n_layer, a.vocab
    flops_per_s, bytes_per_s = a.tflops * 1e12, a.tbps * 1e12
    matmul_params = L * 12 * C * C + V * C
    params = matmul_params + a.block * C + L * (13 * C) + 2 * C  # + positions, biases, norms
    return {
        "matmul": 1e3 * 6 * matmul_params * tokens / flops_per_s,
        "attention": 1e3 * 7 * a.block * a.block * C * L * a.batch / flops_per_s,
        "loss": 1e3 * 4 * tokens * V / bytes_per_s,
        "optimizer": 1e3 * 40 * params / bytes_per_s,
        "norm/elementwise": 1e3 * 132 * C * L * tokens / bytes_per_s,
    }


def step_spans(trace: dict, category: str = "gpu_user_annotation") -> list[tuple[float, float]]:
    """The recorded steps (the profiler's `ProfilerStep#N` ranges) on the GPU's timeline, as the
    GPU executed them, or with `category="user_annotation"` on the CPU's; empty for a trace that
    has none. A step whose kernels ran on several streams (a side stream copying the next batch)
    is marked once per stream: its span is their union, one per step."""
    spans: dict[str, tuple[float, float]] = {}
    for e in trace["traceEvents"]:
        name = e.get("name", "")
        if e.get("cat") != category or not name.startswith("ProfilerStep#"):
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        if name in spans:
            start, end = min(start, spans[name][0]), max(end, spans[name][1])
        spans[name] = (start, end)
    return sorted(spans.values())


def budget(trace: dict, steps: int) -> dict[str, Any]:
    """Per-step GPU time by family (a CPU trace: CPU time by operator family). The window is the
    recorded steps as the GPU ran them when the trace marks them (kernels launched earlier but
    run inside count; those outside do not), else first to last kernel over `steps`."""
    events, annotation = gpu_events(trace), "gpu_user_annotation"
    if not events:  # recorded on a CPU
        events, annotation = cpu_events(trace), "user_annotation"
    if not events:
        raise SystemExit("no GPU kernels or CPU operators in this trace: was it +prof=trace's?")
    spans = step_spans(trace, annotation)
    if spans:
        first, last = min(a for a, _ in spans), max(b for _, b in spans)
        events = [e for e in events if first <= e.ts < last]
        steps = len(spans)
    per_family: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    top: dict[str, float] = defaultdict(float)
    for e in events:
        per_family[e.family] += e.self_us
        counts[e.family] += 1
        top[e.name[:120]] += e.self_us
    start = first if spans else min(e.ts for e in events)
    end = last if spans else max(e.ts + e.dur for e in events)
    window = end - start
    busy = busy_time([(e.ts, min(e.ts + e.dur, end)) for e in events])
    per_family["idle"] = window - busy
    ms = {k: v / 1e3 / steps for k, v in per_family.items()}
    return {
        "timeline": "GPU" if annotation == "gpu_user_annotation" else "CPU",
        "steps": steps,
        "step_ms": window / 1e3 / steps,
        "busy_ms": busy / 1e3 / steps,
        "family_ms": {k: ms.get(k, 0.0) for k in ORDER},
        "kernels_per_step": {k: counts[k] / steps for k in counts},
        "top_kernels_ms": {
            name: t / 1e3 / steps for name, t in sorted(top.items(), key=lambda kv: -kv[1])[:15]
        },
    }


def markdown(result: dict[str, Any]) -> str:
    floors, timeline = result["roofline_ms"], result.get("timeline", "GPU")
    lines = [
        f"{timeline} window {result['step_ms']:.1f} ms/step ({result['steps']} steps), "
        f"{'kernels' if timeline == 'GPU' else 'operators'} busy {result['busy_ms']:.1f} ms.",
        "",
        "| family | ms/step | share | kernels/step | roofline ms | measured / roofline |",
        "|---|---|---|---|---|---|",
    ]
    for fam in ORDER:
        t = result["family_ms"][fam]
        if t == 0:
            continue
        floor = floors.get(fam)
        ratio = f"{t / floor:.1f}x" if floor else "–"
        kernels = result["kernels_per_step"].get(fam)
        lines.append(
            f"| {fam} | {t:.2f} | {100 * t / result['step_ms']:.0f}% | "
            f"{'–' if kernels is None else f'{kernels:.0f}'} | "
            f"{'–' if floor is None else f'{floor:.2f}'} | {ratio} |"
        )
    lines += ["", "Largest kernels (ms/step):", ""]
    lines += [f"- {t:.2f} `{name}`" for name, t in result["top_kernels_ms"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="trace.json written by +prof=trace")
    parser.add_argument("--steps", type=int, default=3, help="steps recorded (prof.trace.active)")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304, help="padded vocabulary")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step on this GPU")
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--tflops", type=float, default=790.0, help="measured bf16 GEMM ceiling")
    parser.add_argument("--tbps", type=float, default=3.0, help="measured copy bandwidth, TB/s")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    result = budget(json.loads(args.trace.read_text()), args.steps)
    result["roofline_ms"] = roofline_ms(args) if result["timeline"] == "GPU" else {}
    result["assumptions"] = {k: v for k, v in vars(args).items() if k not in ("trace", "json")}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(markdown(result))
