"""The memory stages (GPT-2 XL under 20 GiB on one GPU): the optimizer step in
backward, op-level activation checkpointing, CPU offload and low-bit optimizer state. Each is
exact where it claims the math is unchanged, shows its effect (gradients freed in backward, fewer
saved bytes, state in host memory or in fewer bits), and refuses what it cannot do."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

import opt
from base import distributed
from base.distributed import Distributed
from helpers import CONF, logged, tiny_cfg, tiny_run
from model import GPT, GPTConfig
from opt.ac import apply_ac
from opt.opt_in_backward import _NormEstimate
from opt.step import LoopStep
from recipe.guard import NonFiniteGuard
from recipe.schedule import set_learning_rate
from train import build_optimizer, train, train_step

CPU = torch.device("cpu")
SINGLE = Distributed(rank=0, local_rank=0, world_size=1, device=CPU)
MULTI = Distributed(rank=0, local_rank=0, world_size=2, device=CPU)  # planning only: no group
NO_CLIP = "train.grad_clip=inf"
QUIET = ("sample.num_samples=0", "wandb.mode=disabled", "train.log_interval=1")


def _toy(vocab_size: int = 64, n_layer: int = 2, n_embd: int = 16) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=n_layer, n_head=2, n_embd=n_embd, block_size=8, vocab_size=vocab_size
    )
    return GPT(config)


def _wide() -> GPT:
    """A toy whose weight matrices have >= 4096 values: torchao quantizes only those."""
    return _toy(vocab_size=256, n_embd=64)


def _knobs(stage: str, **overrides):
    """A stage's knobs as shipped in conf/opt/<stage>.yaml, with `overrides`."""
    return OmegaConf.merge(OmegaConf.load(CONF / f"opt/{stage}.yaml")[stage], overrides)


def _trainer(*overrides: str, model: GPT | None = None):
    """A toy model with the optimizer (the one the step steps: +opt=opt_in_backward's wrapper),
    scaler and guard that train() would build for `overrides`, and a function running one
    train_step at a given learning rate."""
    cfg = tiny_cfg(*overrides)
    plan = opt.plan(cfg, SINGLE)
    model = model or _toy()
    optimizer = build_optimizer(model, cfg.train, plan.optimizer_kwargs, plan.optimizer_class)
    scaler, guard = plan.grad_scaler(CPU), NonFiniteGuard(CPU, SINGLE, max_bad_steps=10)
    stepper = opt.build_step(cfg.opt, plan, guard, model, model, optimizer, scaler)
    assert isinstance(stepper, LoopStep)  # the plain loop's, or a stage's subclass of it

    def step(batch: torch.Tensor, lr: float):
        set_learning_rate(optimizer, lr)
        return train_step(stepper, batch[:, :-1], batch[:, 1:], cfg.train.grad_clip)

    return model, stepper.optimizer, guard, step


# ---- +opt=opt_in_backward


@pytest.mark.parametrize("impl", ["forloop", "foreach", "fused"])
def test_step_in_backward_equals_the_normal_step(impl: str) -> None:
    """Bit for bit, over steps whose learning rate changes (the schedule reaches the update)."""
    batches = [torch.randint(0, 64, (4, 9)) for _ in range(4)]
    lrs = [1e-3, 3e-3, 2e-3, 5e-4]
    normal = _trainer(f"+opt={impl}", NO_CLIP)
    in_backward = _trainer(f"+opt=[{impl},opt_in_backward]", NO_CLIP)
    for batch, lr in zip(batches, lrs, strict=True):
        loss_a, norm_a = normal[3](batch, lr)
        loss_b, norm_b = in_backward[3](batch, lr)
        assert torch.equal(loss_a, loss_b)
        torch.testing.assert_close(norm_b, norm_a, rtol=1e-6, atol=0)  # summed in another order
    for (name, a), b in zip(normal[0].named_parameters(), in_backward[0].parameters(), strict=True):
        assert torch.equal(a, b), name
    assert normal[1].state_dict()["state"].keys() == in_backward[1].state_dict()["state"].keys()


def _alive_grads_during_backward(*overrides: str) -> tuple[list[int], GPT]:
    """How many parameters hold a gradient, seen from each gradient hook as one step's backward
    runs. The counting hooks are registered before the stage's, so they run first, each right
    after its parameter's gradient was accumulated."""
    model = _toy()
    params, alive = list(model.parameters()), []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(q.grad is not None for q in params))
        )
    _, _, _, step = _trainer(*overrides, NO_CLIP, model=model)
    step(torch.randint(0, 64, (4, 9)), 1e-3)
    return alive, model


