"""scripts/quality.py with seeds: each arm run with N seeds, interleaved; the spread of
the final validation loss per arm; Welch's t-test (or a seeded bootstrap without scipy) of the
difference, its 95% interval, and the verdict against the tolerance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import ROOT, python
from measure import quality, stats
from recipe.rundir import RunFolder

REFERENCE = [5.081, 5.090, 5.074, 5.086]
SHIFTED = [5.121, 5.133, 5.117, 5.128]  # about 0.04 nats worse
CLOSE = [5.083, 5.089, 5.079, 5.085]


def _fake_runs(monkeypatch, finals: dict[str, list[float]]) -> list[tuple[str, int]]:
    """quality.run replaced by one that returns `finals`, recording the order of the runs."""
    order: list[tuple[str, int]] = []

    def fake(name, stages, seed, args, gpu):
        i = seed - quality.FIRST_SEED
        order.append((name, i))
        final = finals[name][i]
        curve = {0: 10.9, 2: final + 1.0, 4: final}
        return {"seed": seed, "command": f"python train.py {stages} train.seed={seed}",
                "val_loss": curve, "tokens_per_sec": 1000.0}  # fmt: skip

    monkeypatch.setattr(quality, "run", fake)
    monkeypatch.setattr(quality, "environment", lambda command: {"command": " ".join(command)})
    return order


def _take_run_folder(command: list[str]) -> Path:
    """What train.py does first with its hydra.run.dir: takes it, refusing one that holds files
    that are not a run's."""
    run_dir = Path(next(w for w in command if w.startswith("hydra.run.dir=")).split("=", 1)[1])
    RunFolder(run_dir, resume=False)
    return run_dir


def _main(tmp_path, *argv: str) -> tuple[dict, object]:
    with pytest.raises(SystemExit) as exit_:
        quality.main(["--out", str(tmp_path / "q"), *argv])
    return json.loads((tmp_path / "q.json").read_text()), exit_.value.code


def test_arms_run_interleaved_seed_by_seed(tmp_path, monkeypatch) -> None:
    order = _fake_runs(monkeypatch, {"reference": REFERENCE, "candidate": CLOSE})
    result, _ = _main(tmp_path, "--seeds", "3")
    assert order == [("reference", 0), ("candidate", 0), ("reference", 1), ("candidate", 1),
                     ("reference", 2), ("candidate", 2)]  # fmt: skip
    assert result["seeds"] == [1337, 1338, 1339]
    assert [r["seed"] for r in result["runs"]["candidate"]] == [1337, 1338, 1339]


def test_spread_and_welch_test_match_an_independent_computation(tmp_path, monkeypatch) -> None:
    stats = pytest.importorskip("scipy.stats")
    _fake_runs(monkeypatch, {"reference": REFERENCE, "candidate": SHIFTED})
    result, code = _main(tmp_path, "--seeds", "4")
    a, b = np.array(REFERENCE), np.array(SHIFTED)
    spread = result["spread"]["candidate"]
    assert spread["mean"] == pytest.approx(b.mean()) and spread["std"] == pytest.approx(
        b.std(ddof=1)
    )
    assert (spread["min"], spread["max"]) == (b.min(), b.max())
    # Welch by hand: the difference over its standard error, Welch–Satterthwaite's degrees.
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se, delta = np.sqrt(va + vb), b.mean() - a.mean()
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    p = 2 * stats.t.sf(abs(delta / se), df)
    half = stats.t.ppf(0.975, df) * se
    diff = result["difference"]
    assert diff["test"] == "welch" and diff["delta"] == pytest.approx(delta)
    assert diff["p"] == pytest.approx(p) and diff["df"] == pytest.approx(df)
    assert diff["interval"] == pytest.approx([delta - half, delta + half])
    assert result["status"] == "different" and code == 1  # 0.04 nats: beyond the tolerance
    assert result["verdict"] == (
        f"different: Δ=+{delta:.4f} nats, p={p:.3g} (beyond the tolerance 0.02)"
    )


