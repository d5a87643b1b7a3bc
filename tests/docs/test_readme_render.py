"""README.md's measured numbers are rendered from docs/results/*/*.json by
scripts/render_readme.py, never copied: a number edited by hand (or a results file updated
without re-rendering) turns this test red, and rows measured with repeats show their interval,
repeats and noise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ROOT, fake_vs_nanogpt_result
from measure import ladders, render_readme

README = ROOT / "README.md"


def test_readme_equals_a_fresh_render_of_the_results() -> None:
    text = README.read_text()
    kinds = {m["kind"] for m in render_readme.MARKER.finditer(text)}
    assert kinds == set(render_readme.KINDS)  # every kind of table is in the README
    assert render_readme.render(text) == text, "run: python scripts/render_readme.py"


def test_a_number_edited_by_hand_fails_the_check(tmp_path: Path, capsys) -> None:
    edited = README.read_text().replace("| 531,685 |", "| 541,685 |")
    assert edited != README.read_text()
    (tmp_path / "README.md").write_text(edited)
    (tmp_path / "docs").symlink_to(ROOT / "docs")
    assert render_readme.main(["--check", "--readme", str(tmp_path / "README.md")]) == 1
    out = capsys.readouterr().out
    bs64 = "| `bs64`: batch 32 -> 64: the optimizer step and the launches amortised"
    assert f"-{bs64}" in out and "| 541,685 |" in out and "| 531,685 |" in out
    assert render_readme.main(["--readme", str(tmp_path / "README.md")]) == 0  # re-rendered
    assert (tmp_path / "README.md").read_text() == README.read_text()


def _caption(ladder: str, name: str) -> str:
    """A row's caption: its step's `what` in the ladder's yaml, the one place it is written."""
    (step,) = [p for p in ladders.step_plans(ladders.read(ladder)) if p["name"] == name]
    return f"`{name}`: {step['what']}"


def _results(tmp_path: Path, name: str, steps: list[dict]) -> str:
    path = tmp_path / "docs/results/gpu" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": {}, "steps": steps}))
    return str(path.relative_to(tmp_path))


def _marked(kind: str, path: str) -> str:
    return f"before <!-- results:{kind} {path} -->stale<!-- /results:{kind} --> after"


def test_repeats_interval_and_noise_are_shown_and_missing_fields_are_dashes(tmp_path) -> None:
    base = {"status": "ok", "git_commit": "a", "peak_allocated_gib": 15.0}
    steps: list[dict] = [
        {**base, "name": "memmap", "tokens_per_sec": 478_000.0},  # an old row: no repeats
        {**base, "name": "custom_op", "tokens_per_sec": 482_000.0, "repeats": 3,
         "interval": [480_100.0, 483_900.0], "within_noise": True, "ratio": 1.0084,
         "ratio_vs": "memmap", "ratio_interval": [0.998, 1.012]},
        {**base, "name": "residual_bf16", "tokens_per_sec": 512_000.0, "repeats": 3,
         "interval": [510_000.0, 514_000.0], "within_noise": False, "git_commit": "b"},
        {"name": "bs64", "status": "oom", "git_commit": "b"},  # no numbers at all
        {**base, "name": "not_in_the_readme", "tokens_per_sec": 1.0},
    ]  # fmt: skip
    path = _results(tmp_path, "speed.json", steps)
    rows = render_readme.render(_marked("speed", path), tmp_path).split("\n")
    assert rows[0] == f"before <!-- results:speed {path} -->" and rows[-1].endswith(" after")
    assert f"| {_caption('speed', 'memmap')} | 478,000 | — | — | — | 15.0 |" in rows
    custom_op = _caption("speed", "custom_op")
    # The harness's ratio, run by run against its neighbour: three decimals and its verdict.
    assert f"| {custom_op} | 482,000 | 480,100–483,900 | 3 | 1.008x (within noise) | 15.0 |" in rows
    # Another commit: another call, perhaps another machine; the ratio says so.
    bf16 = "| 512,000 | 510,000–514,000 | 3 | 1.06x (vs another call) | 15.0 |"
    assert any(row.endswith(bf16) for row in rows)
    assert f"| {_caption('speed', 'bs64')} | — | — | — | — | — |" in rows
    assert not any("not_in_the_readme" in r or "| 1 |" in r for r in rows)


