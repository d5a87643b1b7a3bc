"""HSDP (the outer data-parallel dimension): `opt.fsdp.replicas=R` arranges the
data-parallel processes as R replicas of the model, each sharded by FSDP2 over its own
processes (a machine's, in a real run), the gradients all-reduced between replicas. On CPUs
(gloo, float32): 2 replicas x 2 shards on 4 processes, and with +opt=tp or +opt=pp (2 x 2 x 2
on 8), give one process's losses with the same global batch; their checkpoints, read whole or
resumed in one process, hold its weights. The planning rules, in this process (the planner's
share: tests/harness/test_plan_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import Layouts, assert_holds_the_weights_of, assert_same_run, layout_runs, planned

HSDP = ["opt.fsdp.replicas=2", "train.batch_size=2"]  # 4 data-parallel ranks, 8 sequences
LAYOUTS: Layouts = {
    "hsdp": (4, ["+opt=fsdp", *HSDP]),
    "tp_hsdp": (8, ["+opt=[tp,fsdp]", *HSDP]),
    "pp_hsdp": (8, ["+opt=[pp,fsdp]", *HSDP, "opt.pp.microbatches=2"]),  # 2 stages x 2 x 2
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process; each layout; HSDP stopped at step 4 and continued in one process."""
    return layout_runs(tmp_path_factory.mktemp("hsdp"), LAYOUTS, "hsdp", ["fsdp"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replicas_of_sharded_models_match_one_process(runs, name: str) -> None:
    assert_same_run(runs[name], runs["single"])
    stdout = (runs[name] / "stdout.txt").read_text()
    assert "[opt] fsdp: 2 replicas x 2 shards" in stdout
    assert_holds_the_weights_of(runs[name], runs["single"])


@pytest.mark.slow
@pytest.mark.distributed
def test_an_hsdp_checkpoint_resumes_in_one_process(runs) -> None:
    assert_same_run(runs["on_one"], runs["single"])


def test_the_replicas_divide_what_the_model_splitting_stages_leave() -> None:
    assert planned(4, "+opt=fsdp", "opt.fsdp.replicas=2").parallel.dp_replicate == 2
    hsdp_tp = planned(8, "+opt=[tp,fsdp]", "opt.fsdp.replicas=4")
    assert hsdp_tp.parallel.dp_replicate == 4  # 4 x 1 x 2
    assert planned(4, "+opt=fsdp").parallel.dp_replicate == 1  # FSDP over all of them
    with pytest.raises(ValueError, match="^opt.fsdp.replicas=3 does not divide the 4") as refused:
        planned(4, "+opt=fsdp", "opt.fsdp.replicas=3")
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="^opt.fsdp.replicas=4 does not divide the 2 data"):
        planned(4, "+opt=[tp,fsdp]", "opt.fsdp.replicas=4")  # 2 tp ranks leave 2