def test_gradients_are_freed_in_backward() -> None:
    alive, model = _alive_grads_during_backward("+opt=opt_in_backward")
    assert len(alive) == len(list(model.parameters()))  # every parameter's hook fired, once
    block = len(list(model.transformer.h[0].parameters()))  # 12 of the toy's 28
    assert max(alive) == block  # at most one block's gradients: each block's freed at once
    assert all(p.grad is None for p in model.parameters())
    alive, model = _alive_grads_during_backward()  # the normal step: they pile up
    assert max(alive) == len(list(model.parameters()))


def _nan_gradients_on_switch(model: GPT) -> tuple[torch.nn.Parameter, list[bool]]:
    """A weight whose gradient turns NaN once `switch[0]` is set (its hook, registered before
    the stage's, runs first): (the weight, switch)."""
    poisoned, switch = model.transformer.h[0].mlp.c_fc.weight, [False]

    def nan_gradient(param: torch.Tensor) -> None:
        if switch[0]:
            param.grad.fill_(float("nan"))

    poisoned.register_post_accumulate_grad_hook(nan_gradient)
    return poisoned, switch


@pytest.mark.parametrize("impl", ["forloop", "fused"])  # a host sync, or the device flag
def test_a_non_finite_gradient_skips_its_block_and_counts_the_step(impl: str) -> None:
    model = _toy()
    poisoned, poison = _nan_gradients_on_switch(model)
    _, optimizer, guard, step = _trainer(f"+opt=[{impl},opt_in_backward]", NO_CLIP, model=model)
    batch = torch.randint(0, 64, (4, 9))
    step(batch, 1e-3)  # a good step: every parameter has its state
    before = {p: (p.detach().clone(), optimizer.state[p]["exp_avg"].clone())
              for p in model.parameters()}  # fmt: skip
    poison[0] = True
    _, norm = step(batch, 1e-3)
    assert not torch.isfinite(norm) and int(guard.skipped) == 1 and int(guard.in_a_row) == 1
    its_block = {id(p) for p in model.transformer.h[0].parameters()}
    for p, (weight, exp_avg) in before.items():
        unchanged = torch.equal(p, weight) and torch.equal(optimizer.state[p]["exp_avg"], exp_avg)
        assert unchanged == (id(p) in its_block)  # only the bad block skipped, the others stepped
    assert int(optimizer.state[poisoned]["step"]) == 1  # its step count did not advance
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_non_finite_loss_counts_the_step_as_bad(monkeypatch) -> None:
    model, _, guard, step = _trainer("+opt=opt_in_backward", NO_CLIP)
    head = GPT.head
    monkeypatch.setattr(GPT, "head", lambda self, x, t=None: (None, head(self, x, t)[1] + 1e39))
    step(torch.randint(0, 64, (4, 9)), 1e-3)  # the loss overflows float32, its gradients do not
    assert int(guard.skipped) == 1


def test_step_in_backward_clips_by_the_steps_estimated_norm() -> None:
    """Clipping needs the global norm before the first update; in backward each block's
    gradients are scaled by min(1, max_norm / an estimate of it): the blocks in so far exact,
    those still to come as the last step's (on the first step: as the blocks in so far, per
    parameter). The last block to step sees the exact norm, as clip_grad_norm_ would."""
    max_norm = 0.05
    model, optimizer, _, step = _trainer(
        "+opt=[fused,opt_in_backward]", f"train.grad_clip={max_norm}"
    )
    estimate = optimizer.blocks.clip
    block_of = optimizer.blocks.block_of
    seen: list[tuple[int, float]] = []  # (block, the squared norm its update sees), in order

    def record(opt_, args, kwargs) -> None:
        params = [p for g in opt_.param_groups for p in g["params"]]
        seen.append((block_of[params[0]], sum(float(p.grad.square().sum()) for p in params)))

    optimizer.inner.register_step_pre_hook(record)  # the blocks' real updates
    batch = torch.randint(0, 64, (4, 9))
    sizes = estimate.sizes
    last = None
    for _ in range(3):
        seen.clear()
        _, norm = step(batch, 1e-3)
        raw = estimate.last.tolist()  # this step's squared norms per block, unclipped
        assert sum(raw) ** 0.5 == pytest.approx(float(norm), rel=1e-5)
        order = [block for block, _ in seen]
        assert order[0] != order[-1] and len(order) == len(sizes)  # wte (tied) steps last
        for i, (block, clipped) in enumerate(seen):
            ins = order[: i + 1]
            so_far = sum(raw[b] for b in ins)
            if last is None:
                expected = (so_far * sum(sizes) / sum(sizes[b] for b in ins)) ** 0.5
            else:
                expected = (so_far + sum(last[b] for b in range(len(sizes)) if b not in ins)) ** 0.5
            coef = min(1.0, max_norm / (expected + 1e-6))
            assert clipped == pytest.approx(coef**2 * raw[block], rel=1e-4)
        assert expected == pytest.approx(float(norm), rel=1e-5)  # the last block: exact
        assert coef < 1.0  # the toy's norm is above max_norm: every step clips
        last = raw


