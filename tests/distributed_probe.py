"""Run by tests/test_distributed.py under `torchrun --nproc_per_node=2` (CPU, gloo): checks of
FSDP2 that need several processes. Each rank writes its findings to <out>/rank<r>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import opt  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from recipe import distributed  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def _toy() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64))


def _plan(*stages: str, **overrides) -> tuple[opt.Plan, OmegaConf]:
    cfg = OmegaConf.load(CONF / "config.yaml")
    cfg.opt = {s: OmegaConf.load(CONF / f"opt/{s}.yaml")[s] for s in stages}
    cfg.train.batch_size = 4
    return cfg, opt.plan(OmegaConf.merge(cfg, overrides), dist)


dist = distributed.init("cpu")
found: dict = {}

# 1. Each rank holds about 1/W of the parameters.
model = _toy()
total = sum(p.numel() for p in model.parameters())
cfg, plan = _plan("fsdp")
opt.apply_model_stages(model, cfg.opt, plan, dist)
found["local_fraction"] = sum(p.to_local().numel() for p in model.parameters()) / total

# 2. Accumulation: no reduce-scatter (no sharded gradient yet) before the last micro-step.
cfg, plan = _plan("fsdp", "accum")
model = _toy()
opt.apply_model_stages(model, cfg.opt, plan, dist)
batch = torch.randint(0, 64, (4, 9))
with opt.gradient_sync(model, False):
    model(batch[:2, :-1], batch[:2, 1:])[1].backward()
found["grads_after_unsynced_micro_step"] = sum(p.grad is not None for p in model.parameters())
with opt.gradient_sync(model, True):
    model(batch[2:, :-1], batch[2:, 1:])[1].backward()
found["grads_after_last_micro_step"] = sum(p.grad is not None for p in model.parameters())

# 3. float16: an overflow in one rank's gradient shard makes every rank skip the step.
cfg, plan = _plan("fsdp", "amp")
model = _toy()
opt.apply_model_stages(model, cfg.opt, plan, dist)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
scaler = plan.grad_scaler(dist.device)
scaler.scale(model(batch[:, :-1], batch[:, 1:])[1]).backward()
if dist.rank == 1:  # an overflow in rank 1's shard of one gradient only
    next(model.parameters()).grad.to_local().fill_(float("inf"))
before = [p.detach().to_local().clone() for p in model.parameters()]
scaler.step(optimizer)
scaler.update()
found["params_unchanged"] = all(
    torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters(), strict=True)
)
found["scale_after"] = scaler.get_scale()
found["scaler"] = type(scaler).__name__

out = Path(sys.argv[1])
(out / f"rank{dist.rank}.json").write_text(json.dumps(found))
torch_dist.barrier()
distributed.shutdown()
