"""scripts/plan_memory.py (measure/plan_memory.py, its model measure/memory_model.py): every
measured ok row of the memory ladders (and of the scaling ladder's tp and pp rows, as they land)
predicted within 10% from shapes and stages alone, the published table current, one JSON object
per prediction, --fit's candidates fastest first with commands that plan the same, a bad
override refused in one line, a stage the model does not cover refused, and a prediction in
seconds on a CPU. Under +opt=tp and +opt=pp each rank's part: its weights counted against the
parameters opt/tp.py's split and opt/pp.py's prune leave a rank, its activations per schedule;
--fit gpus=N's layouts in the order to try them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor

from base.distributed import Distributed, ParallelDims
from helpers import ROOT, python
from measure import memory_model, plan_memory
from model import GPT
from opt.pp import prune, stage_starts
from opt.tp import apply_tp
from recipe import metrics

ROWS = [
    (gpu, ladder, row["name"])
    for gpu, ladder, row in [
        *plan_memory.ladder_rows(plan_memory.VALIDATED),
        *plan_memory.split_rows(),
    ]
]
XL_LOWBIT = [
    "model=gpt2-xl", "train.batch_size=16", "+opt=[amp,ac,custom_op,lowbit,opt_in_backward]",
    "opt.amp.dtype=bfloat16", "opt.custom_op.chunk_size=4096", "opt.amp.weight_cache=false",
    "train.grad_clip=inf",
]  # fmt: skip


def _row(gpu: str, ladder: str, name: str) -> dict:
    return next(r for r in plan_memory.measured_rows(gpu, ladder) if r["name"] == name)


@pytest.mark.parametrize(("gpu", "ladder", "name"), ROWS)
def test_every_measured_row_is_predicted_within_tolerance(gpu: str, ladder: str, name: str):
    row = _row(gpu, ladder, name)
    predicted = plan_memory.predict_overrides(plan_memory.row_overrides(row)).peak_gib
    measured = row["peak_allocated_gib"]
    assert abs(predicted / measured - 1) <= plan_memory.TOLERANCE, (predicted, measured)


def test_the_published_table_lists_every_validated_row() -> None:
    text = (ROOT / "docs/results" / plan_memory.FIT_GPU / "memory_plan.md").read_text()
    table = text.split("## Not validated")[0]  # the informative tables follow
    for gpu, ladder, name in ROWS:
        assert f"| {gpu} | {ladder} | `{name}` |" in table
    assert "**off**" not in table


def test_json_has_the_peak_every_category_and_the_phase_in_seconds() -> None:
    started = time.perf_counter()
    done = subprocess.run(
        [python(), "scripts/plan_memory.py", *XL_LOWBIT, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.perf_counter() - started < 60  # seconds, no GPU (~5 s of CPU)
    out = json.loads(done.stdout)
    assert set(out) == {
        "peak_gib", *memory_model.CATEGORIES, "phase", "moment", "sets_peak", "rank"
    }  # fmt: skip
    assert out["phase"] in ("forward", "backward", "step")
    assert out["sets_peak"] in memory_model.CATEGORIES
    parts = sum(out[c] for c in memory_model.CATEGORIES)
    assert out["peak_gib"] == pytest.approx(parts, abs=0.01)
    block = (12 * 1600**2 + 13 * 1600) * 4 / 2**30  # GPT-2 XL's block, float32: 0.115 GiB
    assert out["gradients"] == pytest.approx(block, abs=0.001)  # opt_in_backward: one block's


def test_stages_move_the_categories_they_should() -> None:
    base = plan_memory.predict_overrides(["model=gpt2-medium", "+opt=[amp,fused]"])
    ac = plan_memory.predict_overrides(["model=gpt2-medium", "+opt=[amp,fused,ac]"])
    lowbit = plan_memory.predict_overrides(XL_LOWBIT)
    four = plan_memory.predict_overrides([*XL_LOWBIT, "opt.lowbit.bits=4"])
    assert ac.everything["forward"]["activations"] < base.everything["forward"]["activations"] / 5
    assert four.categories["optimizer_state"] < 0.6 * lowbit.categories["optimizer_state"]
    assert base.everything["step"]["optimizer_state"] == 2 * base.everything["step"]["weights"]


def test_fit_lists_the_fastest_fitting_rows_first_with_their_commands(monkeypatch) -> None:
    monkeypatch.setattr(plan_memory, "FIT_LADDERS", ("memory_xl",))
    found = plan_memory.fit(22)
    speeds = [r["tokens_per_sec"] for r in found]
    assert speeds == sorted(speeds, reverse=True)
    assert found[0]["name"] == "lowbit"  # the fastest memory_xl row predicted under 22 GiB
    assert all(r["peak_gib"] * plan_memory.RESERVED_OVER_ALLOCATED <= 22 for r in found)
    assert {"ac", "bf16", "bs64"}.isdisjoint(r["name"] for r in found)
    command = shlex.split(found[0]["command"])
    assert command[:2] == ["python", "train.py"] and "hydra.run.dir" not in found[0]["command"]
    again = plan_memory.predict_overrides(command[2:]).peak_gib
    assert again == pytest.approx(found[0]["peak_gib"])
    # the measurement: the 8-bit row ran out of memory under a 14 GiB cap
    assert "lowbit" not in [r["name"] for r in plan_memory.fit(14)]


@pytest.mark.parametrize("model, ladder", [("gpt2-xl", "memory_xl"), ("gpt2", "speed")])
def test_fit_lists_rows_of_the_asked_model_each_key_once(model: str, ladder: str) -> None:
    found = plan_memory.fit(80, model=model)
    assert found and {r["ladder"] for r in found} == {ladder}
    for r in found:
        words = shlex.split(r["command"])[2:]
        keys = [w.split("=", 1)[0] for w in words]
        assert f"model={model}" in words and len(keys) == len(set(keys)), r["command"]
    # the last of a key's values wins, as Hydra composes them: the prediction is unchanged
    row = plan_memory.measured_rows(plan_memory.FIT_GPU, ladder)[-1]
    args = shlex.split(row["command"].split(" & ")[0])
    skipped = ("hydra.", "wandb.", "+prof")
    raw = [a for a in args[args.index("train.py") + 1 :] if not a.startswith(skipped)]
    assert plan_memory.predict_overrides(plan_memory.row_overrides(row)).peak_gib == (
        pytest.approx(plan_memory.predict_overrides(raw).peak_gib)
    )


def test_budgets_read_gib_and_the_gb_cards_are_sold_in() -> None:
    assert plan_memory.parse_size("22GiB") == plan_memory.parse_size("22") == 22
    assert plan_memory.parse_size("24GB") == pytest.approx(22.35, abs=0.01)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["model=nope"], "model=nope: no such option; choose one of"),
        # Typos answered as train.py answers them: the closest key or option.
        (["model=gpt2-xll"], "model=gpt2-xll: no such option (did you mean gpt2-xl?)"),
        (["modle=gpt2"], "(did you mean model?)"),
        (["train.bach_size=4"], "train.bach_size is not a setting (did you mean train.batch_size"),
        (["+opt=[amp,ac]", "opt.ac.mode=bogus"], "opt.ac.mode must be one of"),
        (["train.batch_size=0"], "train.batch_size must be"),
        (["budget=lots"], "budget='lots'"),
        (["nproc=0"], "nproc=0"),
        (["--fit"], "budget=22GiB"),
        (["--jsn"], "unknown flag"),
        # What the stages refuse, the planner refuses: GPT-2 XL's 25 heads over 2 tp ranks.
        (["model=gpt2-xl", "+opt=[tp,amp]", "nproc=2"], "model.n_head=25 does not split"),
        (["gpus=0", "--fit", "budget=80GiB"], "gpus=0"),
    ],
)
def test_a_bad_override_is_refused_in_one_line(args: list[str], expected: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts/plan_memory.py")])  # names the program
    with pytest.raises(SystemExit) as refused:
        plan_memory.cli(args)
    message = str(refused.value)
    assert message.startswith("plan_memory.py: error: ") and expected in message, message
    assert "\n" not in message and refused.value.code == 2


def test_the_command_line_refuses_a_typo_in_one_line_with_a_suggestion() -> None:
    done = subprocess.run(
        [python(), "scripts/plan_memory.py", "model=gpt2-xll"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's recipe
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        "plan_memory.py: error: model=gpt2-xll: no such option (did you mean gpt2-xl?); choose "
    )


def test_hsdp_shards_over_one_replica() -> None:
    """Under HSDP (opt.fsdp.replicas) each rank holds 1/shards of the weights and AdamW's
    state: 2 replicas x 2 shards hold twice FSDP-over-4's share."""
    shared = ["model=gpt2-xl", "+opt=[amp,fsdp]", "nproc=4"]
    over_four = memory_model.predict(*plan_memory.compose(shared)[:2]).as_dict()
    hsdp = memory_model.predict(*plan_memory.compose([*shared, "opt.fsdp.replicas=2"])[:2])
    for category in ("weights", "optimizer_state"):
        ratio = hsdp.as_dict()[category] / over_four[category]
        assert ratio == pytest.approx(2, rel=0.1), category


