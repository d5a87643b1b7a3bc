"""Run by test_tp.py under `torchrun --nproc_per_node=2` (gloo, CPUs): +opt=tp's numbers
against the plain model in this same process, for each layout knob, and compile over the
DTensor program (aot_eager) with what dynamo captured. Rank 0 writes <out>/found.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from omegaconf import DictConfig, OmegaConf
from torch._dynamo.utils import counters
from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import opt  # noqa: E402
from base import distributed  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from opt.step import reduce_pending_grads  # noqa: E402
from opt.tp import enable_async_tp, residual_stream  # noqa: E402
from recipe.guard import NonFiniteGuard  # noqa: E402
from train import train_step  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf"
STEPS = 3


def _plan(*stages: str, **knobs: dict) -> tuple[DictConfig, opt.Plan]:
    """The config of `+opt=[stages]` with `knobs` ({stage: {knob: value}}), and its plan."""
    cfg = OmegaConf.load(CONF / "config.yaml")
    cfg.model = OmegaConf.load(CONF / "model/gpt2.yaml")
    cfg.opt = {s: OmegaConf.load(CONF / f"opt/{s}.yaml")[s] for s in stages}
    cfg.train.batch_size = 4
    cfg = OmegaConf.merge(cfg, {"opt": knobs})
    return cfg, opt.plan(cfg, world)  # type: ignore[return-value, arg-type]  # a mapping


def _losses(*stages: str, **knobs: dict) -> list[float]:
    """The losses of a few AdamW steps (clipped) on the same batches on every rank."""
    cfg, plan = _plan(*stages, **knobs)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=8, vocab_size=60))
    dist = world.with_parallel(plan.parallel)
    train_model = opt.apply_model_stages(model, cfg.opt, plan, dist) if stages else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler, guard = plan.grad_scaler(dist.device), NonFiniteGuard(dist.device, dist, 3)
    step = opt.build_step(cfg.opt, plan, guard, model, train_model, optimizer, scaler)
    batches = torch.randint(0, 60, (STEPS, 4, 9), generator=torch.Generator().manual_seed(0))
    losses = []
    for batch in batches:
        loss, _ = train_step(step, batch[:, :-1], batch[:, 1:], 0.5)
        losses.append(loss.item())
    return losses


def _compiled(*stages: str, **knobs: Any) -> dict:
    """The losses of +opt=[tp,compile] (aot_eager), and what dynamo did meanwhile: graph breaks,
    unsupported code (each a break), frames it gave up on (run eagerly), graphs captured."""
    torch._dynamo.reset()
    counters.clear()
    losses = _losses("tp", *stages, "compile", compile={"backend": "aot_eager", **knobs})
    frames = counters["frames"]
    breaks = [*counters["graph_break"], *counters["unimplemented"]]
    return {
        "losses": losses,
        "graph_breaks": sum(counters["graph_break"].values()),
        "unimplemented": sum(counters["unimplemented"].values()),
        "frames_skipped": frames["total"] - frames["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "first_break": breaks[0][:300] if breaks else None,
    }


def _local_fraction() -> float:
    """The share of the model's parameter elements that this rank holds under tp=2."""
    cfg, plan = _plan("tp")
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=8, vocab_size=60))
    total = sum(p.numel() for p in model.parameters())
    opt.apply_model_stages(model, cfg.opt, plan, world.with_parallel(plan.parallel))
    return sum(p.to_local().numel() for p in model.parameters()) / total  # type: ignore[attr-defined]


def _pending_grads() -> list[int]:
    """How many gradients are pending a sum over the group (`Partial`: sequence parallelism's
    LayerNorms and positions) after backward, and after the trainer's clipping (none should be:
    torch 2.11's clip_grad_norm_ leaves such a gradient unclipped)."""
    cfg, plan = _plan("tp", tp={"sequence_parallel": True})
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=8, vocab_size=60))
    dist = world.with_parallel(plan.parallel)
    train_model = opt.apply_model_stages(model, cfg.opt, plan, dist)
    batch = torch.randint(0, 60, (4, 9), generator=torch.Generator().manual_seed(0))
    with plan.loss_context():
        train_model(batch[:, :-1], batch[:, 1:])[1].backward()

    def pending() -> int:
        grads = [p.grad for p in model.parameters() if isinstance(p.grad, DTensor)]
        return sum(any(x.is_partial() for x in g.placements) for g in grads)

    before = pending()
    grads: dict[str, Any] = {n: p.grad for n, p in model.named_parameters()}
    params: dict[str, Any] = dict(model.named_parameters())
    expected = {n: g.redistribute(placements=params[n].placements).to_local()  # one by one
                for n, g in grads.items()}  # fmt: skip
    with CollectiveCount() as count:
        reduce_pending_grads(list(model.parameters()))
    summed = all(torch.equal(params[n].grad.to_local(), expected[n]) for n in params)
    optimizer, guard = torch.optim.AdamW(model.parameters()), NonFiniteGuard(dist.device, dist, 3)
    scaler = plan.grad_scaler(dist.device)
    opt.build_step(cfg.opt, plan, guard, model, train_model, optimizer, scaler).clip_grad_norm_(0.5)
    return [before, pending(), count.all_reduces, int(summed)]