def test_without_scipy_a_seeded_bootstrap_tests_the_difference(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "scipy", None)  # `from scipy import stats` fails
    shifted = stats.difference_of_means(REFERENCE, SHIFTED)
    same = stats.difference_of_means(REFERENCE, CLOSE)
    assert shifted["test"] == same["test"] == "bootstrap"
    assert shifted == stats.difference_of_means(REFERENCE, SHIFTED)  # seeded: the same each time
    low, high = shifted["interval"]
    assert 0 < low < shifted["delta"] < high and shifted["p"] < 0.01
    low, high = same["interval"]
    assert low < 0 < high and same["p"] > 0.2


@pytest.mark.parametrize(
    ("delta", "p", "status", "sentence", "passed"),
    [
        (0.004, 0.41, "same", "same within 0.02 nats (p=0.41, Δ=+0.0040)", True),
        (0.031, 0.004, "different", "different: Δ=+0.0310 nats, p=0.004 (beyond the "
         "tolerance 0.02)", False),
        (-0.008, 0.003, "different", "different: Δ=-0.0080 nats, p=0.003 (within the "
         "tolerance 0.02)", True),
        (-0.0254, 0.0115, "better", "better: Δ=-0.0254 nats, p=0.0115 (lower loss)", True),
        (-0.031, 0.2, "inconclusive", "inconclusive: Δ=-0.0310 nats, p=0.2: more seeds would "
         "tell", False),
        (0.025, 0.2, "inconclusive", "inconclusive: Δ=+0.0250 nats, p=0.2: more seeds would "
         "tell", False),
        (0.009, None, "one seed", "Δ=+0.0090 nats, one seed (no test): within 0.02", True),
    ],
)  # fmt: skip
def test_verdict_wording(delta, p, status, sentence, passed) -> None:
    assert quality.verdict({"delta": delta, "p": p}, 0.02, 0.05) == (status, sentence, passed)


def test_the_report_shows_spread_interval_and_verdict(tmp_path, monkeypatch) -> None:
    _fake_runs(monkeypatch, {"reference": REFERENCE, "candidate": CLOSE})
    result, code = _main(tmp_path, "--seeds", "4")
    assert result["status"] == "same" and code == 0
    md = (tmp_path / "q.md").read_text()
    assert "| reference | 5.0810, 5.0900, 5.0740, 5.0860 | 5.0827 ± 0.0069 |" in md
    assert "95% interval [" in md and f"**{result['verdict']}**" in md
    assert "reaches past" not in md  # its interval is within the tolerance
    assert (tmp_path / "q.png").exists()


def test_a_same_verdict_whose_interval_reaches_past_the_tolerance_says_so(
    tmp_path, monkeypatch
) -> None:
    """Close means but spread seeds: no difference found, yet the seeds cannot bound one."""
    _fake_runs(monkeypatch, {"reference": REFERENCE, "candidate": [5.04, 5.13, 5.06, 5.11]})
    result, code = _main(tmp_path, "--seeds", "4")
    low, high = result["difference"]["interval"]
    assert result["status"] == "same" and code == 0 and max(-low, high) > 0.02
    md = (tmp_path / "q.md").read_text()
    assert (f"The 95% interval reaches past ±0.02 nats: 4 seeds per arm cannot rule out a "
            f"difference of up to {max(-low, high):.4f} nats") in md  # fmt: skip


def test_the_workload_names_the_overrides_every_run_got(tmp_path, monkeypatch) -> None:
    _fake_runs(monkeypatch, {"reference": REFERENCE, "candidate": CLOSE})
    result, _ = _main(tmp_path, "--seeds", "2", "model=gpt2-xl", "train.lr=2.0e-4")
    assert result["workload"] == quality.WORKLOAD + " model=gpt2-xl train.lr=2.0e-4"
    assert f"Workload `{result['workload']}`" in (tmp_path / "q.md").read_text()