def test_a_block_that_skips_counts_as_its_last_norm_in_the_estimate() -> None:
    estimate = _NormEstimate([[torch.zeros(3)], [torch.zeros(1)]], torch.device("cpu"))
    assert float(estimate.add(0, torch.tensor(4.0))) == pytest.approx((4.0 * 4 / 3) ** 0.5)
    assert float(estimate.add(1, torch.tensor(5.0))) == pytest.approx(3.0)
    estimate.next_step()
    assert float(estimate.add(1, torch.tensor(float("nan")))) == pytest.approx(3.0)  # as last
    assert float(estimate.add(0, torch.tensor(1.0))) == pytest.approx(6.0**0.5)


def test_step_in_backward_refuses_what_needs_every_gradient() -> None:
    def refused(*overrides: str, dist: Distributed = SINGLE) -> str:
        with pytest.raises(ValueError) as error:
            opt.plan(tiny_cfg(*overrides), dist)
        return str(error.value)

    message = refused("+opt=[amp,opt_in_backward]", "opt.amp.dtype=float16", NO_CLIP)
    assert "opt.amp.dtype=float16" in message and "bfloat16" in message
    assert "+opt=opt_in_backward and +opt=accum" in refused("+opt=[accum,opt_in_backward]", NO_CLIP)
    assert "reduced over the processes" in refused("+opt=[ddp,opt_in_backward]", NO_CLIP)
    assert "this run has 2" in refused("+opt=opt_in_backward", NO_CLIP, dist=MULTI)
    plan = opt.plan(
        tiny_cfg("+opt=[amp,opt_in_backward]", "opt.amp.dtype=bfloat16", NO_CLIP), SINGLE
    )
    assert plan.step_in_backward


def test_step_in_backward_end_to_end_and_resumed(tmp_path, capsys) -> None:
    """train() with the stage equals train() without it (clipping off both), and a resumed run
    (the optimizer state saved and restored through the one optimizer) equals both."""
    args = ("train.checkpoint_interval=2", NO_CLIP, *QUIET)
    tiny_run(tmp_path / "normal", "train.max_steps=4", *args, "+opt=fused")
    tiny_run(tmp_path / "in_backward", "train.max_steps=4", *args, "+opt=[fused,opt_in_backward]")
    assert "[opt] opt_in_backward: 28 parameters in 5 blocks" in capsys.readouterr().out
    expected = logged(tmp_path / "normal", "train/loss")
    assert logged(tmp_path / "in_backward", "train/loss") == expected

    run = tmp_path / "resumed"
    tiny_run(run, "train.max_steps=2", *args, "+opt=[fused,opt_in_backward]")
    tiny_run(run, "train.max_steps=4", "train.resume=true")
    assert logged(run, "train/loss") == expected


# ---- opt.ac.mode=op


def _profiled_bytes(run) -> tuple[int, int, Any]:
    """Bytes of the tensors that `run()` creates: those still alive when it returns, and the
    most alive at once; and what it returned. From the profiler's memory timeline, which sees
    every allocation: activation checkpointing keeps what its policy saves out of autograd's
    saved tensors, where saved-tensor hooks would miss it."""
    from torch.profiler._memory_profiler import Action

    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        result = run()
    alive, now, peak = {}, 0, 0
    for _, action, (key, _), size in sorted(prof._memory_profile().timeline, key=lambda e: e[0]):
        if action == Action.CREATE:
            alive[key] = size
            now += size
        elif action == Action.DESTROY and key in alive:
            now -= alive.pop(key)
        peak = max(peak, now)
    return sum(alive.values()), peak, result