def _step_collectives() -> dict[str, int]:
    """The collectives of one forward and backward under sequence parallelism (2 blocks), by
    kind, before the pending gradients are summed."""
    cfg, plan = _plan("tp", tp={"sequence_parallel": True})
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=8, vocab_size=60))
    train_model = opt.apply_model_stages(model, cfg.opt, plan, world.with_parallel(plan.parallel))
    batch = torch.randint(0, 60, (4, 9), generator=torch.Generator().manual_seed(0))
    with CollectiveCount() as count, plan.loss_context():
        train_model(batch[:, :-1], batch[:, 1:])[1].backward()
    return dict(count.kinds)


NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


class CollectiveCount(TorchDispatchMode):
    """Counts the collectives dispatched inside it (DTensor's redistributions run them), by
    kind (`all_reduce`, `reduce_scatter_tensor`, `all_gather_into_tensor`, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[str, int] = {}

    @property
    def all_reduces(self) -> int:
        return self.kinds.get("all_reduce", 0) + self.kinds.get("all_reduce_", 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kind = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and kind not in NOT_COLLECTIVES:
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))


def _async_tp_fusions() -> dict:
    """What Inductor's micro-pipelined tp makes of the compiled tp model once `enable_async_tp`
    has set it up for the tp group: the fused ops in the graphs it compiles (captured after
    its pass; their kernels exist on CUDA only, so the CPU run itself then fails, expectedly)."""
    cfg, plan = _plan("tp", "compile", compile={"backend": "inductor"})
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=8, vocab_size=60))
    dist = world.with_parallel(plan.parallel)
    train_model = opt.apply_model_stages(model, cfg.opt, plan, dist)
    mesh = residual_stream(dist, sequence_parallel=True).mesh
    enable_async_tp(mesh, True)
    fused: list[str] = []

    def seen(graph: torch.fx.Graph) -> None:
        fused.extend(str(n.target) for n in graph.nodes if "symm_mem" in str(n.target))

    inductor_config.post_grad_custom_post_pass = seen
    torch._dynamo.reset()
    batch = torch.randint(0, 60, (4, 9), generator=torch.Generator().manual_seed(0))
    try:
        with plan.loss_context():
            train_model(batch[:, :-1], batch[:, 1:])[1].backward()
    except NotImplementedError as e:  # symm_mem's fused ops: CUDA kernels only
        ran = str(e).split("'")[1] if "'" in str(e) else str(e)[:80]
    else:
        ran = "ran"
    finally:
        inductor_config.post_grad_custom_post_pass = None
        enable_async_tp(None, False)
    return {
        "registered": is_symm_mem_enabled_for_group(mesh.get_group().group_name),
        "fused": sorted(set(fused)),
        "run": ran,
        # torch 2.13's pass fuses nothing in a torch built without NCCL; 2.11's does
        "fusable": torch.distributed.is_nccl_available() or torch.__version__ < (2, 13),
    }


world = distributed.init("cpu")
found: dict = {"plain": _losses()}
for sp in (True, False):
    for lp in (True, False):
        tp = {"sequence_parallel": sp, "loss_parallel": lp}
        found[f"tp sp={sp} lp={lp}"] = _losses("tp", tp=tp)
# Recomputed, in two micro-batches (train_step returns their losses' sum).
found["tp ac accum"] = [s / 2 for s in _losses("tp", "ac", "accum", accum={"steps": 2})]
found["compiled"] = {
    "model": _compiled(),
    "block": _compiled(scope="block"),
    "fsdp": _compiled("fsdp"),  # in pieces between FSDP's hooks: each block, embed, head
}
found["local_fraction"] = _local_fraction()
found["pending_grads"] = _pending_grads()
found["step_collectives"] = _step_collectives()
found["async_tp"] = _async_tp_fusions()
if world.is_main:
    (Path(sys.argv[1]) / "found.json").write_text(json.dumps(found))
distributed.shutdown()