def test_a_one_seed_report_of_before_still_renders(tmp_path) -> None:
    old = json.loads((ROOT / "docs/results/nvidia-h100-80gb-hbm3/quality.json").read_text())
    (tmp_path / "old.json").write_text(json.dumps(old))
    quality.main(["--report", str(tmp_path / "old.json")])
    md = (tmp_path / "old.md").read_text()
    assert "- candidate: `+opt=[compile,amp,fused,tf32,custom_op] opt.amp.residual=compute`" in md
    assert "**Δ=+0.0091 nats, one seed (no test): within 0.02**" in md


@pytest.mark.slow
def test_a_real_run_of_two_seeds_and_two_arms(tmp_path) -> None:
    tiny = ["model=tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
            "model.block_size=32", "train.batch_size=2", "train.max_steps=2",
            "train.eval_interval=2", "train.eval_sequences=4", "device=cpu",
            "wandb.mode=disabled"]  # fmt: skip
    out = subprocess.run(
        [python(), "scripts/quality.py", "--out", str(tmp_path / "q"), "--seeds", "2",
         "--runs-dir", str(tmp_path / "runs"), "--reference", "+opt=[amp]",
         "--candidate", "+opt=[amp] opt.amp.residual=compute", *tiny],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    result = json.loads((tmp_path / "q.json").read_text())
    names = [f"{arm}-seed{seed}" for arm in ("candidate", "reference") for seed in (1337, 1338)]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == names
    assert [list(r["val_loss"]) for r in result["runs"]["reference"]] == [["0", "2"]] * 2
    assert result["difference"]["p"] is not None and out.returncode == (not result["passed"])


def test_several_candidates_share_one_reference(tmp_path, monkeypatch) -> None:
    """Two --out/--candidate pairs: the reference runs once per seed, interleaved with both, and
    each candidate gets its own report against those same reference runs."""
    finals = {"reference": REFERENCE, "q_close": CLOSE, "q_shifted": SHIFTED}
    order = _fake_runs(monkeypatch, finals)
    with pytest.raises(SystemExit) as exit_:
        quality.main(["--seeds", "2", "--out", str(tmp_path / "q_close"), "--candidate", "+a",
                      "--out", str(tmp_path / "q_shifted"), "--candidate", "+b"])  # fmt: skip
    assert order == [("reference", 0), ("q_close", 0), ("q_shifted", 0),
                     ("reference", 1), ("q_close", 1), ("q_shifted", 1)]  # fmt: skip
    report = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("q_close", "q_shifted"))
    close, shifted = report
    assert close["runs"]["reference"] == shifted["runs"]["reference"]
    assert close["arms"] == {"reference": quality.REFERENCE, "candidate": "+a"}
    assert close["final"]["candidate"] == CLOSE[:2] and shifted["final"]["candidate"] == SHIFTED[:2]
    assert close["title"] == "`+a` against plain bfloat16"
    assert (tmp_path / "q_shifted.md").exists() and (tmp_path / "q_close.png").exists()
    assert exit_.value.code == (not (close["passed"] and shifted["passed"]))


