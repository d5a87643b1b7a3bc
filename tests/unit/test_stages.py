"""Every optimization stage composes, refuses conflicts, and provably changes what runs: the
math-preserving ones give the baseline's numbers, the others show their effect."""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch.optim import adam as adam_module  # where AdamW's three implementations live

import data
import opt
from base import distributed
from base.distributed import Distributed
from helpers import CONF, compiled_against_eager, logged, make_cfg, planned, tiny_cfg
from model import GPT, GPTConfig
from opt.ac import apply_ac
from recipe.guard import NonFiniteGuard
from train import train, train_step

STAGES = sorted(p.stem for p in (CONF / "opt").glob("*.yaml"))
CPU = torch.device("cpu")
MULTI = Distributed(rank=0, local_rank=0, world_size=4, device=CPU)  # planning only: no group
# (4: pp x tp needs a multiple of 2 x 2)
SINGLE = Distributed(rank=0, local_rank=0, world_size=1, device=CPU)


# Pairs that cannot run together (written out here, independently of opt.CONFLICTS).
REFUSED = {
    frozenset(pair)
    for pair in [
        ("forloop", "foreach"), ("forloop", "fused"), ("foreach", "fused"), ("ddp", "fsdp"),
        ("lowbit", "forloop"), ("lowbit", "foreach"), ("lowbit", "fused"), ("lowbit", "offload"),
        ("offload", "fsdp"), ("offload", "ddp"), ("opt_in_backward", "accum"),
        ("opt_in_backward", "ddp"), ("opt_in_backward", "fsdp"), ("opt_in_backward", "offload"),
        ("tp", "custom_op"), ("tp", "offload"), ("tp", "opt_in_backward"),
        ("pp", "accum"), ("pp", "custom_op"), ("pp", "offload"), ("pp", "opt_in_backward"),
        ("float8", "tp"),
    ]  # (opt_in_backward with amp: refused in float16 only, test_memory_stages; auto here: bf16)
}  # fmt: skip
# Stages that run in one process only (and fsdp, in several only): planned for the right world.
ONE_PROCESS = {"offload", "opt_in_backward"}


def _conflict(stages: tuple[str, ...]) -> str | None:
    """Why a combination must be refused, or None (the rules of opt.check)."""
    if frozenset(stages) not in REFUSED:
        return None
    a, b = stages
    return f"(?=.*\\+opt={a}\\b)(?=.*\\+opt={b}\\b)"  # names both, in any order


def _planned(*stages: str) -> tuple:
    """The config for `stages` (clipping off, which opt_in_backward needs and the others do not
    mind) and a world to plan it in: one process for the one-process stages, two otherwise."""
    cfg = make_cfg(f"+opt=[{','.join(stages)}]", "train.grad_clip=inf")
    return cfg, SINGLE if ONE_PROCESS & set(stages) else MULTI


def test_every_stage_file_is_known_to_the_code() -> None:
    assert sorted(opt.ORDER) == STAGES


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_composes_alone_and_nests_under_its_name(stage: str) -> None:
    cfg, dist = _planned(stage)
    assert list(cfg.opt) == [stage]
    plan = opt.plan(cfg, dist)
    assert plan.stages == [stage]


@pytest.mark.parametrize("pair", list(itertools.combinations(STAGES, 2)), ids="+".join)
def test_every_pair_composes_or_is_refused_naming_both(pair: tuple[str, str]) -> None:
    cfg, dist = _planned(*pair)
    assert sorted(cfg.opt) == sorted(pair)
    conflict = _conflict(pair)
    if conflict is None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "\\+opt=ddp has no effect")  # ddp in one process
            assert sorted(opt.plan(cfg, dist).stages) == sorted(pair)
    else:
        with pytest.raises(ValueError, match=conflict):
            opt.plan(cfg, dist)


