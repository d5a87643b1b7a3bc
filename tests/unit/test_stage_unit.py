"""What a stage is (opt/stage.py): each module declares its stage; STAGES both orders and applies
them; the knobs are typed and checked before any work (tests/runs/test_errors.py runs a bad knob of
every stage through train() with an empty data cache)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

import opt
from base.distributed import Distributed
from helpers import ROOT, make_cfg, planned
from model import GPT, GPTConfig
from opt import tp
from opt.opt_in_backward import InBackwardStep, StepInBackward
from opt.stage import PHASES
from recipe.guard import NonFiniteGuard

CONF = ROOT / "conf" / "opt"
SINGLE = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_every_yaml_file_is_one_stage_whose_knobs_are_its_keys() -> None:
    assert sorted(p.stem for p in CONF.glob("*.yaml")) == sorted(opt.ORDER)
    for stage in opt.STAGES:
        keys = list(OmegaConf.load(CONF / f"{stage.name}.yaml")[stage.name])
        fields = [f.name for f in dataclasses.fields(stage.knobs)] if stage.knobs else []
        assert keys == fields, stage.name


def test_stages_run_phase_by_phase_and_conflicts_name_real_stages() -> None:
    phases = [PHASES.index(stage.phase) for stage in opt.STAGES]
    assert phases == sorted(phases)
    for stage in opt.STAGES:
        assert set(stage.conflicts) <= set(opt.ORDER), stage.name


@pytest.mark.parametrize(
    "listed",
    [
        ["compile", "ac", "opt_in_backward", "amp", "tf32", "non_blocking", "workers", "bs",
         "custom_op", "lowbit"],
        ["accum", "fused", "bs", "compile", "ac"],
    ],
)  # fmt: skip
def test_the_stages_are_applied_in_the_order_of_stages(monkeypatch, listed) -> None:
    """Spies on every stage's apply (and unselected): they run in STAGES' order whatever the
    order listed, each once, through the three calls the trainer makes."""
    calls: list[str] = []

    def spy(stage: opt.Stage) -> opt.Stage:
        def record(ctx, name=stage.name) -> None:
            calls.append(name)

        unselected = record if stage.unselected else None
        return dataclasses.replace(stage, apply=record, unselected=unselected, check=None)

    monkeypatch.setattr(opt, "STAGES", tuple(spy(s) for s in opt.STAGES))
    cfg = make_cfg(f"+opt=[{','.join(listed)}]", "train.grad_clip=inf")
    plan = opt.plan(cfg, SINGLE)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16))
    assert opt.apply_model_stages(model, cfg.opt, plan, SINGLE) is model
    optimizer = torch.optim.AdamW(model.parameters())
    guard, scaler = NonFiniteGuard(SINGLE.device, SINGLE, 3), plan.grad_scaler(SINGLE.device)
    opt.build_step(cfg.opt, plan, guard, model, model, optimizer, scaler)
    with_defaults = {s.name for s in opt.STAGES if s.unselected}  # tf32's reset, DDP's default
    assert calls == [s for s in opt.ORDER if s in listed or s in with_defaults]


def test_the_step_in_backward_owns_its_step() -> None:
    """Under +opt=opt_in_backward the step steps a wrapper whose own step does nothing (the
    hooks stepped), sharing the optimizer's groups and state, and the gradient norm it logs is
    the one measured in backward."""
    cfg = make_cfg("+opt=opt_in_backward", "train.grad_clip=inf")
    plan = opt.plan(cfg, SINGLE)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard, scaler = NonFiniteGuard(SINGLE.device, SINGLE, 3), plan.grad_scaler(SINGLE.device)
    step = opt.build_step(cfg.opt, plan, guard, model, model, optimizer, scaler)
    assert isinstance(step, InBackwardStep)
    stepped = step.optimizer
    assert isinstance(stepped, StepInBackward)
    assert stepped.state is optimizer.state
    assert all(a is b for a, b in zip(stepped.param_groups, optimizer.param_groups, strict=True))
    optimizer.param_groups[0]["lr"] = 0.05  # the schedule sets the optimizer's: the same groups
    assert stepped.param_groups[0]["lr"] == 0.05
    x = torch.randint(0, 16, (2, 4))
    grads = torch.autograd.grad(model(x, x)[1], list(model.parameters()))
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    before = [p.detach().clone() for p in model.parameters()]
    model(x, x)[1].backward()  # each parameter steps in its hook
    after = [p.detach().clone() for p in model.parameters()]
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    stepped.step()  # the trainer's step: nothing left to do
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters(), strict=True))
    norm = step.clip_grad_norm_(float("inf"))
    torch.testing.assert_close(norm, expected)
    assert step.clip_grad_norm_(float("inf")) == 0  # taken: the next step's
    step.optimizer_step(torch.tensor(1.0), norm)  # counted, nothing stepped again
    assert int(guard.skipped) == 0
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters(), strict=True))
    step.optimizer_step(torch.tensor(float("nan")), norm)  # a bad loss: counted as bad
    assert int(guard.skipped) == 1


def test_a_gpu_run_of_tp_is_told_how_to_replay_its_step_as_cuda_graphs(capsys) -> None:
    """tp's step waits on the host on GPUs unless Inductor replays it as CUDA graphs: the run
    says which overrides would, and says nothing where they are set or do not apply."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    on_gpus = Distributed(rank=0, local_rank=0, world_size=2, device=gpu)
    opt.plan(make_cfg("+opt=[compile,tp]"), on_gpus)  # planning only: no GPU is touched
    assert "opt.compile.mode=reduce-overhead replays it" in capsys.readouterr().out
    opt.plan(make_cfg("+opt=[compile,tp]", "opt.compile.mode=reduce-overhead"), on_gpus)
    assert "replays it" not in capsys.readouterr().out
    compiled = planned(2, "+opt=[compile,tp]")
    hint = tp.cuda_graphs_hint(compiled, "default", gpu)
    assert hint and "opt.compile.mode=reduce-overhead" in hint and "+opt=compile" not in hint
    eager = tp.cuda_graphs_hint(planned(2, "+opt=tp"), None, gpu)
    assert eager and "+opt=compile opt.compile.mode=reduce-overhead" in eager
    assert tp.cuda_graphs_hint(compiled, "reduce-overhead", gpu) is None
    assert tp.cuda_graphs_hint(compiled, "max-autotune", gpu) is None
    assert tp.cuda_graphs_hint(compiled, "default", cpu) is None
    # Layouts where the graphs were not measured: with data parallelism or a pipeline.
    assert tp.cuda_graphs_hint(planned(4, "+opt=[compile,tp]"), "default", gpu) is None
    assert tp.cuda_graphs_hint(planned(4, "+opt=[compile,tp,pp]"), "default", gpu) is None


