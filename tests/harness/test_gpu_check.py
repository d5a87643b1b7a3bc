"""scripts/gpu_check.py on a CPU: its verdicts on fake rows and a fake pytest run, the check.json
it writes and reads back, the parts it runs in and assembles (and each assembly it refuses), the
node ids it reads from a real pytest run's junit file, the smoke ladder's rows as valid configs,
and its one-line refusal without a GPU."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
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


@pytest.mark.parametrize("part", [[], ["--part", "tests"], ["--part", "ladder"]])
def test_without_a_gpu_it_refuses_in_one_line(part: list[str]) -> None:
    done = subprocess.run(
        [python(), "scripts/gpu_check.py", *part], cwd=ROOT, capture_output=True, text=True,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpu_check.py: no CUDA GPU")


# ---- the check in parts, with the GPU work faked

GPU = "nvidia-h100-80gb-hbm3"
FLOAT8 = ["tests/unit/test_float8.py::test_a", "tests/unit/test_float8.py::test_b[rowwise]"]
DIST = ["tests/distributed/test_tp.py::TestTp::test_c", "tests/distributed/test_pp.py::test_d"]
ROWS = [_row("baseline", 100_000), _row("custom_op", 102_000), _row("ac", 80_000, peak=6.0)]
WHEN = "the date the part ran"  # environment()'s date, carried into the assembled parts


def _tests(outcomes: dict[str, str]) -> gpu_check.PytestRun:
    """A fake `pytest -m gpu` run with these outcomes, failing when one failed."""
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    failed = any(o not in gpu_check.COVERED for o in outcomes.values())
    return gpu_check.PytestRun(int(failed), counts, "python -m pytest -m gpu ...", outcomes)


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A faked GPU that runs parts into tmp_path: `gpu(...)` runs one and returns its exit code.
    The GPU tests collected here are FLOAT8 and DIST."""
    monkeypatch.setattr(gpu_check, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_check, "collected_ids", lambda: [*FLOAT8, *DIST])
    state: dict[str, Any] = {"commit": "abc123", "outcomes": {}}
    monkeypatch.setattr(
        gpu_check, "environment",
        lambda argv: {"command": " ".join(argv), "git_commit": state["commit"],
                      "date": WHEN},
    )  # fmt: skip
    monkeypatch.setattr(gpu_check, "run_tests", lambda paths=(): _tests(state["outcomes"]))
    monkeypatch.setattr(gpu_check, "run_ladder", lambda scratch: ROWS)

    def run(*argv: str, outcomes: dict[str, str] | None = None, commit: str = "abc123") -> int:
        state["outcomes"], state["commit"] = outcomes or {}, commit
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return gpu_check.main([*argv, "--out-dir", str(tmp_path)])

    return run