def test_all_compatible_stages_at_once_and_in_a_fixed_order() -> None:
    listed = [
        "fsdp",
        "compile",
        "tp",
        "ac",
        "fused",
        "amp",
        "tf32",
        "non_blocking",
        "workers",
        "accum",
        "bs",
    ]
    cfg = make_cfg(f"+opt=[{','.join(listed)}]")
    plan = opt.plan(cfg, MULTI)
    assert plan.stages == [s for s in opt.ORDER if s in listed]
    assert plan.stages.index("ac") < plan.stages.index("compile") < plan.stages.index("fsdp")
    assert plan.stages.index("tp") < plan.stages.index("ac")  # AC and compile see the DTensors


def test_sweep_syntax_composes_merged_lists() -> None:
    assert list(make_cfg("+opt=[bs,workers]").opt) == ["bs", "workers"]
    assert list(make_cfg("opt=[amp]").opt) == ["amp"]  # without '+', too


def test_unknown_stage_names_are_refused() -> None:
    cfg = make_cfg()
    cfg.opt = OmegaConf.create({"turbo": {}})
    with pytest.raises(ValueError, match=r"unknown optimization stage\(s\) \['turbo'\]"):
        opt.plan(cfg, SINGLE)


def test_sharding_or_replicating_needs_several_processes() -> None:
    with pytest.raises(ValueError, match="fsdp spreads the model over processes.*torchrun"):
        opt.plan(make_cfg("+opt=fsdp"), SINGLE)
    with pytest.warns(UserWarning, match="ddp has no effect in a single process"):
        opt.plan(make_cfg("+opt=ddp"), SINGLE)


def test_accumulation_steps_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="accum.steps=3 must divide the batch size 8"):
        opt.plan(make_cfg("+opt=accum", "opt.accum.steps=3"), SINGLE)
    with pytest.raises(ValueError, match="must divide the batch size 32"):
        opt.plan(make_cfg("+opt=[bs,accum]", "opt.accum.steps=3"), SINGLE)


def test_bad_knobs_are_refused() -> None:
    with pytest.raises(ValueError, match="opt.amp.dtype must be one of .*float8"):
        opt.plan(make_cfg("+opt=amp", "opt.amp.dtype=float8"), SINGLE)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16))
    for overrides, message in [
        (["+opt=ac", "opt.ac.mode=some"], "opt.ac.mode must be one of .*'some'"),
        (["+opt=ac", "opt.ac.mode=selective", "opt.ac.target=ffn"], "target must be .*'ffn'"),
        (["+opt=compile", "opt.compile.mode=fast"], "opt.compile.mode must be .*'fast'"),
        (["+opt=compile", "opt.compile.scope=layer"], "opt.compile.scope must be .*'layer'"),
    ]:
        cfg = make_cfg(*overrides)
        with pytest.raises(ValueError, match=message):
            opt.apply_model_stages(model, cfg.opt, opt.plan(cfg, SINGLE), SINGLE)


def test_tf32_sets_and_the_baseline_resets_matmul_precision() -> None:
    opt.plan(make_cfg("+opt=tf32"), SINGLE)
    assert torch.get_float32_matmul_precision() == "high"
    opt.plan(make_cfg(), SINGLE)
    assert torch.get_float32_matmul_precision() == "highest"


# ---- the step itself: accumulation and mixed precision


class GradRecorder(torch.optim.Optimizer):
    """An optimizer that only records the gradients it is given."""

    def __init__(self, params) -> None:
        super().__init__(params, {})
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None) -> None:  # type: ignore[override]  # no closure, no loss
        self.grads = [p.grad.clone() for g in self.param_groups for p in g["params"]]


def _toy(vocab_size: int = 64) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=vocab_size))