def test_a_stage_the_model_does_not_cover_is_refused_naming_it(monkeypatch) -> None:
    """The planner plans only the stages it lists as modelled: a stage left off the list (as a
    stage newly added to opt/ is) is refused in one line, not planned as if it were absent."""
    monkeypatch.setattr(memory_model, "MODELLED", memory_model.MODELLED - {"tf32"})
    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts/plan_memory.py")])  # names the program
    with pytest.raises(SystemExit) as refused:
        plan_memory.cli(["+opt=[amp,tf32]"])
    message = str(refused.value)
    assert message.startswith("plan_memory.py: error: +opt=tf32 is not modelled"), message
    assert "\n" not in message and refused.value.code == 2


def test_the_modelled_stages_are_stages() -> None:
    """Every name on the list is a stage of opt/: a renamed stage leaves no stale name."""
    import opt

    assert not memory_model.MODELLED - set(opt.ORDER)


# ---- tensor and pipeline parallelism: each rank's part

MEDIUM = ["model=gpt2-medium", "train.batch_size=8"]  # 16 heads: tp=2 and 4 split them
XL_PIPE = ["model=gpt2-xl", "train.batch_size=16", "opt.pp.microbatches=8"]


def _ranks(*overrides: str) -> list[memory_model.Prediction]:
    cfg, nproc, _ = plan_memory.compose(list(overrides))
    return memory_model.predict_ranks(cfg, nproc)