@pytest.mark.parametrize(
    "argv",
    [["--out", "a", "--out", "b", "--candidate", "+x"],  # a candidate missing
     ["--out", "a", "--candidate", "+x", "--out", "b", "--candidate", "+y", "--title", "t"],
     ["--out", "d/a", "--candidate", "+x", "--out", "e/a", "--candidate", "+y"]],  # same names
)  # fmt: skip
def test_unpaired_or_clashing_candidates_are_refused(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        quality.parse_args(argv)
    assert exit_.value.code == 2 and "--out" in capsys.readouterr().err


def test_a_call_cut_off_goes_on_where_it_stopped(tmp_path, monkeypatch) -> None:
    """Finished runs (their marker written after train.py returned) are read again, not rerun;
    a run cut off before its marker starts afresh; a finished run of another command is refused."""
    launched: list[str] = []

    def fake_train(command, cwd, check, env):  # train.py run alone (--jobs 1): its output shown
        run_dir = Path(next(w for w in command if w.startswith("hydra.run.dir=")).split("=", 1)[1])
        assert not run_dir.exists()  # a cut-off run's leftovers were cleared
        run_dir.mkdir(parents=True)
        launched.append(run_dir.name)
        (run_dir / "metrics.jsonl").write_text('{"step": 4, "val/loss": 5.0}\n')
        (run_dir / "summary.json").write_text('{"perf/tokens_per_sec": 1.0}')

    monkeypatch.setattr(quality.subprocess, "run", fake_train)
    args = quality.parse_args(["--out", "q", "--runs-dir", str(tmp_path)])
    quality.run("reference", "+opt=[amp]", 1337, args)
    (tmp_path / "candidate-seed1337").mkdir()  # cut off: metrics, no marker
    (tmp_path / "candidate-seed1337" / "metrics.jsonl").write_text('{"step": 2}\n')
    quality.run("candidate", "+opt=[amp]", 1337, args)
    again = quality.run("reference", "+opt=[amp]", 1337, args)
    assert launched == ["reference-seed1337", "candidate-seed1337"]
    assert again["val_loss"] == {4: 5.0}
    with pytest.raises(SystemExit, match="another command"):
        quality.run("reference", "+opt=[fused]", 1337, args)


def test_jobs_train_several_runs_at_a_time_in_order_each_result_to_its_seed(
    tmp_path, monkeypatch
) -> None:
    """--jobs 3: runs start in the interleaved order, at most 3 at once (more than one really
    is), finish out of order, and each result still lands on its arm and seed; the report says
    the runs shared the GPU and shows no speeds."""
    import threading
    import time

    started: list[tuple[str, int]] = []
    running, most = [0], [0]
    lock = threading.Lock()

    def fake(name, stages, seed, args, gpu):
        assert gpu is None  # no GPU here: every run sees what the process sees
        with lock:
            started.append((name, seed))
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05 * (1 + (seed + len(name)) % 3))  # unequal: they end out of order
        with lock:
            running[0] -= 1
        final = {"reference": REFERENCE, "candidate": SHIFTED}[name][seed - quality.FIRST_SEED]
        return {"seed": seed, "command": f"python train.py {stages} train.seed={seed}",
                "val_loss": {0: 10.9, 4: final}, "tokens_per_sec": 1000.0}  # fmt: skip

    monkeypatch.setattr(quality, "run", fake)
    monkeypatch.setattr(quality, "environment", lambda command: {"command": " ".join(command)})
    result, _ = _main(tmp_path, "--seeds", "4", "--jobs", "3")
    seeds = [1337 + i for i in range(4)]
    assert started[:3] == [("reference", 1337), ("candidate", 1337), ("reference", 1338)]
    assert 1 < most[0] <= 3
    assert [r["seed"] for r in result["runs"]["candidate"]] == seeds
    assert result["final"] == {"reference": REFERENCE, "candidate": SHIFTED}
    md = (tmp_path / "q.md").read_text()
    assert result["jobs"] == 3 and "3 runs at a time on one GPU, so no speeds." in md
    assert "| 1,000 |" not in md