def _step(model: GPT, plan: opt.Plan, batch: torch.Tensor, optimizer=None, module=None):
    """One train_step of `module` (the model stages' module; default `model`)."""
    optimizer = optimizer or GradRecorder(model.parameters())
    scaler = plan.grad_scaler(CPU)
    guard = NonFiniteGuard(CPU, SINGLE, max_bad_steps=10)
    step = opt.build_step(
        OmegaConf.create({}), plan, guard, model, module or model, optimizer, scaler
    )
    losses, norm = train_step(step, batch[:, :-1], batch[:, 1:], 1e9)
    return losses / plan.micro_steps, norm, optimizer, scaler


def test_accumulation_gives_the_full_batch_loss_and_gradients() -> None:
    batch = torch.randint(0, 64, (8, 9))
    full = _step(_toy(), opt.plan(tiny_cfg("train.batch_size=8"), SINGLE), batch)
    accum_plan = opt.plan(tiny_cfg("train.batch_size=8", "+opt=accum", "opt.accum.steps=4"), SINGLE)
    assert (accum_plan.micro_steps, accum_plan.micro_batch_size) == (4, 2)
    accum = _step(_toy(), accum_plan, batch)
    assert accum[0].item() == pytest.approx(full[0].item(), rel=1e-6)  # mean of the micro-losses
    assert accum[1].item() == pytest.approx(full[1].item(), rel=1e-5)  # gradient norm
    for a, b in zip(accum[2].grads, full[2].grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_pp_runs_the_step_through_the_pipeline_schedule(tmp_path, monkeypatch) -> None:
    """+opt=pp's step is the schedule's (here one stage on one rank, 4 micro-batches): the
    full batch's loss, gradients and norm, from the pipeline's own forward and backward."""
    batch = torch.randint(0, 64, (8, 9))
    full = _step(_toy(), opt.plan(tiny_cfg("train.batch_size=8"), SINGLE), batch)
    with _world_of_one(tmp_path):
        parallel = distributed.ParallelDims(1)  # one rank: opt.plan wants 2+
        parallel.build_mesh(CPU)
        cfg = tiny_cfg("+opt=pp", "opt.pp.degree=1", "opt.pp.schedule=gpipe")
        plan = opt.Plan(stages=["pp"], batch_size=8, parallel=parallel)
        model = _toy()
        pipeline = opt.apply_model_stages(model, cfg.opt, plan, replace(SINGLE, parallel=parallel))
        assert isinstance(pipeline, opt.pp.Pipeline)
        calls = []
        schedule_step = pipeline.schedule.step
        counted = lambda *a, **k: calls.append(1) or schedule_step(*a, **k)  # noqa: E731
        monkeypatch.setattr(pipeline.schedule, "step", counted)
        piped = _step(model, plan, batch, GradRecorder(model.parameters()), module=pipeline)
    assert calls == [1]
    assert piped[0].item() == pytest.approx(full[0].item(), rel=1e-6)  # the micro-batches' mean
    assert piped[1].item() == pytest.approx(full[1].item(), rel=1e-5)  # gradient norm
    for a, b in zip(piped[2].grads, full[2].grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_accumulation_defers_the_reduction_except_under_fsdp() -> None:
    def defer(stages: str, *overrides: str) -> bool:
        return opt.plan(make_cfg(f"+opt=[{stages}]", *overrides), MULTI).defer_reduce

    assert defer("accum") and defer("accum,ddp")
    assert not defer("accum,fsdp")  # sharded gradients only: reduce-scatter every micro-step
    assert defer("accum,fsdp", "opt.accum.defer_fsdp_reduce=true")


def test_accumulation_runs_micro_batches(tmp_path, monkeypatch) -> None:
    shapes = []
    forward = GPT.forward
    monkeypatch.setattr(
        GPT, "forward", lambda self, idx, t=None: shapes.append(idx.shape) or forward(self, idx, t)
    )
    train(tiny_cfg("train.max_steps=1", "+opt=accum", "opt.accum.steps=2", "sample.num_samples=0",
                   "wandb.mode=disabled", "train.eval_sequences=2"), tmp_path)  # fmt: skip
    train_shapes = shapes[1:3]  # after the step-0 evaluation: the step's two micro-batches
    assert train_shapes == [torch.Size([2, 32]), torch.Size([2, 32])]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_amp_runs_matmuls_in_the_chosen_dtype(dtype: str) -> None:
    plan = opt.plan(tiny_cfg("+opt=amp", f"opt.amp.dtype={dtype}"), SINGLE)
    model = _toy()
    seen = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    with plan.autocast(CPU):
        _, loss = model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    assert seen == {getattr(torch, dtype)}
    assert loss.dtype == torch.float32  # the loss is computed in float32
    assert plan.scale_loss == (dtype == "float16")


@pytest.mark.parametrize(
    "residual,expected", [("float32", torch.float32), ("compute", torch.bfloat16)]
)
def test_amp_residual_sets_the_residual_streams_dtype(residual: str, expected) -> None:
    cfg = tiny_cfg("+opt=amp", "opt.amp.dtype=bfloat16", f"opt.amp.residual={residual}")
    plan = opt.plan(cfg, SINGLE)
    model = _toy()
    opt.apply_model_stages(model, cfg.opt, plan, SINGLE)
    seen = []
    for block in model.transformer.h:
        block.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    with plan.autocast(CPU):
        _, loss = model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    loss.backward()
    assert seen == [(expected, expected)] * 2 and loss.dtype == torch.float32
    with pytest.raises(ValueError, match="opt.amp.residual must be one of .*half"):
        opt.plan(tiny_cfg("+opt=amp", "opt.amp.residual=half"), SINGLE)


def test_float16_scaler_is_live_and_skips_an_overflowing_step() -> None:
    plan = opt.plan(tiny_cfg("+opt=amp", "opt.amp.dtype=float16"), SINGLE)
    model = _toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = plan.grad_scaler(CPU)
    batch = torch.randint(0, 64, (2, 9))

    guard = NonFiniteGuard(CPU, SINGLE, max_bad_steps=10)
    stepper = opt.build_step(OmegaConf.create({}), plan, guard, model, model, optimizer, scaler)

    def step() -> torch.Tensor:
        return train_step(stepper, batch[:, :-1], batch[:, 1:], 1.0)[1]

    assert torch.isfinite(step()) and scaler.get_scale() == 65536.0  # a live, healthy scaler
    with torch.no_grad():  # force an overflow: fp16 activations of this layer become inf
        model.transformer.h[0].mlp.c_fc.weight.mul_(1e6)
    before = [p.detach().clone() for p in model.parameters()]
    assert not torch.isfinite(step())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 32768.0  # skipped, and the scale backed off


# ---- activation checkpointing


def _block_saved_bytes(model: GPT, idx: torch.Tensor) -> int:
    """Bytes the transformer blocks save for backward (unique storages, parameters excluded).
    The blocks are what checkpointing acts on; the vocabulary head's logits are outside them."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, seen = [False], {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    for block in model.transformer.h:
        block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    loss.backward()
    return sum(seen.values())


def _knobs(stage: str, **overrides):
    """A stage's knobs as shipped in conf/opt/<stage>.yaml, with `overrides`."""
    return OmegaConf.merge(OmegaConf.load(CONF / f"opt/{stage}.yaml")[stage], overrides)


def test_ac_keeps_gradients_identical_and_halves_saved_activations() -> None:
    idx = torch.randint(0, 50257, (4, 128))
    cfg = make_cfg().model  # the tiny preset
    fields = {k: cfg[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**fields))
    torch.manual_seed(0)
    checkpointed = GPT(GPTConfig(**fields))
    assert apply_ac(checkpointed, _knobs("ac")) == [f"transformer.h.{i}" for i in range(4)]
    plain_bytes = _block_saved_bytes(plain, idx)
    ac_bytes = _block_saved_bytes(checkpointed, idx)
    assert ac_bytes <= plain_bytes / 2, (ac_bytes, plain_bytes)
    for (name, a), (_, b) in zip(
        plain.named_parameters(), checkpointed.named_parameters(), strict=True
    ):
        assert torch.equal(a.grad, b.grad), name  # type: ignore[arg-type]
    assert list(plain.state_dict()) == list(checkpointed.state_dict())  # names unchanged


def test_selective_ac_wraps_every_kth_sublayer() -> None:
    model = _toy()
    model.transformer.h.extend(
        GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64)).transformer.h
    )
    wrapped = apply_ac(model, _knobs("ac", mode="selective", every=2, target="mlp"))
    assert wrapped == ["transformer.h.0.mlp", "transformer.h.2.mlp"]