def _gib(p: memory_model.Prediction, moment: str, category: str) -> float:
    return p.everything[moment][category] / memory_model.GIB


def test_tp_holds_half_the_blocks_and_sequence_parallel_halves_the_residual_stream() -> None:
    """tp=2: each rank holds half of every matmul (the replicated LayerNorms, positions and
    row-split biases are 0.1% of GPT-2 medium), so half the weights, gradients and AdamW state;
    sequence_parallel halves what lives in the residual stream (all that full checkpointing
    keeps), loss_parallel the logits."""
    (one,) = _ranks(*MEDIUM, "+opt=[amp,fused]")
    (tp,) = _ranks(*MEDIUM, "+opt=[amp,fused,tp]", "nproc=2")
    for moment, category in [("step", "weights"), ("backward_end", "gradients"),
                              ("step", "optimizer_state")]:  # fmt: skip
        ratio = _gib(tp, moment, category) / _gib(one, moment, category)
        assert 0.5 < ratio < 0.505, (category, ratio)
    # Without checkpointing the matmuls' inputs stay whole: more than half the activations.
    assert 0.5 < _gib(tp, "forward", "activations") / _gib(one, "forward", "activations") < 0.7
    assert _gib(tp, "forward", "logits_loss") == pytest.approx(
        _gib(one, "forward", "logits_loss") / 2
    )
    checkpointed = [*MEDIUM, "+opt=[amp,fused,ac,tp]", "nproc=2"]
    (sequence,) = _ranks(*checkpointed)
    (whole,) = _ranks(*checkpointed, "opt.tp.sequence_parallel=false", "opt.tp.loss_parallel=false")
    (alone,) = _ranks(*MEDIUM, "+opt=[amp,fused,ac]")
    assert _gib(sequence, "forward", "activations") == pytest.approx(
        _gib(alone, "forward", "activations") / 2
    )
    assert _gib(whole, "forward", "activations") == pytest.approx(
        _gib(alone, "forward", "activations")
    )
    assert _gib(whole, "forward", "logits_loss") == pytest.approx(
        _gib(alone, "forward", "logits_loss")
    )