def _blocks(model: GPT, x: torch.Tensor) -> torch.Tensor:
    for block in model.transformer.h:
        x = block(x)
    return x


def _saved_bytes(model: GPT, idx: torch.Tensor) -> int:
    """Bytes the transformer blocks' forward leaves alive for backward (then runs backward)."""
    x = model.embed(idx).detach().requires_grad_()
    alive, _, out = _profiled_bytes(lambda: _blocks(model, x))
    out.square().mean().backward()
    return alive - out.numel() * out.element_size()  # the output is no activation


def _backward_flops(model: GPT, idx: torch.Tensor) -> int:
    """FLOPs of backward, recomputation included: matmuls only (FlopCounterMode counts those)."""
    _, loss = model(idx, idx)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_op_level_ac_keeps_gradients_and_saves_between_full_and_none() -> None:
    idx = torch.randint(0, 64, (4, 8))
    models = {"none": _toy(n_layer=3)}
    for mode in ("full", "op"):
        models[mode] = _toy(n_layer=3)
        assert len(apply_ac(models[mode], _knobs("ac", mode=mode))) == 3
    saved = {mode: _saved_bytes(model, idx) for mode, model in models.items()}
    assert saved["full"] < saved["op"] < saved["none"], saved
    for mode in ("full", "op"):
        blocks = models[mode].transformer.h.parameters()
        for (name, a), b in zip(
            models["none"].transformer.h.named_parameters(), blocks, strict=True
        ):
            assert torch.equal(a.grad, b.grad), (mode, name)
    # Backward redoes every matmul under full checkpointing, none under the op-level policy.
    flops = {mode: _backward_flops(model, idx) for mode, model in models.items()}
    assert flops["op"] == flops["none"] < flops["full"], flops


def test_op_level_ac_needs_the_non_reentrant_checkpoint() -> None:
    with pytest.raises(ValueError, match="opt.ac.mode=op needs opt.ac.use_reentrant=false"):
        apply_ac(_toy(), _knobs("ac", mode="op", use_reentrant=True))


@pytest.mark.slow
def test_op_level_ac_under_compile_matches_eager(tmp_path) -> None:
    import torch._dynamo

    args = ("train.max_steps=3", "opt.ac.mode=op", *QUIET)
    train(tiny_cfg(*args, "+opt=ac"), tmp_path / "eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    train(tiny_cfg(*args, "+opt=[ac,compile]"), tmp_path / "compiled")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not torch._dynamo.utils.counters["graph_break"], "the policy broke the graph"
    torch.testing.assert_close(
        logged(tmp_path / "compiled", "train/loss"), logged(tmp_path / "eager", "train/loss"),
        rtol=1e-4, atol=0,
    )  # fmt: skip
    torch._dynamo.reset()


def test_amp_without_its_weight_cache_frees_the_casts_under_checkpointing() -> None:
    """With every block checkpointed, autocast's cache alone keeps a bfloat16 copy of every
    weight to the end of the forward; opt.amp.weight_cache=false frees each after its use, and
    changes nothing else."""
    idx, peaks, losses = torch.randint(0, 256, (2, 8)), {}, {}
    for cache in (True, False):
        cfg = tiny_cfg("+opt=[amp,ac]", "opt.amp.dtype=bfloat16", f"opt.amp.weight_cache={cache}")
        plan = opt.plan(cfg, SINGLE)
        model = _wide()
        opt.apply_model_stages(model, cfg.opt, plan, SINGLE)

        def forward(model=model, plan=plan, cache=cache):
            with plan.autocast(CPU):
                assert torch.is_autocast_cache_enabled() == cache
                return model(idx, idx)[1]

        _, peaks[cache], losses[cache] = _profiled_bytes(forward)
    assert torch.equal(losses[True], losses[False])
    # bfloat16 copies of the blocks' weights: all of them with the cache, one block's without
    blocks = model.transformer.h  # (a ModuleList, typed Tensor | Module by torch)
    copies = 2 * sum(p.numel() for p in blocks.parameters() if p.dim() == 2)  # type: ignore[misc]
    one_block = copies // len(blocks)  # type: ignore[arg-type]
    assert peaks[True] - peaks[False] >= copies - one_block, (peaks, copies)


# ---- +opt=offload


def test_offload_to_host_is_exact_and_shards_everything() -> None:
    """The stage's FSDP2 with CPU offload, on a group of this one process: the same steps as
    without it. (On a CPU run the stage itself does nothing; tests/gpu/test_gpu_memory.py runs it
    on a GPU.)"""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    from opt.offload import offload_to_host

    batches = [torch.randint(0, 64, (4, 9)) for _ in range(3)]
    normal = _trainer("+opt=fused")
    try:
        model = offload_to_host(_toy(), _knobs("offload"), SINGLE, amp_dtype=None)
        assert isinstance(model, GPT)  # the same model, its class now FSDP's subclass of GPT
        offloaded = _trainer("+opt=fused", model=model)
        assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule)
                                                     for b in model.transformer.h)  # fmt: skip
        policy = model._get_fsdp_state()._fsdp_param_group.offload_policy  # the blocks' too
        assert isinstance(policy, CPUOffloadPolicy)
        for i, batch in enumerate(batches):
            loss_a, norm_a = normal[3](batch, 1e-3 * (i + 1))
            loss_b, norm_b = offloaded[3](batch, 1e-3 * (i + 1))
            assert torch.equal(loss_a, loss_b) and torch.equal(norm_a, norm_b)
        for a, b in zip(normal[0].parameters(), model.parameters(), strict=True):
            assert isinstance(b, DTensor) and torch.equal(a, b.full_tensor())
    finally:
        distributed.shutdown()


