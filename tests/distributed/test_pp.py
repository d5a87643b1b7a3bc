"""+opt=pp: two pipeline ranks (gloo, float32) give the single process's losses under every
schedule, their checkpoint (a DCP shard per stage, under the full model's names) resumes in one
process and loads for sampling; the split, the pruning and the refusals, in this process."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import checkpointing
import opt
from base.distributed import Distributed
from helpers import ROOT, TINY, launch_agents, logged, make_cfg, tiny_cfg, tool_cfg
from launch.torchrun import torchrun
from model import GPT, GPTConfig
from opt.pp import bubble, prune, stage_starts
from tools import consolidate_checkpoint, evaluate
from train import build_optimizer, train

# 4 blocks (interleaved: 2 stages on each of 2 ranks); a constant learning rate, so that a run
# stopped at step 4 and resumed is the 8-step run; 7 validation windows: the last batch short.
RUN = (
    "model.n_layer=4", "train.max_steps=8", "train.log_interval=1", "train.eval_interval=4",
    "wandb.mode=disabled", "train.warmup_steps=0", "train.min_lr=${train.lr}",
    "train.eval_sequences=7",
)  # fmt: skip
SCHEDULES = {
    "gpipe": ["opt.pp.schedule=gpipe"],
    "1f1b": ["opt.pp.schedule=1f1b"],
    "interleaved_1f1b": ["opt.pp.schedule=interleaved_1f1b", "opt.pp.stages_per_rank=2"],
}
RTOL = {"train/loss": 1e-5, "val/loss": 1e-5, "train/grad_norm": 1e-4}
MULTI = Distributed(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))


def _pp(run_dir: Path, *args: str, stages: str = "pp") -> None:
    command = [*torchrun(2), "train.py", *TINY, *RUN, f"+opt=[{stages}]", *args]
    (run_dir.parent / f"{run_dir.name}.log").write_text(
        launch_agents([*command, f"hydra.run.dir={run_dir}"])
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp")
    train(tiny_cfg(*RUN), root / "single", overrides=[*TINY, *RUN])
    for name in ("gpipe", "interleaved_1f1b"):
        _pp(root / name, *SCHEDULES[name])
    _pp(
        root / "compiled",
        *SCHEDULES["interleaved_1f1b"],
        "opt.compile.backend=aot_eager",
        "opt.compile.fullgraph=true",
        stages="pp,compile",
    )  # each of a rank's two stages whole
    # 1f1b: stopped at step 4, resumed on the pipeline (-> 1f1b) and in one process.
    _pp(root / "1f1b", *SCHEDULES["1f1b"], "train.max_steps=4")
    shutil.copytree(root / "1f1b", root / "on_one")
    launch_agents([*torchrun(2), "train.py", f"hydra.run.dir={root / '1f1b'}",
             "train.resume=true", "train.max_steps=8"])  # fmt: skip
    resume_here = ("train.resume=true", "train.max_steps=8", "~opt.pp")
    cfg = make_cfg(*TINY, *RUN, "+opt=pp", *resume_here)
    train(cfg, root / "on_one", overrides=list(resume_here))
    return {name: root / name for name in ("single", *SCHEDULES, "on_one", "compiled")}


def _metrics(run_dir: Path) -> dict[str, list[float]]:
    return {key: logged(run_dir, key) for key in RTOL}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_schedule_matches_one_process(runs, schedule: str) -> None:
    single, pipelined = _metrics(runs["single"]), _metrics(runs[schedule])
    assert len(pipelined["train/loss"]) == 8 and len(pipelined["val/loss"]) == 3
    for key in single:
        torch.testing.assert_close(pipelined[key], single[key], rtol=RTOL[key], atol=0)
    log = (runs[schedule].parent / f"{schedule}.log").read_text()
    assert f"[opt] pp: 2 ranks x {2 if 'interleaved' in schedule else 1} stage(s)" in log
    bubble = "11%" if "interleaved" in schedule else "20%"  # (p-1)/(v·m+p-1), p=2, m=4, v=2 or 1
    assert f"idle in theory {bubble} of the step" in log


@pytest.mark.slow
@pytest.mark.distributed
def test_compile_composes_as_one_graph_per_stage(runs) -> None:
    """Each rank's stage compiled as one graph once built (its blocks and, on the first, the
    embeddings), the head and loss as another (fullgraph: a graph break fails the run)."""
    for key, values in _metrics(runs["single"]).items():
        torch.testing.assert_close(_metrics(runs["compiled"])[key], values, rtol=RTOL[key], atol=0)
    assert (
        "[opt] compile: the head now, each pipeline stage whole once +opt=pp has built them"
        in (runs["compiled"].parent / "compiled.log").read_text()
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_a_pipeline_checkpoint_resumes_in_one_process_and_samples(runs, tmp_path) -> None:
    """Each stage wrote its own shard; one process resumed it (the same losses as the
    uninterrupted run), and the whole model loads from it under the full model's names, for
    sample.py and tools/evaluate.py (which gives the run's last val/loss)."""
    for run in ("1f1b", "on_one"):
        for key, values in _metrics(runs["single"]).items():
            torch.testing.assert_close(_metrics(runs[run])[key], values, rtol=RTOL[key], atol=0)
    step = runs["1f1b"] / "checkpoint.dcp" / (runs["1f1b"] / "checkpoint.dcp/LATEST").read_text()
    assert sorted(p.name for p in step.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    loaded, _ = checkpointing.load_model(runs["1f1b"])
    single = torch.load(runs["single"] / "checkpoint.pt", weights_only=True)["model"]
    assert loaded.state_dict().keys() == single.keys()
    for name, tensor in single.items():
        # (Adam amplifies float rounding in the near-zero weights: an absolute tolerance)
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=1e-4, atol=1e-5)
    assert not (runs["1f1b"] / "samples.txt").exists()  # no rank holds the whole model
    assert (runs["single"] / "samples.txt").exists()
    # Consolidated into one checkpoint.pt, it restores in one process (the optimizer too).
    copy = tmp_path / "run"
    shutil.copytree(runs["1f1b"], copy)
    consolidate_checkpoint.consolidate(copy)
    state = checkpointing.read(copy)
    assert "sharded" not in state
    model = GPT(GPTConfig(**state["model_config"]))
    optimizer = build_optimizer(model, tiny_cfg(*RUN).train, {})
    checkpointing.restore(state, model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
    assert len(optimizer.state) == len(list(model.parameters()))
    torch.testing.assert_close(model.state_dict(), loaded.state_dict())
    evaluated = evaluate.evaluate_model(tool_cfg("evaluate", f"run={runs['1f1b']}"))
    assert evaluated["val/loss"] == pytest.approx(logged(runs["1f1b"], "val/loss")[-1], rel=1e-5)


@pytest.mark.distributed
def test_a_pipeline_refuses_a_checkpoint_written_without_it(tmp_path) -> None:
    args = ("model.n_layer=4", "train.max_steps=1", "sample.num_samples=0", "wandb.mode=disabled")
    train(tiny_cfg(*args), tmp_path, overrides=[*TINY, *args])
    command = [*torchrun(2), "train.py", f"hydra.run.dir={tmp_path}",
               "train.resume=true", "train.max_steps=2", "+opt=pp"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "this checkpoint was written without +opt=pp" in done.stdout + done.stderr


def _gpt() -> GPT:
    torch.manual_seed(0)  # as every rank builds it
    return GPT(GPTConfig(n_layer=6, n_head=2, n_embd=16, block_size=8, vocab_size=64))


def test_stages_take_as_many_blocks_each_or_split_as_given() -> None:
    assert stage_starts(6, None, 2) == [0, 3, 6]
    assert stage_starts(7, None, 3) == [0, 3, 5, 7]  # the first stages take the extra blocks
    assert stage_starts(48, None, 4) == [0, 12, 24, 36, 48]
    assert stage_starts(6, [1, 4], 3) == [0, 1, 4, 6]


def test_each_rank_keeps_its_stages_under_the_full_models_names() -> None:
    full = _gpt().state_dict()
    first, last = _gpt(), _gpt()
    prune(first, [0, 1, 2], first=True, last=False)
    prune(last, [3, 4, 5], first=False, last=True)
    assert set(first.state_dict()) | set(last.state_dict()) == set(full)
    assert "lm_head.weight" not in first.state_dict()
    assert not any(k.startswith("transformer.h.3") for k in first.state_dict())
    # The head's own copy of the tied embedding: the same values, another tensor.
    head, embedding = last.lm_head.weight, full["transformer.wte.weight"]
    assert torch.equal(head, embedding) and head.data_ptr() != embedding.data_ptr()


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["opt.pp.schedule=zb"], 2, "opt.pp.schedule must be one of gpipe, 1f1b, .*got 'zb'"),
        (["opt.pp.degree=1"], 1, "opt.pp.degree must be an integer >= 2, got 1"),
        ([], 1, "1 processes cannot form 2 pipeline stage"),
        ([], 3, "3 processes cannot form 2 pipeline stage"),
        (["opt.pp.schedule=interleaved_1f1b"], 2, "interleaved_1f1b needs 2 or more stages"),
        (["opt.pp.stages_per_rank=2"], 2, "gpipe and 1f1b exactly 1"),
        (["model.n_layer=2", "opt.pp.schedule=interleaved_1f1b", "opt.pp.stages_per_rank=2"], 2,
         "model.n_layer=2 blocks cannot fill 4 pipeline stages"),
        (["opt.pp.microbatches=3"], 2, "opt.pp.microbatches=3 must divide the batch size 8"),
        (["opt.pp.microbatches=1"], 2, "1f1b needs at least one per stage \\(2\\)"),
        (["opt.pp.schedule=interleaved_1f1b", "opt.pp.stages_per_rank=2", "train.batch_size=10",
          "opt.pp.microbatches=5"], 2, "interleaved_1f1b needs a multiple of 2"),
        (["opt.pp.split=[0]"], 2, "opt.pp.split=\\[0\\]: give the 1 increasing block indices"),
        (["opt.pp.split=[4]"], 2, "opt.pp.split=\\[4\\]: model.n_layer=4 blocks end before it"),
        (["train.hellaswag=true"], 2, "\\+opt=pp with train.hellaswag=true"),
        (["+opt=[pp,amp]", "opt.amp.dtype=float16"], 2, "\\+opt=pp with opt.amp.dtype=float16"),
    ],
)  # fmt: skip
def test_what_cannot_run_is_refused_in_one_line(overrides, world: int, message: str) -> None:
    stages = [] if any(o.startswith("+opt=") for o in overrides) else ["+opt=pp"]
    cfg = make_cfg(*stages, *overrides)
    dist = Distributed(rank=0, local_rank=0, world_size=world, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=message) as refused:
        opt.plan(cfg, dist)
    assert "\n" not in str(refused.value)


def test_the_bubble_in_theory() -> None:
    assert bubble(2, 4) == pytest.approx(1 / 5)  # GPipe/1F1B: (p-1)/(m+p-1)
    assert bubble(4, 8, stages_per_rank=2) == pytest.approx(3 / 19)  # interleaved: v·m
    assert bubble(4, 8) > bubble(4, 16) > bubble(4, 16, stages_per_rank=2)


def test_planning_a_pipeline() -> None:
    plan = opt.plan(make_cfg("+opt=pp"), MULTI)
    assert plan.stages == ["pp"] and plan.parallel.pp == 2
    assert plan.micro_steps == 1  # the schedule runs the micro-batches
    assert opt.ORDER.index("compile") < opt.ORDER.index("pp") < opt.ORDER.index("fsdp")