def _micro_batch_activations(blocks: int) -> float:
    """One GPU's forward activations of XL_PIPE's micro-batch (2 sequences) through `blocks`
    blocks: what a pipeline rank keeps per micro-batch in flight."""
    (p,) = _ranks("model=gpt2-xl", f"model.n_layer={blocks}", "train.batch_size=2", "+opt=[amp]")
    return _gib(p, "forward", "activations")


def test_a_pipeline_keeps_the_micro_batches_its_schedule_has_in_flight() -> None:
    """1f1b on 2 ranks: rank 0 runs 2 forwards before its first backward, so it keeps 2
    micro-batches' activations of its blocks, the last rank 1; gpipe keeps all 8; interleaved
    (2 stages a rank, 12 blocks each) runs torch's 4 warmup forwards and one more first: 2.5
    micro-batches of rank 0's blocks. Gradients exist at 1f1b's forward peak (a backward ran
    before), not at gpipe's."""
    one_f_one_b = _ranks(*XL_PIPE, "+opt=[amp,pp]", "nproc=2")
    cfg, _, _ = plan_memory.compose([*XL_PIPE, "+opt=[amp,pp]", "nproc=2"])
    starts = stage_starts(cfg.model.n_layer, None, 2)
    first, last = starts[1], starts[2] - starts[1]
    assert _gib(one_f_one_b[0], "forward", "activations") == pytest.approx(
        2 * _micro_batch_activations(first)
    )
    assert _gib(one_f_one_b[1], "forward", "activations") == pytest.approx(
        _micro_batch_activations(last)
    )
    gpipe = _ranks(*XL_PIPE, "+opt=[amp,pp]", "opt.pp.schedule=gpipe", "nproc=2")
    assert _gib(gpipe[0], "forward", "activations") == pytest.approx(
        8 * _micro_batch_activations(first)
    )
    assert (
        _gib(one_f_one_b[0], "forward", "gradients") > 0 == _gib(gpipe[0], "forward", "gradients")
    )
    interleaved = _ranks(
        *XL_PIPE, "+opt=[amp,pp]", "opt.pp.schedule=interleaved_1f1b", "opt.pp.stages_per_rank=2",
        "opt.pp.split=[12,24,36]", "nproc=2",
    )  # fmt: skip
    assert _gib(interleaved[0], "forward", "activations") == pytest.approx(
        2.5 * _micro_batch_activations(24)
    )
    # The worst rank is the prediction, and says which it is.
    worst = memory_model.predict(cfg, 2)
    assert worst.peak_gib == max(p.peak_gib for p in one_f_one_b)
    assert worst.on_rank == f", pipeline rank {worst.rank} of 2"


def test_the_last_stage_holds_its_own_copy_of_the_tied_embedding() -> None:
    """Two ranks each hold a vocab x n_embd weight, with its gradient and AdamW state: the
    pipeline's weights are one GPU's plus that copy."""
    (one,) = _ranks(*XL_PIPE[:2], "+opt=[amp]")
    ranks = _ranks(*XL_PIPE, "+opt=[amp,pp]", "nproc=2")
    copy = 4 * 50304 * 1600 / memory_model.GIB  # the padded vocabulary x n_embd, float32
    assert sum(_gib(p, "step", "weights") for p in ranks) == pytest.approx(
        _gib(one, "step", "weights") + copy
    )
    assert _gib(ranks[1], "forward", "logits_loss") > 0 == _gib(ranks[0], "forward", "logits_loss")


def _local_bytes(model: torch.nn.Module) -> float:
    """float32 bytes of the parameters this rank holds: a DTensor's local shard."""
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return 4 * sum(t.numel() for t in tensors) / memory_model.GIB


@pytest.fixture
def tp_pair():
    """A process group of 2 with no other process (torch's fake backend: collectives do
    nothing), laid out as one tp group, so that opt/tp.py splits a model here as on rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch_dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    dist = Distributed(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    try:
        yield dist.with_parallel(ParallelDims(2, tp=2))
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.parametrize("pipeline", [False, True])
def test_each_ranks_weights_are_the_parameters_the_split_leaves_it(tp_pair, pipeline) -> None:
    """The planner's weights against the parameters a rank holds once opt/tp.py has split the
    model (on a fake group of 2) and, in a pipeline, opt/pp.py's `prune` kept its stages."""
    stages = "[tp,pp]" if pipeline else "[tp]"
    overrides = ["model=tiny", f"+opt={stages}", f"nproc={4 if pipeline else 2}"]
    cfg, _, _ = plan_memory.compose(overrides)
    planned = _ranks(*overrides)
    knobs = cfg.opt.tp
    starts = stage_starts(cfg.model.n_layer, None, 2)
    for rank, prediction in enumerate(planned):
        model = GPT(memory_model.meta_model(cfg).config)
        with contextlib.redirect_stdout(io.StringIO()):
            apply_tp(model, knobs, tp_pair)
        if pipeline:
            blocks = list(range(starts[rank], starts[rank + 1]))
            prune(model, blocks, first=rank == 0, last=rank == 1)
        assert _gib(prediction, "step", "weights") == pytest.approx(_local_bytes(model)), rank
    assert len(planned) == (2 if pipeline else 1)