def test_offload_on_a_cpu_run_says_it_has_nothing_to_offload(capsys) -> None:
    cfg = tiny_cfg("+opt=offload")
    plan = opt.plan(cfg, SINGLE)
    model = _toy()
    assert opt.apply_model_stages(model, cfg.opt, plan, SINGLE) is model
    assert "offload: nothing to offload on a CPU run" in capsys.readouterr().out
    assert not torch.distributed.is_initialized() and not plan.parallel.fully_sharded
    on_a_gpu = opt.plan(cfg, dataclasses.replace(SINGLE, device=torch.device("cuda", 0)))
    # On a GPU: FSDP's hooks (compile in pieces, a sharded scaler).
    assert on_a_gpu.parallel.fully_sharded


def test_offload_refuses_other_ways_to_spread_or_shrink() -> None:
    for stages, message in [
        ("fsdp,offload", r"\+opt=offload and \+opt=fsdp: offload is FSDP's CPU offload"),
        ("lowbit,offload", r"\+opt=lowbit and \+opt=offload"),
        ("offload,opt_in_backward", r"\+opt=opt_in_backward and \+opt=offload"),
    ]:
        with pytest.raises(ValueError, match=message):
            opt.plan(tiny_cfg(f"+opt=[{stages}]", NO_CLIP), MULTI)
    with pytest.raises(ValueError, match=r"\+opt=offload runs in one process, this run has 2"):
        opt.plan(tiny_cfg("+opt=offload"), MULTI)


