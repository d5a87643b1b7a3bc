"""scripts/vs_nanogpt.py: what bench.py and our runs print and write is parsed into tokens/s, the
equal-work ratios and the headlines come from interleaved rounds with their intervals, the md
states the batch, biases and math of every comparison, the first-schema json still renders, and
a SIGTERM to the comparison stops the run it waits for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from data.workers import process_alive
from helpers import ROOT, fake_vs_nanogpt_result, vs_nanogpt_config
from measure import vs_nanogpt

BENCH_OUTPUT = """Compiling model...
0/10 loss: 10.9876
9/10 loss: 9.1234
0/20 loss: 9.0000
19/20 loss: 8.0000
time per iteration: 132.4000ms, MFU: 40.21%
"""


def test_bench_py_output_gives_tokens_per_sec() -> None:
    tokens_per_sec = vs_nanogpt.bench_tokens_per_sec(BENCH_OUTPUT, batch=64)
    assert tokens_per_sec == pytest.approx(64 * 1024 / 0.1324)
    assert vs_nanogpt.bench_tokens_per_sec("Compiling model...\nTraceback ...", batch=64) is None


def test_our_tokens_per_sec_is_the_mean_after_burn_in_as_bench_py(tmp_path: Path) -> None:
    windows = [  # the first window holds the compilation: left out
        {"step": 0, "val/loss": 10.9},
        {"step": 10, "perf/tokens_per_sec": 1_000.0, "perf/step_ms": 5_000.0},
        {"step": 20, "perf/tokens_per_sec": 400_000.0, "perf/step_ms": 80.0},
        {"step": 30, "perf/tokens_per_sec": 500_000.0, "perf/step_ms": 64.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows))
    (tmp_path / "summary.json").write_text(json.dumps({"perf/tokens_per_sec": 480_000.0}))
    numbers = vs_nanogpt.ours_tokens_per_sec(tmp_path, warmup_steps=10)
    tokens = 400_000 * 0.080 * 10 + 500_000 * 0.064 * 10  # 10 steps a window
    assert numbers["tokens_per_sec"] == pytest.approx(tokens / (0.080 * 10 + 0.064 * 10))
    assert numbers["tokens_per_sec_median"] == 480_000.0
    empty = vs_nanogpt.ours_tokens_per_sec(tmp_path / "none", warmup_steps=10)  # a run that failed
    assert empty == {"tokens_per_sec": None, "tokens_per_sec_median": None}


def test_only_math_changing_overrides_mark_a_configuration() -> None:
    assert vs_nanogpt.other_math(["opt.bs.batch_size=64", "data.loader=memmap"]) is None
    assert vs_nanogpt.other_math(["opt.amp.residual=compute"]) == "bfloat16 residual stream"
    variants = ["plain", "custom_op", "tuned", "fastest"]
    plans = {c["name"]: c for c in vs_nanogpt.ours_configs([64], variants)}
    assert plans["ours b64 plain"]["math"] is None and plans["ours b64 custom_op"]["math"] is None
    assert plans["ours b64 fastest"]["math"] == "bfloat16 residual stream"
    # Tuning the kernels' launch shapes keeps bench.py's math, on top of custom_op's stages.
    tuned, custom_op = plans["ours b64 tuned"], plans["ours b64 custom_op"]
    assert tuned["math"] is None and tuned["what"] == custom_op["what"]
    assert "opt.compile.coordinate_descent=true" in tuned["argv"]
    assert "opt.compile.coordinate_descent=true" not in custom_op["argv"]
    argv = plans["ours b64 custom_op"]["argv"]
    assert "+opt=[bs,workers,non_blocking,compile,amp,tf32,fused,custom_op]" in argv
    assert argv.index("opt.bs.batch_size=64") > argv.index("opt.bs.batch_size=32")  # last wins
    assert "train.max_steps=30" in argv and "perf.warmup_steps=10" in argv


def test_ratios_pair_rounds_and_headlines_pick_each_side_at_its_best() -> None:
    result = vs_nanogpt.summarize(fake_vs_nanogpt_result())
    configs = {c["name"]: c for c in result["configs"]}
    assert configs["ours b64 plain"]["repeats"] == 2  # the failed round is left out
    assert configs["bench.py b64"]["median"] == 495e3
    assert configs["bench.py b64"]["interval"] == [494e3, 496e3]
    # Only the same batch and biases: both of ours against bench.py b64 with biases.
    assert [(r["ours"], r["nanogpt"]) for r in result["ratios"]] == [
        ("ours b64 plain", "bench.py b64 bias"),
        ("ours b64 fastest", "bench.py b64 bias"),
    ]
    plain = result["ratios"][0]  # per round: 500/472, 488/470 (round 3 failed)
    assert plain["median"] == pytest.approx((500 / 472 + 488 / 470) / 2)
    assert plain["interval"] == pytest.approx([488 / 470, 500 / 472])
    assert plain["within_noise"] is False and plain["repeats"] == 2
    head = result["headline"]
    assert (head["ours"], head["nanogpt"]) == ("ours b64 fastest", "bench.py b64")
    # The median of the per-round ratios 530/495, 528/494, 531/496: drift within a round cancels.
    assert head["median"] == pytest.approx(531 / 496) and head["math"] == "bfloat16 residual stream"
    same = result["headline_same_math"]
    assert (same["ours"], same["nanogpt"], same["math"]) == ("ours b64 plain", "bench.py b64", None)
    assert same["interval"] == pytest.approx([488 / 494, 500 / 495])
    assert same["within_noise"] is True


def test_markdown_states_batch_biases_math_and_noise() -> None:
    result = vs_nanogpt.summarize(fake_vs_nanogpt_result())
    text = vs_nanogpt.headline(result)
    assert "Ours at its best (batch 64, biases, plain + custom_op, other math: bfloat16" in text
    assert "**1.071x (1.069–1.071, 3 rounds)**" in text
    assert "fastest bench.py of the call (batch 64, no biases, bench.py's math: 495.0 K)" in text
    assert "not equal work: biases on ours only; ours changes the math" in text
    assert "Ours with bench.py's math (batch 64, biases, plain, bench.py's math" in text
    assert "2 rounds, within noise)" in text
    # When the fastest of ours keeps bench.py's math, one sentence says so.
    only_same_math = fake_vs_nanogpt_result()
    only_same_math["configs"] = [c for c in only_same_math["configs"] if c["math"] is None]
    once = vs_nanogpt.headline(vs_nanogpt.summarize(only_same_math))
    assert once.count("Ours ") == 1 and "Ours with bench.py's math" not in once
    assert "Ours at its best (batch 64, biases, plain, bench.py's math: 494.0 K tokens/s)" in once
    table = vs_nanogpt.equal_work_table(result)
    assert "| 64 | yes | plain | same (equal work) | 1.049x (1.038–1.059, 2 rounds) |" in table
    assert "| 64 | yes | fastest | other: bfloat16 residual stream |" in table
    md = vs_nanogpt.markdown(result)
    assert "| bench.py b32 | batch 32, no biases, bench.py's math; w | 480,000 |" in md
    assert "| 480,000 | 479,000–481,000 | 3 |" in md


def test_measure_interleaves_rounds_and_stops_before_the_deadline(tmp_path, monkeypatch) -> None:
    bench = tmp_path / "nanogpt"
    bench.mkdir()
    (bench / "bench.py").write_text("")
    monkeypatch.setattr(vs_nanogpt, "ours_configs", lambda batches, variants: [
        {**vs_nanogpt_config(f"ours b{b} {v}", "ours", b, True), "argv": ["python", "train.py"]}
        for b in batches for v in variants
    ])  # fmt: skip
    ran, clock = [], [0.0]

    def run_one(name, argv, bench_dir, run_dir, batch, timeout_s):
        ran.append(name)
        clock[0] += 100.0  # every run takes 100 s
        return {"config": name, "wall_s": 100.0, "tokens_per_sec": 1e5 * (1 + len(ran))}

    monkeypatch.setattr(vs_nanogpt, "run_one", run_one)
    clocked = SimpleNamespace(time=lambda: clock[0], strftime=time.strftime)
    monkeypatch.setattr(vs_nanogpt, "time", clocked)
    out = tmp_path / "vs"
    argv = ["run", "--bench", str(bench), "--batches", "32", "64", "--repeats", "3"]
    monkeypatch.setattr(sys, "argv", ["vs_nanogpt.py", *argv])
    vs_nanogpt.main([*argv, "--ours", "plain", "--deadline-s", "650", "--out", str(out)])
    round_ = ["bench.py b32", "bench.py b32 bias", "ours b32 plain"]
    round_ += ["bench.py b64", "bench.py b64 bias", "ours b64 plain"]
    # Round 1 ends at 600 s; a run takes 100 s: round 2 would pass the deadline (650 s).
    assert ran == round_
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["repeat"] for r in result["runs"]] == [1] * 6
    assert result["order"] == "each round: " + ", ".join(round_)
    assert result["headline"]["ours"] == "ours b64 plain" and out.with_suffix(".md").exists()


def test_run_one_runs_bench_py_from_a_copy_of_its_folder(tmp_path) -> None:
    bench = tmp_path / "nanogpt"
    bench.mkdir()
    (bench / "configurator.py").write_text("MS = 100.0\n")
    (bench / "bench.py").write_text(
        "exec(open('configurator.py').read())\nprint(f'time per iteration: {MS:.4f}ms, MFU: 1%')\n"
    )
    argv = [sys.executable, "bench.py", "--batch_size=8"]
    run = vs_nanogpt.run_one("bench.py b8", argv, bench, tmp_path / "run", batch=8, timeout_s=60)
    assert run["status"] == "ok" and run["tokens_per_sec"] == pytest.approx(8 * 1024 / 0.1)
    assert "time per iteration" in (tmp_path / "run/output.txt").read_text()
    (bench / "bench.py").write_text("raise SystemExit(3)\n")
    failed = vs_nanogpt.run_one("bench.py b8", argv, bench, tmp_path / "r2", batch=8, timeout_s=60)
    assert failed["status"] == "failed" and failed["tokens_per_sec"] is None
    (bench / "bench.py").write_text("raise ValueError('no GPU here')\n")
    failed = vs_nanogpt.run_one("bench.py b8", argv, bench, tmp_path / "r3", batch=8, timeout_s=60)
    assert failed["error"] == "ValueError: no GPU here"


def test_a_sigterm_to_the_comparison_stops_the_run_it_is_waiting_for(tmp_path) -> None:
    # `timeout` signals the comparison's group; the run it waits for is in a session of its own.
    bench = tmp_path / "nanogpt"
    bench.mkdir()
    pid_file = tmp_path / "bench.pid"
    (bench / "bench.py").write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    waiting = (
        "import sys; from pathlib import Path; from measure import vs_nanogpt; "
        f"vs_nanogpt.run_one('b8', [sys.executable, 'bench.py'], Path({str(bench)!r}), "
        f"Path({str(tmp_path / 'run')!r}), batch=8, timeout_s=600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", waiting], cwd=ROOT, start_new_session=True)
    deadline = time.time() + 60
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)  # the pid written
    bench_pid = int(pid_file.read_text())
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert not process_alive(bench_pid), "bench.py outlived the comparison"


@pytest.mark.slow  # a tiny train.py in a subprocess: ~20 s of CPU
def test_run_one_reads_our_runs_tokens_per_sec(tmp_path) -> None:
    from helpers import TINY

    tiny = [o for o in TINY if not o.startswith(("wandb.", "sample."))]
    argv = [sys.executable, "train.py", *tiny, *vs_nanogpt.OURS_RUN, "train.eval_sequences=4"]
    run = vs_nanogpt.run_one("ours tiny", argv, None, tmp_path / "run", batch=4, timeout_s=240)
    assert run["status"] == "ok", run.get("error")
    assert run["tokens_per_sec"] > 0 and run["tokens_per_sec_median"] > 0
    assert (tmp_path / "run/summary.json").exists()  # the run folder is the one given
