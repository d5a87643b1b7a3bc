"""+opt=pp with +opt=tp: each pipeline stage's blocks split over a tp group, each tp
rank's part of the residual stream carried by its own pipeline (a pp x dp x tp mesh, tp
innermost). On CPUs (gloo, float32, 4 blocks): pp=2 x tp=2 on 4 processes (1f1b; and
interleaved with the stream and the loss whole on every tp rank, compiled per piece), and
pp=2 x fsdp=2 x tp=2 on 8, give one process's losses with the same global batch over 8 steps;
their checkpoints, read whole or resumed in one process, hold the one process's weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import (
    GLOBAL_BATCH,
    Layouts,
    assert_holds_the_weights_of,
    assert_same_run,
    layout_runs,
)

LAYOUTS: Layouts = {
    "pp_tp": (4, ["+opt=[pp,tp]", GLOBAL_BATCH]),
    # Interleaved (2 stages a rank), the residual stream and the loss whole on every tp rank,
    # and each block, embed and head compiled whole (fullgraph: a graph break fails the run).
    "interleaved_whole_compiled": (4, [
        "+opt=[pp,tp,compile]", GLOBAL_BATCH, "opt.pp.schedule=interleaved_1f1b",
        "opt.pp.stages_per_rank=2", "opt.tp.sequence_parallel=false",
        "opt.tp.loss_parallel=false", "opt.compile.backend=aot_eager",
        "opt.compile.fullgraph=true",
    ]),
    "pp_fsdp_tp": (8, ["+opt=[pp,tp,fsdp]", "train.batch_size=4"]),  # 2 pipelines of 2 x 2
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process; each layout; pp x tp stopped at step 4 and continued in one process."""
    return layout_runs(tmp_path_factory.mktemp("pp_tp"), LAYOUTS, "pp_tp", ["pp", "tp"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipelines_of_tensor_parallel_stages_match_one_process(runs, name: str) -> None:
    """The tied embedding/head gradient summed shard by shard, the norm over pp, tp (and dp),
    the stream's parts sent rank to rank: one process's losses and gradient norms; the
    checkpoint (a DCP shard per rank) read whole holds its weights."""
    assert_same_run(runs[name], runs["single"])
    stdout = (runs[name] / "stdout.txt").read_text()
    processes, _ = LAYOUTS[name]
    dp = processes // 4
    assert f"[opt] tp: 2 ranks per group x {dp} data-parallel" in stdout
    assert f"[opt] pp: 2 ranks x {2 if 'interleaved' in name else 1} stage(s)" in stdout
    assert ("[opt] fsdp: 2 shards" in stdout) == (dp == 2)
    step = runs[name] / "checkpoint.dcp" / (runs[name] / "checkpoint.dcp/LATEST").read_text()
    assert len(list(step.glob("*.distcp"))) == processes
    assert_holds_the_weights_of(runs[name], runs["single"])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_pp_by_tp_checkpoint_resumes_in_one_process(runs) -> None:
    """Each rank wrote its stage's tp shards at step 4; one process read them whole (the
    strided QKV in GPT-2's rows, the head's copy of the tied weight dropped) and went on as
    the uninterrupted run."""
    assert_same_run(runs["on_one"], runs["single"])