# ---- optimizer implementations


@pytest.fixture
def adam_calls(monkeypatch) -> list[str]:
    """Which of AdamW's three implementations ran."""
    calls: list[str] = []
    for name in ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam"):
        original = getattr(adam_module, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(adam_module, name, spy)
    return calls


def test_optimizer_implementations_run_their_kernels_and_agree(adam_calls) -> None:
    from train import build_optimizer

    batch = torch.randint(0, 64, (4, 9))
    params = {}
    for impl, kernel in [
        ("forloop", "_single_tensor_adam"),
        ("foreach", "_multi_tensor_adam"),
        ("fused", "_fused_adam"),
    ]:
        cfg = tiny_cfg(f"+opt={impl}")
        plan = opt.plan(cfg, SINGLE)
        model = _toy()
        optimizer = build_optimizer(model, cfg.train, plan.optimizer_kwargs)
        adam_calls.clear()
        for _ in range(3):
            _step(model, plan, batch, optimizer)
        assert set(adam_calls) == {kernel}, impl
        params[impl] = [p.detach() for p in model.parameters()]
    for impl in ("foreach", "fused"):
        for a, b in zip(params["forloop"], params[impl], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- input pipeline


def test_workers_and_non_blocking_reach_the_loader_and_the_copies(monkeypatch) -> None:
    plan = opt.plan(tiny_cfg("+opt=[workers,non_blocking]", "opt.workers.num_workers=2"), SINGLE)
    assert plan.loader == data.LoaderOptions(
        2, 2, pin_memory=False, non_blocking=True
    )  # CPU: no pinning
    on_gpu = opt.non_blocking.with_pinned_batches(data.LoaderOptions(), torch.device("cuda", 0))
    assert on_gpu.pin_memory and on_gpu.non_blocking

    dataset = data.load_splits(make_cfg("data=synthetic").data, block_size=8, seed=0)["train"]
    loader = data.build_loader(
        dataset, 4, rank=0, world_size=1, seed=0, options=plan.loader, num_steps=3
    )
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 2, True)
    copies = []
    to = torch.Tensor.to
    monkeypatch.setattr(
        torch.Tensor,
        "to",
        lambda self, *a, **k: copies.append(k.get("non_blocking")) or to(self, *a, **k),
    )
    batches = list(data.DeviceBatches(loader, CPU, non_blocking=True))
    assert len(batches) == 3 and copies == [True, True, True]
    baseline = data.build_loader(
        dataset, 4, rank=0, world_size=1, seed=0, options=data.LoaderOptions(), num_steps=3
    )
    copies.clear()
    baseline_batches = list(data.DeviceBatches(baseline, CPU, non_blocking=False))
    assert copies == [False, False, False]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, baseline_batches, strict=True))