def test_scaling_shows_every_row_with_its_gpus_efficiency_or_status(tmp_path: Path) -> None:
    base = {"status": "ok", "peak_allocated_gib": 15.0}
    steps = [
        {**base, "name": "one_gpu", "what": "1 GPU", "tokens_per_sec": 100_000.0, "repeats": 3,
         "interval": [99_000.0, 101_000.0], "efficiency": 1.0},
        {**base, "name": "two_nodes", "what": "2 x 1", "gpus": 2, "nnodes": 2,
         "tokens_per_sec": 188_000.0, "repeats": 1, "interval": [188_000.0, 188_000.0],
         "efficiency": 0.94},
        {"name": "xl_pp2", "what": "a pipeline", "status": "failed", "gpus": 2},
    ]  # fmt: skip
    path = _results(tmp_path, "scaling.json", steps)
    lines = render_readme.render(_marked("scaling", path), tmp_path).split("\n")
    one_gpu, two_nodes = _caption("scaling", "one_gpu"), _caption("scaling", "two_nodes")
    assert f"| {one_gpu} | 1 | 100,000 | 99,000–101,000 | 3 | 1.000 | 15.00 |" in lines
    # One run: no interval (its only number twice); two "machines" of one GPU each.
    assert f"| {two_nodes} | 2 x 1 | 188,000 | — | 1 | 0.940 | 15.00 |" in lines
    xl_pp2 = _caption("scaling", "xl_pp2")
    assert f"| {xl_pp2} | 2 | — | — | — | failed | — |" in lines


def test_memory_xl_is_relative_to_ac_and_marks_the_target(tmp_path: Path) -> None:
    base = {"status": "ok", "git_commit": "a", "peak_reserved_gib": 16.0}
    steps = [
        {**base, "name": "ac", "tokens_per_sec": 30_000.0, "peak_allocated_gib": 33.0},
        {**base, "name": "lowbit", "tokens_per_sec": 21_000.0, "peak_allocated_gib": 15.1,
         "repeats": 3, "interval": {"low": 15_000.0, "high": 22_000.0}, "within_noise": False},
    ]  # fmt: skip
    path = _results(tmp_path, "memory_xl.json", steps)
    text = render_readme.render(_marked("memory_xl", path) + _marked("xl_target", path), tmp_path)
    lowbit = _caption("memory_xl", "lowbit")
    assert f"| {lowbit} | **15.10 GiB** | 21,000 | 15,000–22,000 | 3 | **0.70x** |" in text
    target = "-->15.10 GiB at 0.70x of the checkpointed bf16 run measured beside it (target: "
    assert target + "≤ 20 GiB at ≥ 0.6x), 16.00 GiB reserved<!-- /results:xl_target -->" in text


def test_a_ratio_to_the_reference_carries_that_comparisons_noise_verdict(tmp_path) -> None:
    # cap14 is within noise of the row above it (cap22), not of `ac`: the column against `ac`
    # must not borrow the vs-prev verdict; cap22 is within noise of `ac`.
    base = {"status": "ok", "git_commit": "a", "peak_reserved_gib": 16.0, "repeats": 3,
            "peak_allocated_gib": 15.0, "call": "1"}  # fmt: skip
    steps = [
        {**base, "name": "ac", "tokens_per_sec": 33_000.0},
        {**base, "name": "cap22", "tokens_per_sec": 32_990.0, "ratio_ref": 0.9997,
         "ratio_ref_vs": "ac", "ratio_ref_interval": [0.993, 1.0009], "within_noise_ref": True},
        {**base, "name": "cap14", "tokens_per_sec": 32_924.0, "ratio": 0.9975, "ratio_vs": "cap22",
         "ratio_interval": [0.99, 1.01], "within_noise": True, "ratio_ref": 0.9977,
         "ratio_ref_vs": "ac", "ratio_ref_interval": [0.997, 0.9984], "within_noise_ref": False},
    ]  # fmt: skip
    path = _results(tmp_path, "memory_xl.json", steps)
    lines = render_readme.render(_marked("memory_xl", path), tmp_path).split("\n")
    assert next(x for x in lines if x.startswith("| `cap22`: ")).endswith(
        "| 1.000x (within noise) |"
    )
    assert next(x for x in lines if x.startswith("| `cap14`: ")).endswith("| 0.998x |")
    assert next(x for x in lines if x.startswith("| `ac`")).endswith("| 1.00x |")


def test_a_row_of_another_call_is_compared_with_the_reference_measured_beside_it(
    tmp_path: Path,
) -> None:
    """The reference row comes from one call; a row of a later call is divided by the reference
    as re-measured in its own call (that call's anchor), on the same machine."""
    base = {"status": "ok", "peak_reserved_gib": 16.0, "peak_allocated_gib": 15.0}
    ac = {**base, "name": "ac", "tokens_per_sec": 30_000.0, "call": "1", "git_commit": "a"}
    anchor = {**ac, "tokens_per_sec": 20_000.0, "call": "2", "git_commit": "b"}
    lowbit = {**base, "name": "lowbit", "tokens_per_sec": 21_000.0, "call": "2",
              "git_commit": "b"}  # fmt: skip
    path = tmp_path / "docs/results/gpu/memory_xl.json"
    path.parent.mkdir(parents=True)
    segments = [{"call": "2", "steps": ["lowbit"], "anchor": anchor}]
    path.write_text(json.dumps({"environment": {}, "steps": [ac, lowbit], "segments": segments}))
    text = render_readme.render(_marked("memory_xl", str(path.relative_to(tmp_path))), tmp_path)
    assert "| **1.05x** |" in text  # 21,000 / 20,000 beside it, not 21,000 / 30,000 = 0.70x


