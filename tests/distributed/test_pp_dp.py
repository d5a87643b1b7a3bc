"""+opt=pp with data parallelism: 4 processes as 2 pipelines of 2 ranks, FSDP
('+opt=[pp,fsdp]', 1f1b and interleaved) or replicas (+opt=pp alone: FSDP2's replicate) over the
mesh's dp dimension, each pipeline reading its half of the global batch, give one process's
losses with that batch over 8 steps, and log the measured bubble; a pp x fsdp checkpoint (a DCP
shard per stage and dp rank) resumes in one process. The planning rules, in this process."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

import checkpointing
from helpers import assert_same_run, layout_runs, logged, planned
from opt.pp import ComputeClock

PER_PIPELINE = "train.batch_size=4"  # each of 2 pipelines: half of helpers' GLOBAL_BATCH
LAYOUTS = {  # 2 pipelines: each stage FSDP-sharded, or replicated; interleaved: 2 stages a rank
    "fsdp": (4, ["+opt=[pp,fsdp]", PER_PIPELINE]),
    "ddp": (4, ["+opt=pp", PER_PIPELINE]),
    "fsdp_interleaved": (4, ["+opt=[pp,fsdp]", PER_PIPELINE, "opt.pp.schedule=interleaved_1f1b",
                             "opt.pp.stages_per_rank=2"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process with the global batch; pp=2 x fsdp=2 and pp=2 x 2 replicas on 4 processes;
    pp=2 x fsdp=2 stopped at step 4 and continued in one process."""
    return layout_runs(tmp_path_factory.mktemp("pp_dp"), LAYOUTS, "fsdp", ["pp", "fsdp"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_pipelines_match_one_process(runs, name: str) -> None:
    """The tied embedding/head gradient summed in each pipeline, the norm clipped over pp and
    dp, each pipeline's slice of the batch: the one process's losses and norms."""
    assert_same_run(runs[name], runs["single"])
    stdout = (runs[name] / "stdout.txt").read_text()
    assert f"[opt] pp: 2 ranks x {2 if 'interleaved' in name else 1} stage(s)" in stdout
    fsdp = "fsdp" in name
    assert ("[opt] fsdp: 2 shards" if fsdp else "[opt] ddp: 2 replicas of each pipeline") in stdout
    # Its checkpoint, read whole in one process (sample.py, tools/): the one process's weights
    # (Adam turns near-zero gradients' rounding into up to a tenth of a step's lr: atol).
    loaded, _ = checkpointing.load_model(runs[name])
    single = torch.load(runs["single"] / "checkpoint.pt", weights_only=True)["model"]
    torch.testing.assert_close(loaded.state_dict(), single, rtol=1e-4, atol=2e-4)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_measured_bubble_is_logged_beside_the_theory(runs, name: str) -> None:
    """Each log step's idle fraction of the ranks' steps (compute chunks vs the step's time),
    and the summary's last one, beside the schedule's (p-1)/(v·m+p-1): 1/5, interleaved 1/9."""
    measured = logged(runs[name], "perf/pp_bubble")
    assert len(measured) == 8 and all(0 < idle < 1 for idle in measured)
    theory = 1 / 9 if "interleaved" in name else 1 / 5
    assert logged(runs[name], "perf/pp_bubble_theory") == [pytest.approx(theory)] * 8
    summary = json.loads((runs[name] / "summary.json").read_text())
    assert summary["perf/pp_bubble"] == measured[-1]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_pp_by_fsdp_checkpoint_resumes_in_one_process(runs) -> None:
    """Each of the 4 ranks wrote its stage's FSDP shard; one process read them whole at step 4
    and went on as the uninterrupted run."""
    step = runs["fsdp"] / "checkpoint.dcp" / (runs["fsdp"] / "checkpoint.dcp/LATEST").read_text()
    assert len(list(step.glob("*.distcp"))) == 4
    assert_same_run(runs["on_one"], runs["single"])


def test_several_pipelines_are_planned_with_fsdp_or_replicas() -> None:
    assert planned(4, "+opt=[pp,fsdp]").stages == ["pp", "fsdp"]
    assert planned(4, "+opt=[pp,ddp]").parallel.pp == 2
    assert planned(8, "+opt=pp", "opt.pp.degree=4").parallel.pp == 4
    pp_tp = planned(8, "+opt=[pp,tp,fsdp]")  # a 2 x 2 x 2 pp x dp x tp mesh
    assert (pp_tp.parallel.pp, pp_tp.parallel.tp, pp_tp.tp_sequence_parallel) == (2, 2, True)


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (3, ["+opt=pp"], "3 processes cannot form 2 pipeline stage\\(s\\)"),
        (6, ["+opt=[pp,tp]"], "6 processes cannot form 2 pipeline stage\\(s\\) x 2 tensor"),
        (4, ["+opt=[pp,fsdp,ddp]"], "\\+opt=ddp and \\+opt=fsdp: two ways"),
    ],
)
def test_what_still_cannot_run_is_refused_in_one_line(world: int, overrides, message) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        planned(world, *overrides)
    assert "\n" not in str(refused.value)


def test_the_clock_counts_compute_inside_training_steps_once() -> None:
    """Busy: the timed compute in a step, once when nested (the loss inside a chunk); not an
    evaluation's chunks outside a step; idle: the rest of the step."""
    clock = ComputeClock(torch.device("cpu"))
    compute = clock.timed(lambda seconds: time.sleep(seconds))
    nested = clock.timed(lambda: compute(0.05))
    compute(0.2)  # evaluation: no step
    with clock.step():
        nested()
        time.sleep(0.05)  # waiting for another stage
    assert clock.idle() == pytest.approx(0.5, abs=0.15)
    assert math.isnan(clock.idle())  # no step since
