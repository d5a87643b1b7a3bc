"""+opt=float8 (opt/float8.py): which Linear layers convert and which stay, the one-line refusals,
the checkpoint's plain weights (a float8 run resumes without the stage and the other way round),
FSDP's float8 all-gather with its scales computed after the step (on a CPU group of one, torchao's
emulation), and on an sm89+ GPU the loss of GPT-2 124M against bfloat16's."""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import checkpointing
import opt
from base.distributed import Distributed, ParallelDims
from base.errors import ConfigError
from helpers import ROOT, logged, make_cfg, python, tiny_run, torchrun_output
from model import GPT, GPTConfig
from opt import float8
from opt.stage import Context, Plan
from recipe.guard import NonFiniteGuard

ao = pytest.importorskip("torchao.float8")
Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

CPU = torch.device("cpu")
SINGLE = Distributed(rank=0, local_rank=0, world_size=1, device=CPU)
MULTI = Distributed(rank=0, local_rank=0, world_size=2, device=CPU)  # planning only
SIZES = {"gpt2": (12, 768), "gpt2-xl": (48, 1600)}  # (n_layer, n_embd); 64-wide heads
EMULATED = ("opt.float8.emulate=true", "opt.float8.skip_small=false")  # a CPU, tiny layers
QUIET = ("wandb.mode=disabled", "sample.num_samples=0", "train.log_interval=1")


def _knobs(**changes: object) -> object:
    return OmegaConf.merge(make_cfg("+opt=float8").opt.float8, changes)


def _gpt(size: str) -> GPT:
    n_layer, n_embd = SIZES[size]
    with torch.device("meta"):  # shapes only: no memory, nothing to run
        return GPT(GPTConfig(n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd))


def _converted(model: nn.Module) -> set[str]:
    """The converted layers of block 0, by their name inside the block."""
    prefix = "transformer.h.0."
    return {
        name.removeprefix(prefix)
        for name, m in model.named_modules()
        if name.startswith(prefix) and isinstance(m, Float8Linear)
    }


# ---- the rule: the head never, small layers by torchao's thresholds, dimensions of 16


@pytest.mark.parametrize(
    ("size", "recipe", "expected"),
    [
        ("gpt2", "tensorwise", {"attn.c_attn", "mlp.c_fc"}),  # the projections back are small
        ("gpt2-xl", "tensorwise", {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}),
        ("gpt2-xl", "rowwise", {"attn.c_attn", "mlp.c_fc"}),  # rowwise pays on larger ones
    ],
)
def test_the_blocks_linears_convert_by_the_rule_and_the_tied_head_never(
    size: str, recipe: str, expected: set[str]
) -> None:
    model = _gpt(size)
    chosen = float8.convert_to_float8(model, _knobs(recipe=recipe))
    assert _converted(model) == expected
    n_layer = SIZES[size][0]
    assert len(chosen) == n_layer * len(expected)
    assert type(model.lm_head) is nn.Linear and "lm_head" not in chosen
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    unconverted = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"} - expected
    block = model.transformer.h[0]
    assert all(type(block.get_submodule(name)) is nn.Linear for name in unconverted)