# ---- +opt=lowbit


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state; a quantized tensor counts its codes and scales."""

    def nbytes(t: torch.Tensor) -> int:
        if hasattr(t, "__tensor_flatten__"):  # torchao's OptimState8bit/4bit
            names, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, name)) for name in names)
        return t.numel() * t.element_size()

    return sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if v.dim())


@pytest.mark.parametrize("bits,most", [(8, 0.30), (4, 0.20)])
def test_lowbit_trains_with_smaller_state(bits: int, most: float) -> None:
    """It changes the math, so: the loss falls, and the state is a fraction of AdamW's.
    (Eager: the same update as torchao's compiled one, without minutes of compiling.)"""
    batch = torch.randint(0, 256, (8, 9))
    with torch.compiler.set_stance("force_eager"):
        _, adamw, _, adamw_step = _trainer(model=_wide())
        adamw_step(batch, 1e-3)
        _, lowbit, _, step = _trainer("+opt=lowbit", f"opt.lowbit.bits={bits}", model=_wide())
        losses = [step(batch, 1e-2)[0].item() for _ in range(8)]
    assert type(lowbit).__name__ == f"AdamW{bits}bit"
    assert losses[-1] < losses[0] - 0.5, losses
    assert _state_bytes(lowbit) < most * _state_bytes(adamw), (bits, _state_bytes(lowbit))


def test_lowbit_composes_with_the_step_in_backward() -> None:
    """torchao's update restricted to one parameter is its update: bit for bit."""
    batches = [torch.randint(0, 256, (4, 9)) for _ in range(3)]
    with torch.compiler.set_stance("force_eager"):
        normal = _trainer("+opt=lowbit", NO_CLIP, model=_wide())
        in_backward = _trainer("+opt=[lowbit,opt_in_backward]", NO_CLIP, model=_wide())
        for i, batch in enumerate(batches):
            assert torch.equal(normal[3](batch, 1e-3 * (i + 1))[0],
                               in_backward[3](batch, 1e-3 * (i + 1))[0])  # fmt: skip
    for a, b in zip(normal[0].parameters(), in_backward[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_lowbit_builds_its_compiled_update_once_and_steps_as_torchao(monkeypatch) -> None:
    """torchao 0.18's step wraps its update in a new torch.compile for every parameter at every
    step (host time that left the XL step's GPU idle); ours builds no wrapper while stepping,
    and its weights and quantized moments are torchao's, bit for bit."""
    batches = [torch.randint(0, 256, (4, 9)) for _ in range(3)]
    wrappers, stepping = {"ours": 0, "torchao": 0}, [""]
    real_compile = torch.compile

    def counted(*args, **kwargs):
        wrappers[stepping[0]] += 1
        return real_compile(*args, **kwargs)

    with torch.compiler.set_stance("force_eager"):
        ours = _trainer("+opt=lowbit", NO_CLIP, model=_wide())
        theirs = _trainer("+opt=lowbit", NO_CLIP, model=_wide())
        theirs[1].__class__ = type(theirs[1]).__bases__[0]  # torchao's own AdamW8bit
        monkeypatch.setattr(torch, "compile", counted)
        for i, batch in enumerate(batches):
            for stepping[0], trainer in (("ours", ours), ("torchao", theirs)):
                trainer[3](batch, 1e-3 * (i + 1))
    monkeypatch.undo()
    assert wrappers == {"ours": 0, "torchao": len(batches) * len(list(ours[0].parameters()))}
    for a, b in zip(ours[0].parameters(), theirs[0].parameters(), strict=True):
        assert torch.equal(a, b)
        mine, torchao_s = ours[1].state[a], theirs[1].state[b]
        assert mine.keys() == torchao_s.keys()
        for key in mine:
            assert torch.equal(_plain(mine[key]), _plain(torchao_s[key])), key


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A quantized optimizer state (torchao's OptimState8bit/4bit) as float32, else itself."""
    return t.dequantize() if hasattr(t, "dequantize") else t


def test_lowbit_in_backward_skips_a_non_finite_gradient_without_a_host_sync(monkeypatch) -> None:
    """No device flag in torchao's update, but a tensor learning rate: a bad gradient's block
    steps as zeros at learning rate 0 (weights unchanged), and no hook reads a value on the
    host."""
    model = _wide()
    poisoned, poison = _nan_gradients_on_switch(model)
    batch = torch.randint(0, 256, (4, 9))
    with torch.compiler.set_stance("force_eager"):
        _, optimizer, guard, step = _trainer("+opt=[lowbit,opt_in_backward]", NO_CLIP, model=model)
        step(batch, 1e-3)
        before = {p: p.detach().clone() for p in model.parameters()}
        poison[0], reads = True, []
        for method in ("item", "__bool__"):  # what a host sync on a flag goes through
            real = getattr(torch.Tensor, method)
            monkeypatch.setattr(torch.Tensor, method, lambda t, _r=real: reads.append(t) or _r(t))
        step(batch, 1e-3)
        monkeypatch.undo()
    assert not [t for t in reads if t.dtype == torch.bool], "a hook read its flag on the host"
    assert int(guard.skipped) == 1
    its_block = {id(p) for p in model.transformer.h[0].parameters()}
    for p, weight in before.items():
        assert torch.equal(p, weight) == (id(p) in its_block)  # only the bad block kept them
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for value in optimizer.state[poisoned].values():  # its moments: decayed, not poisoned
        assert torch.isfinite(_plain(value)).all()
    assert torch.is_tensor(optimizer.param_groups[0]["lr"])  # the schedule's tensor, restored


def test_lowbit_refuses_another_implementation_and_bad_bits() -> None:
    for impl in ("forloop", "foreach", "fused"):
        with pytest.raises(ValueError, match=rf"\+opt=lowbit and \+opt={impl}: torchao"):
            opt.plan(tiny_cfg(f"+opt=[{impl},lowbit]"), SINGLE)
    with pytest.raises(ValueError, match="opt.lowbit.bits must be one of 8, 4, got 2"):
        opt.plan(tiny_cfg("+opt=lowbit", "opt.lowbit.bits=2"), SINGLE)


@pytest.mark.slow
def test_lowbit_end_to_end_compiled_checkpointed_and_resumed(tmp_path) -> None:
    """train() with torchao's compiled update, stepped in backward as the memory_xl ladder runs
    it; its quantized state survives a checkpoint."""
    args = ("+opt=[lowbit,opt_in_backward]", NO_CLIP, "train.checkpoint_interval=2", *QUIET)
    tiny_run(tmp_path / "straight", "train.max_steps=4", *args)
    run = tmp_path / "resumed"
    tiny_run(run, "train.max_steps=2", *args)
    tiny_run(run, "train.max_steps=4", "train.resume=true")
    expected = logged(tmp_path / "straight", "train/loss")
    assert logged(run, "train/loss") == expected
    assert expected[-1] < expected[0]


def test_lowbit_bfloat16_weights_train_checkpoint_and_resume(tmp_path) -> None:
    """opt.lowbit.weights=bfloat16: the weights are stored in bfloat16 (the checkpoint holds
    them so), the run learns, and a resumed run (the random stream of the stochastic rounding
    restored with the others) equals the uninterrupted one."""
    args = ("+opt=[amp,lowbit,opt_in_backward]", "opt.amp.dtype=bfloat16",
            "opt.lowbit.weights=bfloat16", "opt.lowbit.impl=torchao", NO_CLIP,
            "train.checkpoint_interval=2", "train.eval_interval=2", "train.lr=1e-2",
            *QUIET)  # fmt: skip
    # eval_interval=2: the stopped run evaluates at its last step, before its checkpoint (a
    # DataLoader's iterator draws from the random stream the rounding draws from), so the
    # uninterrupted run must evaluate there too.
    with torch.compiler.set_stance("force_eager"):
        tiny_run(tmp_path / "straight", "train.max_steps=4", *args)
        run = tmp_path / "resumed"
        tiny_run(run, "train.max_steps=2", *args)
        tiny_run(run, "train.max_steps=4", "train.resume=true")
    weights = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)["model"]
    assert all(
        t.dtype == (torch.bfloat16 if t.dim() >= 2 else torch.float32) for t in weights.values()
    )
    expected = logged(tmp_path / "straight", "train/loss")
    assert logged(run, "train/loss") == expected
    assert expected[-1] < expected[0]


def test_lowbit_bfloat16_weights_refuse_what_they_cannot_do() -> None:
    def refused(*overrides: str) -> str:
        with pytest.raises(ValueError) as error:
            opt.plan(tiny_cfg("opt.lowbit.weights=bfloat16", NO_CLIP, *overrides), SINGLE)
        return str(error.value)

    assert "add +opt=amp with opt.amp.dtype=bfloat16" in refused("+opt=lowbit")
    assert "add +opt=amp" in refused("+opt=[amp,lowbit]", "opt.amp.dtype=float16")
    plan = opt.plan(
        tiny_cfg("+opt=[amp,lowbit]", "opt.amp.dtype=bfloat16", "opt.lowbit.weights=bfloat16"),
        SINGLE,
    )
    assert plan.weights_dtype is torch.bfloat16 and plan.residual_dtype is torch.float32
    assert plan.optimizer_kwargs["bf16_stochastic_round"]


@pytest.mark.parametrize(
    "stage, says",
    [
        ("tp", r"tensor parallelism \(\+opt=tp\) splits it"),
        ("pp", r"the pipeline \(\+opt=pp\) splits it"),
        ("fsdp", r"FSDP \(\+opt=fsdp\) shards it"),
    ],
)
def test_lowbit_bfloat16_weights_refuse_a_model_split_over_processes(stage, says) -> None:
    """The weights are cast on the whole model of one process: refused once the plan's parallel
    layout (set by the splitting stage's plan, after lowbit's phase) splits or shards it."""
    stages = (f"+opt=[amp,lowbit,{stage}]", "opt.amp.dtype=bfloat16", NO_CLIP)
    with pytest.raises(ValueError, match=f"weights=bfloat16 casts the whole model.*{says}"):
        opt.plan(tiny_cfg(*stages, "opt.lowbit.weights=bfloat16"), MULTI)
    assert opt.plan(tiny_cfg(*stages), MULTI).weights_dtype is None  # float32: split as usual