def test_a_run_with_stages_logs_them_and_matches_the_baseline(
    tmp_path, capsys, wandb_calls
) -> None:
    """Math-preserving stages end-to-end: same losses; the stages show in the console, the
    run name and the wandb config."""
    args = ("train.max_steps=4", "train.log_interval=1", "sample.num_samples=0")
    train(tiny_cfg(*args, "wandb.mode=disabled"), tmp_path / "baseline")
    stages = "+opt=[workers,accum,non_blocking,ac,forloop]"
    summary = train(tiny_cfg(*args, stages, "opt.workers.num_workers=2"), tmp_path / "staged")
    assert summary["stages"] == ["accum", "workers", "non_blocking", "forloop", "ac"]
    out = capsys.readouterr().out
    assert all(f"[opt] {s}" in out for s in summary["stages"])
    (init,) = wandb_calls.init
    assert init["name"] == "tiny-accum+workers+non_blocking+forloop+ac"
    assert init["config"]["stages"] == summary["stages"]
    torch.testing.assert_close(
        logged(tmp_path / "staged", "train/loss"),
        logged(tmp_path / "baseline", "train/loss"),
        rtol=1e-5,
        atol=0,
    )


# ---- compile (one shared test: compiling is slow on a CPU)


@pytest.mark.slow
def test_compile_compiles_and_matches_eager(tmp_path) -> None:
    import torch._dynamo

    args = (
        "train.max_steps=3",
        "train.log_interval=1",
        "sample.num_samples=0",
        "wandb.mode=disabled",
    )
    counters = compiled_against_eager(tmp_path, args, [*args, "+opt=compile"], rtol=1e-4)
    assert counters["stats"]["unique_graphs"] >= 1

    model = _toy()  # scope=block compiles the blocks in place, leaving the names alone
    opt.compile.apply_compile(model, _knobs("compile", scope="block"))
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in model.transformer.h)
    assert getattr(model, "_compiled_call_impl", None) is None
    torch._dynamo.reset()