def _assemble(tmp_path, monkeypatch, *more: str) -> int:
    """--assemble on a machine without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return gpu_check.main(["--assemble", "--gpu", GPU, "--out-dir", str(tmp_path), *more])


def _refusal(tmp_path, monkeypatch, capsys) -> str:
    """The one line an assembly refuses with; it must write and delete nothing."""
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit:
        _assemble(tmp_path, monkeypatch, "--accept")
    assert sorted(tmp_path.rglob("*")) == before and not (tmp_path / GPU / "check.json").exists()
    message = str(exit.value.code)
    assert message.startswith("gpu_check.py: cannot assemble: ") and "\n" not in message
    return message


def test_parts_assemble_into_check_json_and_are_deleted(gpu, tmp_path, monkeypatch, capsys) -> None:
    passed = dict.fromkeys(FLOAT8, "passed")
    assert gpu("--part", "tests", "tests/unit/test_float8.py", outcomes=passed) == 0
    one_skipped = {DIST[0]: "passed", DIST[1]: "skipped"}
    assert gpu("--part", "tests", "tests/distributed", outcomes=one_skipped) == 0
    assert gpu("--part", "ladder") == 0
    parts = tmp_path / GPU / "check_parts"
    names = sorted(p.name for p in parts.iterdir())
    assert names[0] == "ladder.json" and len(names) == 3
    assert all(n.startswith("tests-") for n in names[1:])  # one file per set of paths
    first = json.loads((parts / names[1]).read_text())
    assert first["kind"] == "tests" and first["commit"] == "abc123" and first["returncode"] == 0
    assert gpu("--part", "tests", "tests/unit/test_float8.py", outcomes=passed) == 0
    assert len(list(parts.iterdir())) == 3  # the same paths again replace their part

    capsys.readouterr()
    assert _assemble(tmp_path, monkeypatch) == 1  # no accepted rows yet: nothing written
    assert "[gpu_check] baseline: NEW" in capsys.readouterr().out
    assert len(list(parts.iterdir())) == 3  # kept for an assembly with --accept
    assert _assemble(tmp_path, monkeypatch, "--accept") == 0
    assert not parts.exists()
    written = json.loads((tmp_path / GPU / "check.json").read_text())
    assert written["commit"] == "abc123" and written["rows"] == ROWS
    assert written["pytest"]["counts"] == {"passed": 3, "skipped": 1}
    assert [p["kind"] for p in written["parts"]] == ["tests", "tests", "ladder"]
    paths = sorted(p["paths"] for p in written["parts"][:2])
    assert paths == [["tests/distributed"], ["tests/unit/test_float8.py"]]
    assert written["parts"][0]["date"] == WHEN
    ladder = written["parts"][2]
    assert ladder["command"].startswith("python scripts/gpu_check.py --part ladder --out-dir ")

    # The next assembly is judged against that check.json, as the one command is.
    gpu("--part", "tests", outcomes=dict.fromkeys([*FLOAT8, *DIST], "passed"))
    gpu("--part", "ladder")
    capsys.readouterr()
    assert _assemble(tmp_path, monkeypatch) == 0
    out = capsys.readouterr().out
    assert "[gpu_check] baseline: ok: " in out and "[gpu_check] PASS against " in out


def test_an_assembly_refuses_parts_that_do_not_make_one_check(
    gpu, tmp_path, monkeypatch, capsys
) -> None:
    everything = dict.fromkeys([*FLOAT8, *DIST], "passed")
    gpu("--part", "tests", "tests/unit", outcomes=dict.fromkeys(FLOAT8, "passed"))
    assert "no ladder part" in _refusal(tmp_path, monkeypatch, capsys)
    gpu("--part", "ladder", commit="def456")
    assert "from different commits" in _refusal(tmp_path, monkeypatch, capsys)
    gpu("--part", "ladder", commit="abc123 (with uncommitted changes)")
    assert "uncommitted changes: ladder.json" in _refusal(tmp_path, monkeypatch, capsys)
    gpu("--part", "ladder")
    message = _refusal(tmp_path, monkeypatch, capsys)  # the tests in tests/distributed: in none
    assert f"2 of the 4 GPU tests collected here are in no part: {DIST[0]}, {DIST[1]}" in message
    failed = {**everything, DIST[1]: "failed"}
    assert gpu("--part", "tests", "tests/distributed", outcomes=failed) == 1
    assert "failed (pytest exit 1: 3 passed, 1 failed)" in _refusal(tmp_path, monkeypatch, capsys)
    assert gpu("--part", "tests", "tests/distributed", outcomes=everything) == 0
    assert _assemble(tmp_path, monkeypatch, "--accept") == 0


def test_an_assembly_names_the_gpu_folders_there_and_needs_parts(tmp_path, monkeypatch) -> None:
    (tmp_path / "nvidia-h200").mkdir()
    with pytest.raises(SystemExit) as exit:
        _assemble(tmp_path, monkeypatch)
    assert str(exit.value.code).endswith(f"no {tmp_path / GPU}: the GPU folders in {tmp_path} "
                                         "are nvidia-h200")  # fmt: skip
    (tmp_path / GPU).mkdir()
    with pytest.raises(SystemExit) as exit:
        _assemble(tmp_path, monkeypatch)
    assert f"no parts in {tmp_path / GPU / 'check_parts'}: " in str(exit.value.code)
    with pytest.raises(SystemExit):  # argparse: --assemble needs --gpu, a part refuses --accept
        gpu_check.main(["--assemble"])
    with pytest.raises(SystemExit):
        gpu_check.main(["--part", "ladder", "--accept"])


def test_junit_outcomes_are_pytests_collected_node_ids(tmp_path) -> None:
    """A real pytest run of a tiny suite: classes, parameters with dots and slashes, a skip, a
    failure, a fixture error, and a test without the gpu mark that neither lists."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: on a GPU\n")
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "sub" / "test_tiny.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "class TestOuter:\n"
        "    def test_a(self): pass\n"
        "    @pytest.mark.parametrize('x', [1, 'a.b', 'c/d', 'e::f'])\n"
        "    def test_p(self, x): pass\n"
        "    class TestInner:\n"
        "        def test_b(self): pytest.skip('not here')\n"
        "@pytest.mark.parametrize('y', [0.5, 'z'])\n"
        "def test_top(y): assert y != 'z'\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError\n"
        "def test_error(broken): pass\n"
    )
    (tmp_path / "tests" / "test_plain.py").write_text("def test_cpu(): pass\n")
    run = gpu_check.run_tests(["tests"], root=tmp_path)
    collected = gpu_check.collected_ids(root=tmp_path)
    assert len(collected) == 9 and sorted(run.outcomes) == sorted(collected)
    assert run.returncode == 1 and run.counts == {"failed": 1, "passed": 6, "skipped": 1,
                                                  "deselected": 1, "error": 1}  # fmt: skip
    tiny = "tests/sub/test_tiny.py"
    assert run.outcomes[f"{tiny}::TestOuter::test_p[e::f]"] == "passed"
    assert run.outcomes[f"{tiny}::TestOuter::TestInner::test_b"] == "skipped"
    assert run.outcomes[f"{tiny}::test_top[z]"] == "failed"
    assert run.outcomes[f"{tiny}::test_error"] == "error"


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