def _results(root: Path, rows: list[dict]) -> None:
    path = root / "gpu" / "scaling.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"environment": {}, "steps": rows}))


def _scaling_row(name: str, stages: list[str], overrides: list[str], gpus: int, **numbers) -> dict:
    """A row as the scaling ladder records it: its command (torchrun's) and numbers."""
    command = shlex.join([
        "python", "-m", "torch.distributed.run", f"--nproc_per_node={gpus}", "--standalone",
        "train.py", "data=shakespeare", *overrides, f"+opt=[{','.join(stages)}]",
        f"hydra.run.dir=outputs/{name}",
    ])  # fmt: skip
    return {"name": name, "status": "ok", "stages": stages, "gpus": gpus, "nproc": gpus,
            "nnodes": 1, "command": command, **numbers}  # fmt: skip


def test_validate_checks_the_model_parallel_rows_of_the_scaling_ladder(tmp_path, monkeypatch):
    """Every tp or pp row of a GPU's scaling results is validated once it exists: its worst
    rank's prediction against the measured peak (the largest over the ranks); other rows, and
    failed ones, are not."""
    pipeline = ["model=gpt2-xl", "train.batch_size=16", "opt.pp.microbatches=8"]
    predicted = _ranks(*pipeline, "+opt=[amp,pp]", "nproc=2")
    peak = max(p.peak_gib for p in predicted)
    _results(tmp_path, [
        _scaling_row("xl_pp2", ["amp", "pp"], pipeline, 2, peak_allocated_gib=peak * 1.05),
        _scaling_row("xl_pp2_off", ["amp", "pp"], pipeline, 2, peak_allocated_gib=peak * 1.5),
        _scaling_row("ddp", ["amp"], ["model=gpt2"], 2, peak_allocated_gib=1.0),
        {**_scaling_row("xl_pp4", ["amp", "pp"], pipeline, 2), "status": "oom"},
    ])  # fmt: skip
    monkeypatch.setattr(plan_memory, "RESULTS", tmp_path)
    monkeypatch.setattr(plan_memory, "VALIDATED", ())
    monkeypatch.setattr(plan_memory, "INFORMATIVE", ())
    assert [row["name"] for *_, row in plan_memory.split_rows()] == ["xl_pp2", "xl_pp2_off"]
    text, off = plan_memory.validate()
    assert off == 1
    section = text.split("## Model-parallel layouts")[1].split("## Not validated")[0]
    rank = max(predicted, key=lambda p: p.peak_gib).rank
    assert f"| gpu | scaling | `xl_pp2` | {peak:.2f} | {peak * 1.05:.2f} | -4.8% |" in section
    assert f", pipeline rank {rank} of 2 |" in section
    assert "`xl_pp2_off`" in section and "**off**" in section and "`ddp`" not in text


def test_validate_says_when_no_model_parallel_row_is_measured_yet(tmp_path, monkeypatch):
    _results(tmp_path, [_scaling_row("ddp", ["amp"], ["model=gpt2"], 2, peak_allocated_gib=1.0)])
    for name, value in [("RESULTS", tmp_path), ("VALIDATED", ()), ("INFORMATIVE", ())]:
        monkeypatch.setattr(plan_memory, name, value)
    text, off = plan_memory.validate()
    assert off == 0 and "None measured yet" in text


