"""scripts/gpu_check.py on a CPU: its verdicts on fake rows and a fake pytest run, the check.json
it writes and reads back, the smoke ladder's rows as valid configs, and its one-line refusal
without a GPU."""

from __future__ import annotations

import json
import subprocess

import torch

import opt
from base.distributed import Distributed
from helpers import ROOT, make_cfg, python
from measure import gpu_check, ladders
from recipe import config

PASSED = gpu_check.PytestRun(0, {"passed": 26, "skipped": 1})
FAILED = gpu_check.PytestRun(1, {"failed": 1, "passed": 25, "skipped": 1})


def _row(name: str, tps: float, peak: float = 10.0, **more) -> dict:
    return {"name": name, "status": "ok", "tokens_per_sec": tps, "peak_allocated_gib": peak, **more}


def _verdict(row: dict, accepted: dict | None) -> tuple[list[str], bool]:
    verdict = gpu_check.compare_row(row, accepted)
    assert verdict.line.startswith(f"{row['name']}: ") and "\n" not in verdict.line
    return verdict.changes, verdict.passed


# ---- the verdicts


def test_tokens_per_sec_within_two_percent_pass_and_beyond_regress_or_improve() -> None:
    accepted = _row("baseline", 100_000)
    assert _verdict(_row("baseline", 98_500), accepted) == ([], True)
    assert _verdict(_row("baseline", 101_900), accepted) == ([], True)
    assert _verdict(_row("baseline", 97_000), accepted) == (["slower"], False)
    assert _verdict(_row("baseline", 103_000), accepted) == (["faster"], True)


def test_the_rows_intervals_are_the_noise_when_they_have_them() -> None:
    # The accepted row's repeats spread 95-105 K: 96 K is inside its noise, though 4% slower.
    accepted = _row("baseline", 100_000, interval=[95_000, 105_000])
    assert _verdict(_row("baseline", 96_000), accepted) == ([], True)
    assert _verdict(_row("baseline", 94_000), accepted) == (["slower"], False)
    # A new row whose own repeats reach into the accepted noise is not slower.
    tight = _row("baseline", 100_000, interval=[99_900, 100_100])
    assert _verdict(_row("baseline", 97_000, interval=[96_500, 98_200]), tight) == ([], True)
    assert _verdict(_row("baseline", 97_000, interval=[96_500, 97_500]), tight)[1] is False


def test_peak_memory_within_two_percent_passes_and_more_regresses() -> None:
    accepted = _row("ac", 100_000, peak=10.0)
    assert _verdict(_row("ac", 100_000, peak=10.15), accepted) == ([], True)
    assert _verdict(_row("ac", 100_000, peak=10.3), accepted) == (["more memory"], False)
    assert _verdict(_row("ac", 100_000, peak=9.7), accepted) == (["less memory"], True)
    both = _verdict(_row("ac", 90_000, peak=10.5), accepted)
    assert both == (["slower", "more memory"], False)


def test_a_failed_row_or_one_without_an_accepted_row_does_not_pass() -> None:
    failed = {"name": "custom_op", "status": "oom", "error": "CUDA out of memory"}
    assert _verdict(failed, _row("custom_op", 100_000)) == (["failed"], False)
    assert _verdict(_row("ac", 100_000), None) == (["new"], False)
    verdicts = gpu_check.compare([_row("baseline", 100_000), _row("ac", 90_000)],
                                 [_row("baseline", 100_000)])  # fmt: skip
    assert [v.changes for v in verdicts] == [[], ["new"]]


def test_pytest_failing_fails_the_check_and_accept_does_not_override_it() -> None:
    rows = [_row("baseline", 100_000)]
    same = gpu_check.compare(rows, rows)
    slower = gpu_check.compare(rows, [_row("baseline", 110_000)])
    assert gpu_check.decide(PASSED, rows, same, accept=False) == (True, True)
    assert gpu_check.decide(FAILED, rows, same, accept=False) == (False, False)
    assert gpu_check.decide(FAILED, rows, same, accept=True) == (False, False)
    assert gpu_check.decide(PASSED, rows, slower, accept=False) == (False, False)
    assert gpu_check.decide(PASSED, rows, slower, accept=True) == (True, True)  # a first run
    oom = [{"name": "baseline", "status": "oom"}]
    assert gpu_check.decide(PASSED, oom, gpu_check.compare(oom, []), accept=True) == (False, False)


def test_pytest_summary_counts() -> None:
    output = "....F.s\nFAILED tests/x.py::t - boom\n1 failed, 25 passed, 1 skipped in 60.12s\n"
    assert gpu_check.pytest_counts(output) == {"failed": 1, "passed": 25, "skipped": 1}
    assert gpu_check.pytest_counts("no tests ran in 0.01s\n") == {}
    assert FAILED.summary() == "1 failed, 25 passed, 1 skipped" and not FAILED.passed


# ---- the command, with the GPU work faked


def test_a_first_run_needs_accept_then_check_json_is_the_reference(
    tmp_path, monkeypatch, capsys
) -> None:
    rows = [_row("baseline", 100_000), _row("custom_op", 102_000), _row("ac", 80_000, peak=6.0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_check, "environment", lambda argv: {"git_commit": "abc123"})
    monkeypatch.setattr(gpu_check, "run_tests", lambda: PASSED)
    monkeypatch.setattr(gpu_check, "run_ladder", lambda scratch: rows)
    check = tmp_path / "nvidia-h100-80gb-hbm3" / "check.json"  # ablate.py's folder for the GPU
    argv = ["--out-dir", str(tmp_path)]

    assert gpu_check.main(argv) == 1 and not check.exists()  # nothing to compare with
    assert "[gpu_check] baseline: NEW" in capsys.readouterr().out
    assert gpu_check.main([*argv, "--accept"]) == 0
    written = json.loads(check.read_text())
    assert written["commit"] == "abc123" and written["environment"] == {"git_commit": "abc123"}
    assert written["pytest"]["counts"] == {"passed": 26, "skipped": 1}
    assert written["rows"] == rows and written["accepted"] == "--accept"

    capsys.readouterr()
    rows[2] = _row("ac", 80_000, peak=6.5)  # +8% memory: a regression, check.json kept
    assert gpu_check.main(argv) == 1
    out = capsys.readouterr().out
    assert "[gpu_check] baseline: ok: " in out and "[gpu_check] ac: MORE MEMORY: " in out
    assert out.rstrip().splitlines()[-1].startswith("[gpu_check] FAIL against ")
    assert json.loads(check.read_text())["rows"][2]["peak_allocated_gib"] == 6.0


def test_without_a_gpu_it_refuses_in_one_line() -> None:
    done = subprocess.run(
        [python(), "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpu_check.py: no CUDA GPU")


# ---- the smoke ladder


def test_the_smoke_ladder_has_three_valid_rows() -> None:
    ladder = ladders.read("smoke")
    plans = ladders.step_plans(ladder)
    assert [p["name"] for p in plans] == ["baseline", "custom_op", "ac"]
    cpu = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    for plan in plans:  # each row composes and plans as train.py would (on a CPU here)
        cfg = make_cfg(*ladder.workload, f"+opt=[{','.join(plan['stages'])}]", *plan["overrides"])
        config.validate(cfg)
        assert sorted(opt.plan(cfg, cpu).stages) == sorted(plan["stages"])
        assert cfg.model.n_layer == 12 and cfg.model.n_embd == 768  # GPT-2 124M