def test_vs_nanogpt_renders_the_new_schema(tmp_path: Path) -> None:
    path = tmp_path / "docs/vs_nanogpt.json"
    path.parent.mkdir()
    path.write_text(json.dumps(fake_vs_nanogpt_result()))
    text = render_readme.render(_marked("vs_nanogpt", "docs/vs_nanogpt.json"), tmp_path)
    assert "Ours at its best (batch 64, biases, plain + custom_op, other math" in text
    assert "| 64 | yes | plain | same (equal work) |" in text


def test_a_wrong_marker_says_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="docs/nope.json not found: fix the path"):
        render_readme.render(_marked("speed", "docs/nope.json"), tmp_path)
    path = _results(tmp_path, "speed.json", [])
    with pytest.raises(SystemExit, match="unknown kind 'sped'"):
        render_readme.render(_marked("sped", path), tmp_path)


def test_quality_and_checkpoint_save_sentences_come_from_their_reports(tmp_path) -> None:
    """A quality report's verdict (the difference, what the test says, the seeds) and the async
    save's hold against the sync one are rendered from their json files."""
    report = {"difference": {"delta": -0.02541, "p": 0.01151}, "seeds": [1337, 1338, 1339],
              "status": "better", "tolerance": 0.02}  # fmt: skip
    assert render_readme.quality(report) == "-0.025 nats (better, p=0.012; 3 seeds per arm)"
    same = {**report, "status": "same", "difference": {"delta": 0.0064, "p": 0.479}}
    assert render_readme.quality(same).startswith("+0.006 nats (same within 0.02 nats, p=0.48")
    narrow = {**same, "difference": {"delta": 0.0064, "p": 0.479, "interval": [-0.01, 0.019]}}
    assert render_readme.quality(narrow) == (
        "+0.006 nats (same within 0.02 nats, p=0.48; 3 seeds per arm)"
    )
    wide = {**same, "difference": {"delta": 0.0064, "p": 0.479, "interval": [-0.0185, 0.0312]}}
    assert render_readme.quality(wide) == (
        "+0.006 nats (same within 0.02 nats, p=0.48; 3 seeds per arm; the 95% interval reaches "
        "±0.031)"
    )
    one = {**report, "status": "one seed", "seeds": [None], "difference": {"delta": 0.009}}
    assert render_readme.quality(one) == "+0.009 nats (one seed; 1 seed per arm)"
    saves = {"runs": {"sync": {"held_s": {"20": 59.34, "30": 73.7}},
                      "async": {"held_s": {"20": 15.58, "30": 32.3}}}}  # fmt: skip
    assert render_readme.checkpoint_save(saves) == "15.6 s instead of 59.3 s"


def test_a_row_whose_step_is_not_in_the_ladder_is_refused(tmp_path, monkeypatch) -> None:
    """A caption comes from the ladder's yaml only: a row shown of a step the yaml no longer has
    is refused, naming it, rather than shown with the results file's old caption."""
    monkeypatch.setattr(render_readme, "XL_ROWS", (*render_readme.XL_ROWS, "gone"))
    base = {"status": "ok", "tokens_per_sec": 1.0, "peak_allocated_gib": 1.0}
    steps = [{**base, "name": "ac"}, {**base, "name": "gone", "what": "an old caption"}]
    path = _results(tmp_path, "memory_xl.json", steps)
    with pytest.raises(SystemExit, match="step gone is not in conf/ablate/ladder/memory_xl.yaml"):
        render_readme.render(_marked("memory_xl", path), tmp_path)


def test_sizes_show_the_batch_and_head_each_row_ran_with_and_a_failed_row_its_status(
    tmp_path,
) -> None:
    """The batch comes from the row's own command, not from the ladder's yaml, which may have
    moved on since the run; a row whose runs diverged says so beside its speed."""
    steps: list[dict] = [
        {"name": "gpt2", "what": "124M", "status": "ok", "tokens_per_sec": 500_000.0,
         "repeats": 1, "mfu": 45.0, "peak_allocated_gib": 28.5, "stages": ["amp", "custom_op"],
         "overrides": ["model=gpt2", "train.batch_size=64"]},
        {"name": "gpt2_large", "what": "774M", "status": "ok", "tokens_per_sec": 94_000.0,
         "repeats": 3, "diverged_runs": 3, "stages": ["amp"],
         "overrides": ["model=gpt2-large", "train.batch_size=32"]},
        {"name": "gpt2_xl", "what": "1.5B", "status": "oom", "overrides": ["model=gpt2-xl"]},
    ]  # fmt: skip
    path = _results(tmp_path, "sizes.json", steps)
    lines = render_readme.render(_marked("sizes", path), tmp_path).split("\n")
    gpt2, large = _caption("sizes", "gpt2"), _caption("sizes", "gpt2_large")
    xl = _caption("sizes", "gpt2_xl")
    assert f"| {gpt2} | 64 | fused | 500,000 | — | 1 | 45.0% | 28.5 |" in lines
    assert f"| {large} | 32 | plain | 94,000 (diverged: 3 of 3 runs) | — | 3 | — | — |" in lines
    assert f"| {xl} | — | — | oom | — | — | — | — |" in lines