# ---- DDP's accumulation: no all-reduce on non-final micro-steps


@contextlib.contextmanager
def _world_of_one(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_accumulation_all_reduces_only_on_the_last_micro_step(tmp_path) -> None:
    with _world_of_one(tmp_path), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tiny_cfg("train.batch_size=8", "+opt=[ddp,accum]", "opt.accum.steps=4")
        plan = opt.plan(cfg, SINGLE)
        model = _toy()
        ddp = opt.ddp.apply_ddp(model, cfg.opt.ddp, SINGLE)
        reduced = []

        def count(state, bucket):
            reduced.append(bucket.index())
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, count)
        _step(model, plan, torch.randint(0, 64, (8, 9)), GradRecorder(model.parameters()), ddp)
        buckets = len(set(reduced))
        assert (
            len(reduced) == buckets
        )  # each bucket once per optimizer step, not once per micro-step


def test_compile_coordinate_descent_sets_and_resets_inductors_tuning() -> None:
    import torch._inductor.config as inductor_config

    opt.compile.apply_compile(_toy(), _knobs("compile", coordinate_descent=True))
    assert inductor_config.coordinate_descent_tuning
    opt.compile.apply_compile(_toy(), _knobs("compile"))
    assert not inductor_config.coordinate_descent_tuning
    torch._dynamo.reset()


def test_compile_puts_a_barrier_before_inductors_reloads_of_a_stored_buffer(monkeypatch) -> None:
    """opt/compile.py's reload race: a Triton kernel's load of a buffer it stored in an earlier
    reduction loop gets `tl.debug_barrier()` in the same lines first; other loads none; and
    Inductor's cache keys change with it. (The generated kernels themselves need a GPU:
    tests/unit/test_custom_op.py's `compiled_training_step` test at width 1280.)"""
    import torch._inductor.config as inductor_config
    from torch._inductor.codegen.common import IndentedBuffer
    from torch._inductor.codegen.triton import TritonKernel

    def load(kernel, name, index):  # stands for Inductor's: its line goes where it is told
        kernel.get_load_buffer(index).writeline(f"tmp = tl.load({name})")

    monkeypatch.setattr(TritonKernel, "load", load)
    # Inductor's own patch, not monkeypatch's: pytest >= 9.2 deletes a module attribute that its
    # `__dict__` lacks on undo, and a deleted Inductor config reads as absent from then on.
    with inductor_config.patch(post_grad_custom_pre_pass=None):
        opt.compile.apply_compile(_toy(), _knobs("compile"))
        torch._dynamo.reset()
        key = inductor_config.post_grad_custom_pre_pass

    class Kernel:  # what the patched load reads of a kernel
        def __init__(self) -> None:
            self.lines = IndentedBuffer()
            self.cse = type("CSE", (), {"invalidated_stores": {"buf_stored"}})()

        def get_load_buffer(self, index):
            return self.lines

    kernel = Kernel()
    for name in ("buf_stored", "buf_other"):
        TritonKernel.load(kernel, name, None)  # type: ignore[arg-type]
    assert kernel.lines.getvalue().split("\n")[:3] == [
        "tl.debug_barrier()",
        "tmp = tl.load(buf_stored)",
        "tmp = tl.load(buf_other)",
    ]
    assert "get_load_buffer" not in vars(kernel)  # the kernel's own again
    assert "barrier" in key.uuid()