def test_without_skip_small_every_linear_but_the_head_converts_and_16_still_rules() -> None:
    model = _gpt("gpt2")
    float8.convert_to_float8(model, _knobs(skip_small=False))
    assert _converted(model) == {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
    assert type(model.lm_head) is nn.Linear
    odd = nn.Linear(24, 64)  # 24 is no multiple of 16: float8's matmul cannot take it
    assert not float8.converts(odd, "transformer.h.0.mlp.c_fc", "tensorwise", skip_small=False)
    assert float8.converts(nn.Linear(32, 64), "x", "tensorwise", skip_small=False)


def test_skip_layers_leaves_the_named_layers_in_high_precision_and_refuses_a_typo() -> None:
    model = _gpt("gpt2-xl")
    chosen = float8.convert_to_float8(model, _knobs(skip_layers=["attn.c_proj"]))
    assert _converted(model) == {"attn.c_attn", "mlp.c_fc", "mlp.c_proj"}  # not mlp.c_proj's
    assert len(chosen) == 48 * 3
    assert type(model.transformer.h[47].attn.c_proj) is nn.Linear
    with pytest.raises(ConfigError, match=r"skip_layers: 'atn.c_proj' is in no Linear") as typo:
        float8.convert_to_float8(_gpt("gpt2-xl"), _knobs(skip_layers=["atn.c_proj"]))
    assert "\n" not in str(typo.value)


def test_a_model_with_nothing_to_convert_is_refused_in_one_line() -> None:
    """GPT-2 124M under rowwise: every Linear is below torchao's rowwise thresholds."""
    model = _gpt("gpt2")
    ctx = Context(SINGLE, Plan(stages=["float8"], batch_size=8), model=model, module=model)
    ctx.knobs = _knobs(recipe="rowwise", emulate=True)  # emulate: past the device check
    with pytest.raises(ConfigError, match=r"converts no layer .*width 768.*skip_small=false"):
        float8._apply(ctx)


# ---- the refusals: each one line, before any step


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["opt.float8.recipe=blockwise"], r"opt\.float8\.recipe must be one of"),
        (["opt.float8.skip_small=maybe"], r"opt\.float8\.skip_small"),
        (["opt.float8.skip_layers=attn.c_proj"], r"skip_layers must be a list .*\[attn\.c_proj\]"),
        (["opt.float8.skip_layers=[1]"], r"skip_layers must be a list of parts of layer names"),
        (
            ["opt.float8.fsdp_all_gather=true", "opt.float8.recipe=rowwise", "+opt=fsdp"],
            r"fsdp_all_gather=true needs opt\.float8\.recipe=tensorwise, not rowwise",
        ),
        (["opt.float8.fsdp_all_gather=true"], r"fsdp_all_gather=true .*add \+opt=fsdp"),
        (["opt.float8.emulate=true", "+opt=compile"], r"emulate=true runs eager only"),
        (["+opt=tp"], r"\+opt=float8 and \+opt=tp: tp splits the Linear layers"),
    ],
)
def test_knobs_and_stages_it_cannot_run_with_are_refused_in_one_line(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        opt.plan(make_cfg("+opt=[amp,float8]", *overrides), MULTI)
    assert "\n" not in str(refused.value)


def test_the_checks_against_other_stages_ask_the_plan() -> None:
    """fsdp_all_gather and emulate are checked against what the plan holds once every stage has
    planned (FSDP's sharding of several processes, Plan.compiled), not the stages' names."""
    compiled = Plan(stages=["float8"], batch_size=8, compiled=True)
    with pytest.raises(ConfigError, match="emulate=true runs eager only"):
        float8.check_with_plan(_knobs(emulate=True), compiled)
    float8.check_with_plan(_knobs(emulate=True), Plan(stages=["float8"], batch_size=8))
    sharded = Plan(stages=["float8"], batch_size=8)
    sharded.parallel = ParallelDims(2, fully_sharded=True)
    float8.check_with_plan(_knobs(fsdp_all_gather=True), sharded)
    one_process = Plan(stages=["float8"], batch_size=8)  # +opt=offload's FSDP: nothing gathered
    one_process.parallel = ParallelDims(1, fully_sharded=True)
    with pytest.raises(ConfigError, match=r"add \+opt=fsdp"):
        float8.check_with_plan(_knobs(fsdp_all_gather=True), one_process)


def test_it_composes_with_amp_compile_ac_fsdp_and_the_fused_head() -> None:
    cfg = make_cfg("+opt=[amp,compile,ac,fsdp,custom_op,float8]", "opt.float8.fsdp_all_gather=true")
    stages = opt.plan(cfg, MULTI).stages
    assert stages.index("custom_op") < stages.index("float8") < stages.index("ac")
    assert stages.index("float8") < stages.index("compile") < stages.index("fsdp")
    # torchao takes any high precision: float32 (no amp) and float16 plan too
    assert opt.plan(make_cfg("+opt=float8"), SINGLE).amp_dtype is None
    assert opt.plan(make_cfg("+opt=[amp,float8]", "opt.amp.dtype=float16"), SINGLE).scale_loss


def test_a_cpu_and_a_gpu_without_float8_tensor_cores_are_refused_in_one_line(
    monkeypatch,
) -> None:
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU .*this run is on the cpu.*emulate"):
        float8.check_device(CPU, emulate=False)
    float8.check_device(CPU, emulate=True)  # emulated: any device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"8\.9 or newer .*NVIDIA A100 has 8\.0: drop it"):
        float8.check_device(torch.device("cuda", 0), emulate=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    float8.check_device(torch.device("cuda", 0), emulate=False)  # Hopper


def test_a_training_run_on_a_cpu_without_emulate_stops_with_the_device_line(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"\+opt=float8 needs a CUDA GPU"):
        tiny_run(tmp_path / "run", "+opt=[amp,float8]", "train.max_steps=1", *QUIET)


# ---- training, checkpoints, resume


def test_the_checkpoint_holds_plain_weights_that_load_both_ways() -> None:
    """A float8 model's state dict has the plain model's keys and plain tensors, also with the
    float8 all-gather wrapper on its weights; each loads into the other."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    plain, converted = GPT(config), GPT(config)
    float8.convert_to_float8(
        converted, _knobs(skip_small=False, emulate=True, fsdp_all_gather=True)
    )
    wrapped = converted.transformer.h[0].attn.c_attn.weight
    assert type(wrapped).__name__ == "WeightWithDynamicFloat8CastTensor"
    state = converted.state_dict()
    assert list(state) == list(plain.state_dict())
    assert all(type(t) is torch.Tensor for t in state.values())
    converted.load_state_dict(plain.state_dict())  # into the wrapper: its values change
    assert torch.equal(wrapped, plain.transformer.h[0].attn.c_attn.weight)
    assert type(converted.transformer.h[0].attn.c_attn.weight) is type(wrapped)
    plain.load_state_dict(converted.state_dict())


def test_a_float8_run_trains_and_resumes_without_the_stage_and_a_plain_one_with_it(
    tmp_path,
) -> None:
    """Emulated on a CPU: the loss stays within float8's rounding of bfloat16's, and the
    checkpoints go from one to the other both ways."""
    first = ("train.max_steps=3", "train.checkpoint_interval=3", *QUIET)
    tiny_run(tmp_path / "float8", "+opt=[amp,float8]", *EMULATED, *first)
    tiny_run(tmp_path / "bf16", "+opt=amp", *first)
    f8, bf16 = logged(tmp_path / "float8", "train/loss"), logged(tmp_path / "bf16", "train/loss")
    assert len(f8) == 3 and max(abs(a - b) for a, b in zip(f8, bf16, strict=True)) < 0.05
    assert f8 != bf16  # float8's rounding is there
    _resume(tmp_path / "float8", "~opt=float8")
    _resume(tmp_path / "bf16", "+opt=[amp,float8]", *EMULATED)
    for run in ("float8", "bf16"):
        assert len(logged(tmp_path / run, "train/loss")) == 5, run


def _resume(run_dir: Path, *overrides: str) -> None:
    """`python train.py hydra.run.dir=<run_dir> train.resume=true <overrides>` to step 5, in this
    process (train.py takes a '~opt=<stage>' off the command line before Hydra composes it)."""
    from train import train

    resumed = [*overrides, "train.resume=true", "train.max_steps=5", *QUIET]
    train(make_cfg("train.resume=true"), run_dir, overrides=resumed)


def test_the_scales_are_computed_after_the_step(monkeypatch) -> None:
    """The step calls the stages' after-step hooks after each update: +opt=float8's, with the
    model."""
    seen: list[nn.Module] = []
    monkeypatch.setattr(float8, "precompute_scales", seen.append)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=4, vocab_size=16))
    optimizer = torch.optim.AdamW(model.parameters())
    finite = torch.zeros(()), torch.zeros(())  # the step's loss and gradient norm
    for overrides, calls in ((["+opt=[amp,float8]"], 1), (["+opt=amp"], 0)):
        cfg = make_cfg(*overrides, "train.grad_clip=inf")
        plan, scaler = opt.plan(cfg, SINGLE), torch.amp.GradScaler("cpu", enabled=False)
        guard = NonFiniteGuard(CPU, SINGLE, 3)
        step = opt.build_step(cfg.opt, plan, guard, model, model, optimizer, scaler)
        seen.clear()
        step.optimizer_step(*finite)
        assert seen == [model] * calls


def test_fsdp_gathers_float8_weights_with_the_scales_of_the_last_step(
    group_of_one, monkeypatch, tmp_path
) -> None:
    """FSDP2 over a CPU group of one, emulated: each all-gather casts the weight to float8 (with
    its scale found inside the gather at the first step, precomputed after the step from then
    on), the sharded state dict is plain, and a checkpoint after an evaluation's forward (which
    leaves the last block's float8 weights gathered) is written from the shards."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapper

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    knobs = _knobs(skip_small=False, emulate=True, fsdp_all_gather=True)
    chosen = float8.convert_to_float8(model, knobs)
    fsdp_knobs = make_cfg("+opt=fsdp").opt.fsdp
    opt.fsdp.apply_fsdp(model, fsdp_knobs, group_of_one, None)
    gathered: list[bool] = []  # per all-gather of a float8 weight: was its scale precomputed?
    pre_all_gather = Wrapper.fsdp_pre_all_gather

    def spy(self, mesh):
        gathered.append(self._precomputed_scale is not None)
        return pre_all_gather(self, mesh)

    monkeypatch.setattr(Wrapper, "fsdp_pre_all_gather", spy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randint(0, 64, (2, 16))
    for step in range(2):
        gathered.clear()
        model(x, x)[1].backward()
        assert gathered and all(gathered) == (step > 0) and len(gathered) >= len(chosen)
        optimizer.step()
        optimizer.zero_grad()
        float8.precompute_scales(model)
    state = model.state_dict()
    assert all(type(t.to_local()) is torch.Tensor for t in state.values())
    with torch.no_grad():
        model(x)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    run_state = {"model_config": dataclasses.asdict(model.config), "config": {}}
    checkpointing.Saver(tmp_path, SINGLE).save(model, optimizer, scaler, 2, run_state)
    assert checkpointing.read(tmp_path)["step"] == 2


def test_the_rowwise_recipe_sets_inductors_precise_casts_for_its_run_only() -> None:
    import torch._inductor.config as inductor_config

    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=32, block_size=4, vocab_size=16))
    ctx = Context(SINGLE, Plan(stages=["float8"], batch_size=8), model=model, module=model)
    ctx.knobs = _knobs(recipe="rowwise", skip_small=False, emulate=True)
    float8._apply(ctx)
    assert inductor_config.emulate_precision_casts
    float8._reset(ctx)  # a run without the stage
    assert inductor_config.emulate_precision_casts == float8.PRECISION_CASTS


# ---- on an sm89+ GPU: GPT-2 124M, float8 against bfloat16


def _float8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


GPU_124M = (
    "device=cuda", "model=gpt2", "data=shakespeare", "train.batch_size=16",
    "train.log_interval=1", "train.eval_interval=1000000", "train.eval_sequences=16",
    "train.checkpoint_interval=0", "sample.num_samples=0", "wandb.mode=disabled",
    "opt.amp.dtype=bfloat16",
)  # fmt: skip


def _late_loss(run_dir) -> float:
    return statistics.fmean(logged(run_dir, "train/loss")[-10:])


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_gpu(), reason="needs a GPU of compute capability 8.9 or newer")
@pytest.mark.parametrize(
    "knobs",
    [
        ["+opt=[amp,compile,float8]"],
        # rowwise converts no 124M layer by torchao's thresholds: all of them, under checkpointing
        ["+opt=[amp,compile,ac,float8]", "opt.float8.recipe=rowwise",
         "opt.float8.skip_small=false"],
    ],
    ids=["tensorwise", "rowwise_ac"],
)  # fmt: skip
def test_gpt2_trains_in_float8_as_well_as_in_bfloat16(tmp_path, knobs: list[str]) -> None:
    """60 steps of GPT-2 124M on Shakespeare: the last 10 losses' mean no more than 0.05 above
    the bfloat16 run's (about 3 minutes on an H100, compile included). One short run's loss
    moves with float8's rounding (on an H200, tensorwise once ended 0.067 below
    bfloat16's): the test catches float8 training worse; how close the two are over seeds is
    `scripts/quality.py`'s question."""
    import torch._dynamo

    from train import train

    steps = "train.max_steps=60"
    train(make_cfg(*GPU_124M, steps, "+opt=[amp,compile]"), tmp_path / "bf16")
    torch._dynamo.reset()
    train(make_cfg(*GPU_124M, steps, *knobs), tmp_path / "float8")
    torch._dynamo.reset()
    bf16, f8 = _late_loss(tmp_path / "bf16"), _late_loss(tmp_path / "float8")
    assert f8 < 8.0 and f8 - bf16 < 0.05, (f8, bf16)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(
    not _float8_gpu() or torch.cuda.device_count() < 2, reason="needs 2 GPUs of sm89 or newer"
)
def test_fsdp_float8_all_gather_on_two_gpus_resumes_in_one_process(tmp_path) -> None:
    """FSDP over 2 GPUs with float8 all-gather against float8 without it (the same math: the
    scales from the whole weight either way), then the sharded checkpoint resumed in one process
    without either stage (its weights are plain), at the same global batch."""
    common = (*GPU_124M, "model.n_layer=4", "train.max_steps=20", "train.checkpoint_interval=20")
    runs = {
        "gather": ["+opt=[amp,compile,fsdp,float8]", "opt.float8.fsdp_all_gather=true"],
        "plain": ["+opt=[amp,compile,fsdp,float8]"],
    }
    for name, stages in runs.items():
        torchrun_output(2, "train.py", *common, *stages, f"hydra.run.dir={tmp_path / name}")
    gather, plain = (
        logged(tmp_path / "gather", "train/loss"),
        logged(tmp_path / "plain", "train/loss"),
    )
    gap = [abs(a - b) for a, b in zip(gather, plain, strict=True)]
    # The two runs differ by the GPU's nondeterministic reductions only. Those differences stay
    # near 1e-4 while the warming-up learning rate is small, then grow with it (two H200 pairs:
    # at most 0.0013 through step 17, then up to 0.008; a third pair reached 0.026): the early
    # steps judge the math.
    assert len(gap) == 20 and max(gap[:15]) < 0.005 and max(gap) < 0.05, gap
    done = subprocess.run(
        [python(), "train.py", f"hydra.run.dir={tmp_path / 'gather'}", "train.resume=true",
         "~opt=fsdp", "~opt=float8", "train.batch_size=32", "train.max_steps=22"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(logged(tmp_path / "gather", "train/loss")) == 22