def _layout_row(name: str, stages: list[str], overrides: list[str], gpus: int, tokens: float,
                peak: float, **more) -> dict:  # fmt: skip
    """A scaling ladder row: its command (the workload's model=gpt2, then the step's) and
    numbers."""
    command = " ".join(["python train.py model=gpt2", *overrides, f"+opt=[{','.join(stages)}]"])
    numbers = {"tokens_per_sec": tokens, "peak_allocated_gib": peak}
    return {"name": name, "status": "ok", "stages": stages, "gpus": gpus, "nnodes": 1,
            "command": command, **numbers, **more}  # fmt: skip


def test_layouts_show_the_fastest_measured_layout_per_model_and_gpu_count(tmp_path) -> None:
    """One row per model and GPU count of one machine that was measured: its fastest layout
    (knob variants of a layout compete as that layout), then the others measured there; runs
    over several machines and failed rows are left out, nothing is invented; a count of GPUs
    slower than fewer GPUs says so."""
    xl, interleaved = ["model=gpt2-xl"], ["opt.pp.degree=4", "opt.pp.schedule=interleaved_1f1b"]
    steps = [
        _layout_row("one_gpu", ["amp"], [], 1, 100.0, 15.0),
        _layout_row("ddp", ["amp"], [], 2, 190.0, 15.5),
        _layout_row("ddp_bucket_25", ["amp", "ddp"], ["opt.ddp.bucket_cap_mb=25"], 2, 195.0, 15.6),
        _layout_row("fsdp", ["amp", "fsdp"], [], 2, 150.0, 14.0),
        _layout_row("two_nodes", ["amp"], [], 2, 999.0, 15.5, nnodes=2),
        _layout_row("xl_one_gpu", ["amp", "ac"], xl, 1, 20.0, 40.0),
        _layout_row("xl_pp2", ["amp", "pp"], [*xl, "opt.pp.microbatches=8"], 2, 30.0, 25.0),
        _layout_row("xl_pp4_interleaved", ["amp", "pp"], [*xl, *interleaved], 4, 70.0, 12.0),
        _layout_row("b4_tp2_fsdp2", ["amp", "tp", "fsdp"], ["model=gpt2-4b"], 4, 50.0, 60.0),
        _layout_row("large_one_gpu", ["amp"], ["model=gpt2-large"], 1, 90.0, 37.0),
        _layout_row("large_tp2", ["amp", "tp"], ["model=gpt2-large"], 2, 60.0, 23.0),
        _layout_row(
            "b4_pp2_tp2", ["amp", "pp", "tp"], ["model=gpt2-4b"], 4, 0.0, 0.0, status="oom"
        ),  # fmt: skip
    ]
    path = _results(tmp_path, "scaling.json", steps)
    lines = render_readme.render(_marked("layouts", path), tmp_path).split("\n")
    table = [line for line in lines if line.startswith("| `")]
    assert table == [
        "| `gpt2` | 1 | 1 GPU (`one_gpu`) | 100 | 15.00 | — |",
        "| `gpt2` | 2 | DDP 2 (`ddp_bucket_25`) | 195 | 15.60 | FSDP 2 (`fsdp`): 150, 14.00 GiB |",
        "| `gpt2-xl` | 1 | 1 GPU + ac (`xl_one_gpu`) | 20 | 40.00 | — |",
        "| `gpt2-xl` | 2 | pp=2 (`xl_pp2`) | 30 | 25.00 | — |",
        "| `gpt2-xl` | 4 | pp=4 (interleaved_1f1b) (`xl_pp4_interleaved`) | 70 | 12.00 | — |",
        "| `gpt2-4b` | 4 | tp=2 x FSDP 2 (`b4_tp2_fsdp2`) | 50 | 60.00 | — |",
        "| `gpt2-large` | 1 | 1 GPU (`large_one_gpu`) | 90 | 37.00 | — |",
        "| `gpt2-large` | 2 | tp=2 (`large_tp2`): below 1 GPU's 90 | 60 | 23.00 | — |",
    ], table