def test_jobs_spread_over_the_gpus_each_run_alone_on_its_own(tmp_path, monkeypatch) -> None:
    """--jobs 2 on a host of 2 GPUs: the two runs at a time train on different GPUs (train.py
    started with CUDA_VISIBLE_DEVICES naming one), and the report says where they ran."""
    import threading
    import time

    running: dict[str, int] = {}
    shared_a_gpu = []
    lock = threading.Lock()

    def fake_train(command, cwd, stdout, stderr, env):
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            running[gpu] = running.get(gpu, 0) + 1
            shared_a_gpu.append(running[gpu] > 1)
        time.sleep(0.05)
        with lock:
            running[gpu] -= 1
        run_dir = _take_run_folder(command)
        seed = int(next(w for w in command if w.startswith("train.seed=")).split("=", 1)[1])
        (run_dir / "metrics.jsonl").write_text(
            json.dumps({"step": 4, "val/loss": 5.0 + (seed - quality.FIRST_SEED) / 100}) + "\n"
        )
        (run_dir / "summary.json").write_text('{"perf/tokens_per_sec": 1.0}')
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(quality.subprocess, "run", fake_train)
    monkeypatch.setattr(quality.runner, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr(quality, "environment", lambda command: {"command": " ".join(command)})
    result, _ = _main(tmp_path, "--seeds", "3", "--jobs", "2", "--runs-dir", str(tmp_path / "r"))
    assert len(shared_a_gpu) == 6 and not any(shared_a_gpu)
    assert result["gpus"] == 2
    assert "2 runs at a time over 2 GPUs, so no speeds." in (tmp_path / "q.md").read_text()
    assert quality.gpu_slots(3, ["0", "1"]) == ["0", "1", "0"]  # more jobs than GPUs: they share
    assert quality.gpu_slots(1, ["0", "1"]) == [None] and quality.gpu_slots(2, []) == [None, None]


def test_a_shared_run_that_fails_shows_its_log_and_starts_no_other(tmp_path, monkeypatch, capsys):
    """Beside others, train.py's output goes to `<run folder>.log` beside the run's folder (the
    trainer takes only a folder that holds nothing else); a failure prints its end and raises,
    and the runs not yet started are cancelled."""
    launched: list[str] = []

    def fake_train(command, cwd, stdout, stderr, env):
        run_dir = _take_run_folder(command)
        launched.append(run_dir.name)
        stdout.write("loading\nTraceback: CUDA out of memory\n")
        stdout.flush()
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(quality.subprocess, "run", fake_train)
    args = quality.parse_args(["--out", "q", "--runs-dir", str(tmp_path), "--seeds", "3",
                               "--jobs", "2"])  # fmt: skip
    with pytest.raises(subprocess.CalledProcessError):
        quality.run_interleaved(
            {"reference": "+opt=[amp]", "candidate": "+x"}, [1337, 1338, 1339], args, [None, None]
        )
    assert "CUDA out of memory" in capsys.readouterr().err
    assert "CUDA out of memory" in (tmp_path / f"{launched[0]}.log").read_text()
    assert len(launched) <= 2  # those started before the failure: no other


def test_jobs_below_one_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        quality.parse_args(["--out", "q", "--jobs", "0"])
    assert exit_.value.code == 2 and "--jobs 0" in capsys.readouterr().err


def _edited(report: str, *keys: str | int, to: object = ...) -> str:
    """A shipped report's JSON with one nested key (`keys`: its path) set `to` a value, or
    removed."""
    result = json.loads((ROOT / "docs/results/nvidia-h100-80gb-hbm3" / report).read_text())
    *path, last = keys
    inner = result
    for key in path:
        inner = inner[key]
    if to is ...:
        del inner[last]
    else:
        inner[last] = to
    return json.dumps(result)


@pytest.mark.parametrize(
    ("content", "line"),
    [
        ('{"runs": {"reference', r"not JSON \(Unterminated string"),
        ("[5.08, 5.09]", r"the file is not an object"),
        (
            _edited("quality.json", "runs", "candidate", "command"),
            r"runs.candidate has no .command.",
        ),
        (_edited("quality_lowbit.json", "spread", "candidate"), r"spread has no 'candidate'"),
        (
            _edited("quality_lowbit.json", "runs", "reference", 0, "val_loss", "300", to="5.1"),
            r"runs.reference\[0\].val_loss.300 is not a number",
        ),
    ],
    ids=["not JSON", "not an object", "a run without command", "a spread missing", "a text loss"],
)
def test_a_malformed_report_is_refused_in_one_line(tmp_path, content, line) -> None:
    """`--report` of a file that is not a report quality.py wrote: one line naming the file and
    what is wrong, exit 2, and nothing written beside it."""
    import os
    import re

    report = tmp_path / "q.json"
    report.write_text(content)
    done = subprocess.run(
        [python(), "scripts/quality.py", "--report", str(report)], cwd=ROOT, capture_output=True,
        text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (said,) = done.stderr.strip().splitlines()
    assert re.match(rf"^quality.py: error: {report}: {line}.*; give a .json that", said), said
    assert not report.with_suffix(".md").exists() and not report.with_suffix(".png").exists()