def test_the_plan_describes_the_parallel_layout_once() -> None:
    """The stages that split or shard the model set the degrees of one ParallelDims; what
    depends on the layout asks it (and the trainer builds its mesh from it)."""
    one = planned(1).parallel
    assert (one.pp, one.tp, one.dp_replicate, one.dp_size) == (1, 1, 1, 1) and not one.meshed
    ddp = planned(4, "+opt=ddp").parallel
    assert ddp.dp_size == 4 and not ddp.meshed and not ddp.fully_sharded and not ddp.fsdp_enabled
    tp = planned(4, "+opt=tp", "opt.tp.degree=2").parallel
    assert tp.tp_enabled and not tp.pp_enabled and tp.dp_size == 2 and tp.meshed
    pp_tp = planned(8, "+opt=[tp,pp]", "opt.tp.degree=2").parallel
    assert (pp_tp.pp, pp_tp.tp, pp_tp.dp_size) == (2, 2, 2) and pp_tp.pp_enabled
    hsdp = planned(8, "+opt=fsdp", "opt.fsdp.replicas=2").parallel
    assert hsdp.fsdp_enabled and hsdp.hsdp_enabled and (hsdp.dp_size, hsdp.dp_shard) == (8, 4)
    assert hsdp.meshed and not planned(4, "+opt=fsdp").parallel.meshed  # FSDP over all: no mesh
    # Accumulation reduces after the last micro-step, but under FSDP after each (unless asked).
    assert planned(4, "+opt=accum").defer_reduce
    assert not planned(4, "+opt=[accum,fsdp]").defer_reduce
    assert planned(4, "+opt=[accum,fsdp]", "opt.accum.defer_fsdp_reduce=true").defer_reduce


def test_the_selected_stages_hooks_run_with_their_knobs(monkeypatch) -> None:
    """prepare_model runs on the plain model before the model stages; after_optimizer_step
    after every optimizer step of the loop's step, with the stage's knobs."""
    calls: list[tuple[str, object]] = []
    amp = next(s for s in opt.STAGES if s.name == "amp")
    spied = dataclasses.replace(
        amp,
        prepare_model=lambda ctx: calls.append(("prepare", ctx.knobs.dtype)),
        after_optimizer_step=lambda ctx: calls.append(("after", ctx.knobs.dtype)),
    )
    monkeypatch.setattr(opt, "STAGES", tuple(spied if s is amp else s for s in opt.STAGES))
    cfg = make_cfg("+opt=amp", "opt.amp.dtype=bfloat16", "train.grad_clip=inf")
    plan = opt.plan(cfg, SINGLE)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16))
    opt.apply_model_stages(model, cfg.opt, plan, SINGLE)
    assert calls == [("prepare", "bfloat16")]
    optimizer = torch.optim.AdamW(model.parameters())
    guard, scaler = NonFiniteGuard(SINGLE.device, SINGLE, 3), plan.grad_scaler(SINGLE.device)
    step = opt.build_step(cfg.opt, plan, guard, model, model, optimizer, scaler)
    x = torch.randint(0, 16, (2, 4))
    for _ in range(2):
        step.optimizer_step(step.forward_backward(x, x), step.clip_grad_norm_(float("inf")))
    assert calls == [("prepare", "bfloat16"), ("after", "bfloat16"), ("after", "bfloat16")]


def test_an_evaluation_leaves_out_the_stages_that_spread_training_or_only_step() -> None:
    """tools/evaluate.py plans a run's stages in one process: without those that spread training
    over processes, nor lowbit's optimizer (opt.NOT_EVALUATED); the rest keep their knobs."""
    assert {s.name for s in opt.NOT_EVALUATED} == {"ddp", "fsdp", "pp", "tp", "lowbit"}
    cfg = make_cfg("+opt=[amp,compile,ddp,fsdp,pp,tp,lowbit]", "opt.amp.dtype=float16")
    kept = opt.for_evaluation(cfg.opt)
    assert sorted(kept) == ["amp", "compile"] and kept["amp"].dtype == "float16"