@pytest.mark.parametrize(
    "stages,folder",
    [
        ("+opt=compile", "float32"),
        ("+opt=[amp,compile]", "bfloat16"),
        ("+opt=[amp,compile] opt.amp.dtype=float16", "float16"),
    ],
)
def test_compile_caches_each_precisions_graphs_in_its_own_folder(
    monkeypatch, tmp_path, stages: str, folder: str
) -> None:
    # Through the pipeline: the compile stage learns +opt=amp's dtype from the plan. torch 2.11
    # would otherwise hand a bfloat16 launch the graph a float16 launch cached (opt/compile.py).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # restored after the test
    cfg = tiny_cfg(*stages.split(), f"opt.compile.cache_dir={tmp_path}")
    opt.apply_model_stages(_toy(), cfg.opt, opt.plan(cfg, SINGLE), SINGLE)
    torch._dynamo.reset()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / folder)


def test_tp_checkpoint_layout_saves_the_strided_qkv_whole_and_splits_it_back(tmp_path) -> None:
    """+opt=tp's checkpoint layout (opt/tp.py's StridedLayout): a strided DTensor (the fused
    QKV, and its optimizer state) is saved gathered, other values as they are; a load lays it
    out as the model's own again; a whole checkpoint's tensor is put in place after the state
    dict is set (which splits it wrongly)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    layout = opt.tp.STAGE.checkpoint_layout
    assert layout is not None and opt.checkpoint_layouts(planned(2, "+opt=tp")) == [layout]
    assert opt.checkpoint_layouts(planned(2, "+opt=fsdp")) == []
    with _world_of_one(tmp_path):
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(12.0).reshape(6, 2)
        qkv = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=3)])
        plain = torch.ones(3)
        tree = {"model": {"qkv": qkv, "ln": plain},
                "optimizer": {"state": {"qkv": {"exp_avg": qkv, "step": plain}}}}  # fmt: skip
        saved = layout.saved(tree)
        for gathered in (saved["model"]["qkv"], saved["optimizer"]["state"]["qkv"]["exp_avg"]):
            assert gathered.placements == (Replicate(),)
            torch.testing.assert_close(gathered.to_local(), full)
        assert saved["model"]["ln"] is plain and saved["optimizer"]["state"]["qkv"]["step"] is plain
        back = layout.own(saved, tree)
        assert back["model"]["qkv"].placements == qkv.placements
        torch.testing.assert_close(back["model"]["qkv"].to_local(), qkv.to_local())

        model = torch.nn.Module()
        model.qkv = torch.nn.Parameter(qkv)
        optimizer = torch.optim.SGD(model.parameters())
        finish = layout.restore_whole(model, optimizer, {"qkv": 2 * full}, None)
        param: Any = model.qkv  # a DTensor parameter
        torch.testing.assert_close(param.to_local(), full)  # set_state_dict comes between
        finish()
        torch.testing.assert_close(param.to_local(), 2 * full)