def test_the_recorded_peak_is_the_largest_over_the_ranks(monkeypatch) -> None:
    """A pipeline's ranks peak apart: the run's mem/peak_allocated_gib (what a ladder row
    records and --validate compares) is the largest of them, not rank 0's."""

    class TwoRanks:
        device = torch.device("cuda", 0)

        def gather(self, mine):
            return [mine, (3 * 2**30, 4 * 2**30)]  # the other rank's: more allocated

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 5 * 2**30)
    assert metrics.memory_gib(TwoRanks()) == {  # type: ignore[arg-type]
        "mem/peak_allocated_gib": 3.0, "mem/peak_reserved_gib": 5.0
    }  # fmt: skip


# ---- --fit gpus=N: the layouts of N GPUs


def test_fit_gpus_prefers_no_model_split_then_a_pipeline_then_tp(tmp_path, monkeypatch) -> None:
    """Nothing measured: of the layouts that fit, data parallelism first, then a pipeline,
    then tp, each without checkpointing before with it; those that do not fit after; each
    command plans the peak it was listed with, at the same global batch."""
    monkeypatch.setattr(plan_memory, "RESULTS", tmp_path)  # no measured rows
    found = plan_memory.fit_layouts(["model=gpt2-medium", "train.batch_size=16", "+opt=[amp]"],
                                    gpus=2, budget_gib=16)  # fmt: skip
    fitting = [r["layout"] for r in found if r.get("fits")]
    assert fitting == [
        "FSDP",
        "DDP + ac",
        "FSDP + ac",
        "pp=2, 8 micro-batches (1f1b)",
        "pp=2, 8 micro-batches (1f1b) + ac",
        "tp=2",
        "tp=2 + ac",
    ], fitting
    assert [r["layout"] for r in found if r.get("fits") is False] == ["DDP"]
    first = shlex.split(found[0]["command"])
    assert first[:6] == ["python", "-m", "launch.torchrun", "--standalone", "--nproc_per_node=2",
                         "train.py"]  # fmt: skip
    assert "+opt=[amp,fsdp]" in first and "train.batch_size=8" in first  # 16 over 2 replicas
    pipeline = next(r for r in found if r["layout"].startswith("pp=2,"))
    args = shlex.split(pipeline["command"])[6:]
    assert "train.batch_size=16" in args and "opt.pp.microbatches=8" in args
    assert plan_memory.predict_overrides([*args, "nproc=2"]).peak_gib == pytest.approx(
        pipeline["peak_gib"]
    )


def test_fit_gpus_ranks_by_measured_tokens_per_second_where_measured(tmp_path, monkeypatch):
    """A layout measured for that model and GPU count outranks the preferred order: the
    faster measured first, then the unmeasured; a run over two machines is not a layout of
    one machine's GPUs."""
    medium = ["model=gpt2-medium", "train.batch_size=16"]
    _results(tmp_path, [
        _scaling_row("pp2", ["amp", "pp"], [*medium, "opt.pp.microbatches=8"], 2,
                     tokens_per_sec=2000.0),
        _scaling_row("fsdp", ["amp", "fsdp"], ["model=gpt2-medium", "train.batch_size=8"], 2,
                     tokens_per_sec=1000.0),
        {**_scaling_row("two_nodes", ["amp"], medium, 2, tokens_per_sec=9000.0), "nnodes": 2},
    ])  # fmt: skip
    monkeypatch.setattr(plan_memory, "RESULTS", tmp_path)
    found = plan_memory.fit_layouts([*medium, "+opt=[amp]"], gpus=2, budget_gib=80)
    assert [r["layout"] for r in found[:3]] == ["pp=2, 8 micro-batches (1f1b)", "FSDP", "DDP"]
    assert found[0]["tokens_per_sec"] == 2000.0 and found[0]["row"] == "gpu scaling/pp2"
    assert found[1]["sequences"] == 16  # FSDP's 8 a GPU over its 2 GPUs
    assert found[2]["tokens_per_sec"] is None
    # The answer names the layouts the rule puts before the measured pipeline, never measured.
    told = plan_memory.describe_layouts(found, gpus=2, budget=80).splitlines()
    assert told[1].startswith("try first: pp=2, 8 micro-batches (1f1b) (the fastest measured")
    assert told[3] == (
        "  not measured, and before it by the rule (no model split, then a pipeline, then tp): "
        "DDP, DDP + ac, FSDP + ac: measure them beside it, as any may be faster"
    )
    fsdp = " FSDP, 1,000 tokens/s measured at 16 sequences a step"
    assert any(line.endswith(fsdp) for line in told)
