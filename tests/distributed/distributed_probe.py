"""Run by test_distributed.py under `torchrun --nproc_per_node=2`: checks of DDP and FSDP2
that need several processes, on CPUs (gloo; compiled with the quick aot_eager backend) or with
`cuda` as the second argument on two GPUs (NCCL; Inductor). Each rank writes its findings to
<out>/rank<r>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.distributed as torch_dist
from omegaconf import DictConfig, OmegaConf
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import opt  # noqa: E402
from base import distributed  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from recipe.guard import NonFiniteGuard  # noqa: E402
from train import train_step  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf"


def _toy() -> GPT:
    torch.manual_seed(0)
    with torch.device(dist.device):
        return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64))


def _plan(*stages: str, **knobs: dict) -> tuple[DictConfig, opt.Plan]:
    """The config of `+opt=[stages]` with `knobs` ({stage: {knob: value}}), and its plan."""
    cfg = OmegaConf.load(CONF / "config.yaml")
    cfg.opt = {s: OmegaConf.load(CONF / f"opt/{s}.yaml")[s] for s in stages}
    cfg.train.batch_size = 4
    cfg = OmegaConf.merge(cfg, {"opt": knobs})
    return cfg, opt.plan(cfg, dist)  # type: ignore[return-value, arg-type]  # a mapping


def _losses(*stages: str, steps: int = 3, **knobs: dict) -> list[float]:
    """This rank's losses over a few AdamW steps, each rank on its own batches."""
    cfg, plan = _plan(*stages, **knobs)
    model = _toy()
    train_model = opt.apply_model_stages(model, cfg.opt, plan, dist)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = plan.grad_scaler(dist.device)
    generator = torch.Generator().manual_seed(dist.rank)  # on the CPU: the same batches on a GPU
    batches = torch.randint(0, 64, (steps, 4, 9), generator=generator).to(dist.device)
    guard, losses = NonFiniteGuard(dist.device, dist, max_bad_steps=3), []
    step = opt.build_step(cfg.opt, plan, guard, model, train_model, optimizer, scaler)
    for batch in batches:
        loss, _ = train_step(step, batch[:, :-1], batch[:, 1:], 1.0)
        losses.append(loss.item())
    return losses


def _compiled(*stages: str, **knobs: dict) -> dict:
    """What dynamo did while a few steps ran: graph breaks, unsupported code (each a break),
    frames it gave up on (run eagerly instead), and the graphs it captured."""
    torch._dynamo.reset()
    counters.clear()
    knobs["compile"] = {"backend": BACKEND, **knobs.get("compile", {})}
    _losses(*stages, "compile", steps=2, **knobs)
    breaks = [*counters["graph_break"], *counters["unimplemented"]]
    frames = counters["frames"]
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "unimplemented": sum(counters["unimplemented"].values()),
        "frames_skipped": frames["total"] - frames["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "first_break": breaks[0][:300] if breaks else None,
    }


dist = distributed.init(sys.argv[2] if len(sys.argv) > 2 else "cpu")
BACKEND = "inductor" if dist.device.type == "cuda" else "aot_eager"  # quick to compile on a CPU
found: dict = {}

# 1. Each rank holds about 1/W of the parameters.
model = _toy()
total = sum(p.numel() for p in model.parameters())
cfg, plan = _plan("fsdp")
opt.apply_model_stages(model, cfg.opt, plan, dist)
found["local_fraction"] = sum(p.to_local().numel() for p in model.parameters()) / total  # type: ignore[attr-defined]

# 2. Accumulation: no reduce-scatter (no sharded gradient yet) before the last micro-step.
cfg, plan = _plan("fsdp", "accum")
model = _toy()
opt.apply_model_stages(model, cfg.opt, plan, dist)
batch = torch.randint(0, 64, (4, 9), device=dist.device)
with opt.gradient_sync(model, False):
    model(batch[:2, :-1], batch[:2, 1:])[1].backward()
found["grads_after_unsynced_micro_step"] = sum(p.grad is not None for p in model.parameters())
with opt.gradient_sync(model, True):
    model(batch[2:, :-1], batch[2:, 1:])[1].backward()
found["grads_after_last_micro_step"] = sum(p.grad is not None for p in model.parameters())

# 3. float16: an overflow in one rank's gradient shard makes every rank skip the step.
cfg, plan = _plan("fsdp", "amp", amp={"dtype": "float16"})
model = _toy()
opt.apply_model_stages(model, cfg.opt, plan, dist)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
scaler = plan.grad_scaler(dist.device)
with plan.autocast(dist.device):
    loss = model(batch[:, :-1], batch[:, 1:])[1]
scaler.scale(loss).backward()
if dist.rank == 1:  # an overflow in rank 1's shard of one gradient only
    next(model.parameters()).grad.to_local().fill_(float("inf"))
# FSDP made the parameters DTensors (typed as plain tensors): hence the ignores
before = [p.detach().to_local().clone() for p in model.parameters()]  # type: ignore[attr-defined]
scaler.step(optimizer)
scaler.update()
found["params_unchanged"] = all(
    torch.equal(b, p.detach().to_local())  # type: ignore[attr-defined]
    for b, p in zip(before, model.parameters(), strict=True)
)
found["scale_after"] = scaler.get_scale()
found["scaler"] = type(scaler).__name__

# 4. Compile under DDP and FSDP: what dynamo captured, and where it gave up.
found["compiled"] = {
    "ddp": _compiled(),
    "fsdp": _compiled("fsdp"),
    "fsdp_ac": _compiled("fsdp", "ac"),
    "fsdp_block": _compiled("fsdp", compile={"scope": "block"}),
}
torch._dynamo.reset()

# 5. Mixed precision: FSDP's default runs DDP+amp's math; `pure` runs another.
bf16: dict[str, Any] = {"amp": {"dtype": "bfloat16"}}
found["losses"] = {
    "ddp_fp32": _losses(),
    "ddp_amp": _losses("amp", **bf16),
    "fsdp_amp": _losses("fsdp", "amp", **bf16),
    "fsdp_amp_pure": _losses("fsdp", "amp", **bf16, fsdp={"mixed_precision": "pure"}),
}

# 6. The stop vote: rank 1 asks to stop at call 2; every rank hears it at call 3.
found["votes"] = [dist.any_one_step_late(dist.rank == 1 and call >= 2) for call in range(5)]
dist.host_barrier()

out = Path(sys.argv[1])
(out / f"rank{dist.rank}.json").write_text(json.dumps(found))
torch_dist.barrier()
distributed.shutdown()
