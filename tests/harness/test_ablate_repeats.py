"""The ablation harness's repeats and its resilience, with fake runs (milliseconds each): steps
run interleaved, rows carry medians, intervals and ratios that say when a gain is within noise,
segments merge through their anchors, repeated names are refused, and neither a failing step
nor a failing chart stops the ladder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from base.errors import ConfigError
from helpers import ROOT
from measure import ablate, ladder_chart, ladder_results, ladders, runner, stats

chart = ladder_chart.chart  # the real one, which most tests here replace (a second per run)

QUICK = ["baseline", "bs", "workers", "accum", "ac", "forloop"]
# Tokens/s per step and repeat: bs doubles the baseline, workers is within bs's noise.
SPEED = {
    "baseline": [100.0, 110.0, 90.0],
    "bs": [200.0, 210.0, 190.0],
    "workers": [201.0, 205.0, 195.0],
    "accum": [300.0, 310.0, 290.0],
    "ac": [150.0, 155.0, 145.0],
    "forloop": [140.0, 150.0, 130.0],
}
HYDRA_MISSING = """In 'config': Could not find 'opt/xyz'

Available options in 'opt':
\tac
\tamp
Config search path:
\tprovider=hydra, path=pkg://hydra.conf
\tprovider=main, path=file:///repo/conf
\tprovider=schema, path=structured://

Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
"""


class FakeRuns:
    """Stands in for `launch`: records the running order and answers with a summary, scaled by
    `machine` (another call on a slower machine); `outcomes` makes a step fail."""

    def __init__(self, machine: float = 1.0, outcomes: dict | None = None, summary=None,
                 losses: dict | None = None):  # fmt: skip
        self.order: list[tuple[str, int]] = []
        self.machine, self.outcomes, self.extra = machine, outcomes or {}, summary or {}
        self.losses = losses or {}  # (step, repeat): the training losses its metrics.jsonl logs

    def __call__(self, agents, run_dir: Path, timeout_s: float):
        _, name, *tag = run_dir.name.split("-", 2)  # <index>-<step>[-r<repeat>]
        repeat = int(tag[0][1:]) if tag else 0
        self.order.append((name, repeat))
        run_dir.mkdir(parents=True, exist_ok=True)
        losses = self.losses.get((name, repeat), [9.0, 6.5, 6.0])
        logged = [{"step": 10 * (i + 1), "train/loss": loss} for i, loss in enumerate(losses)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
        if name in self.outcomes:
            outcome = self.outcomes[name]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        tps = self.machine * SPEED[name][repeat]
        summary = {"perf/tokens_per_sec": tps, "perf/tokens_per_sec_p10": 0.9 * tps,
                   "perf/tokens_per_sec_p90": 1.1 * tps, "perf/step_ms": 1e3 / tps,
                   "perf/goodput": 0.9, "time/data_wait_ms": 2.5, "gpu_busy": 97.0,
                   "perf/gpu_busy": 40.0, **self.extra}  # fmt: skip
        return "ok", "", summary


def _ablate(monkeypatch, tmp_path, fake: FakeRuns, *args: str, draw: bool = False):
    """`python scripts/ablate.py ladder=quick <args>` with fake runs; the chart, redrawn after
    every run (a second each), only when `draw`."""
    monkeypatch.setattr(runner, "launch", fake)
    if not draw:
        monkeypatch.setattr(ladder_chart, "chart", lambda *args: None)
    argv = ["ladder=quick", f"out_dir={tmp_path / 'results'}", f"runs_dir={tmp_path / 'runs'}",
            *args]  # fmt: skip
    rows = ablate.main(argv)
    folder = tmp_path / "results" / ladder_results.slug(ablate.device_name())
    return rows, json.loads((folder / "quick.json").read_text()), folder


def test_repeats_run_interleaved_and_rows_carry_medians_intervals_and_noise(
    monkeypatch, tmp_path, capsys
) -> None:
    fake = FakeRuns()
    rows, result, folder = _ablate(monkeypatch, tmp_path, fake, "repeats=3")
    assert fake.order == [(name, r) for r in range(3) for name in QUICK]  # A B C ... A B C ...
    bs, workers = rows[1], rows[2]
    assert bs["repeats"] == 3 and bs["tokens_per_sec_runs"] == [200.0, 210.0, 190.0]
    assert bs["tokens_per_sec"] == 200.0 and bs["interval"] == [190.0, 210.0]
    assert 190.0 <= bs["ci95"][0] <= bs["ci95"][1] <= 210.0
    assert bs["ci95"] == stats.bootstrap_ci([200.0, 210.0, 190.0])  # seeded: reproducible
    # Paired run by run: the median of 2.0, 210/110 and 190/90.
    assert bs["ratio"] == 2.0 and bs["ratio_vs"] == "baseline"
    assert bs["ratio_interval"] == [round(210 / 110, 4), round(190 / 90, 4)]
    assert bs["within_noise"] is False
    assert workers["ratio_interval"][0] < 1 < workers["ratio_interval"][1]
    assert workers["within_noise"] is True
    assert result["steps"][2]["within_noise"] is True  # as published
    # The trainer's cold-start numbers travel whatever their namespace; missing ones are null.
    assert bs["goodput"] == 0.9 and bs["data_wait_ms"] == 2.5 and bs["joules_per_token"] is None
    assert bs["gpu_busy"] == 97.0  # over the measured steps, not the last window's (perf/)
    assert all(key in bs for key in ("first_step_s", "compile_s"))

    table = (folder / "quick.md").read_text()
    workers_line = next(line for line in table.splitlines() if "| `workers` |" in line)
    assert "within noise" in workers_line and "201,000" not in workers_line
    assert "201 (195–205, 3 runs)" in workers_line
    bs_line = next(line for line in table.splitlines() if "| `bs` |" in line)
    assert "2.000x (1.909–2.111)" in bs_line and "within noise" not in bs_line
    chart(OmegaConf.create({"name": "quick"}), rows, {"device": "CPU"}, tmp_path / "noise.png")
    assert (tmp_path / "noise.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # a grey bar
    printed = capsys.readouterr().out
    assert "| `workers` |" in printed.split("[ablate] results:")[-1]  # the table comes last


def test_repeats_come_from_the_command_line_the_ladder_or_the_device(monkeypatch) -> None:
    ladder = OmegaConf.create({"name": "x"})
    assert ladders.repeat_count(OmegaConf.create({"repeats": 5}), ladder) == 5
    assert ladders.repeat_count(OmegaConf.create({}), OmegaConf.create({"repeats": 2})) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ladders.repeat_count(OmegaConf.create({"repeats": None}), ladder) == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ladders.repeat_count(OmegaConf.create({"repeats": None}), ladder) == 1
    with pytest.raises(ConfigError, match="repeats=0: give a whole number"):
        ladders.repeat_count(OmegaConf.create({"repeats": 0}), ladder)


def test_one_run_per_step_judges_no_noise(monkeypatch, tmp_path) -> None:
    fake = FakeRuns()
    rows, _, folder = _ablate(monkeypatch, tmp_path, fake)  # the quick ladder: 1 run
    assert fake.order == [(name, 0) for name in QUICK]
    assert rows[1]["repeats"] == 1 and rows[1]["ci95"] is None
    assert rows[1]["ratio"] == 2.0 and rows[1]["within_noise"] is None
    assert "| 2.00x |" in (folder / "quick.md").read_text()  # as before repeats


def test_a_segment_merges_and_is_compared_through_its_anchor(monkeypatch, tmp_path) -> None:
    _, first, _ = _ablate(monkeypatch, tmp_path, FakeRuns(), "repeats=2")
    # Another call on a machine half as fast: only its anchor, re-measured beside the segment,
    # makes its ratio against the earlier rows right.
    fake = FakeRuns(machine=0.5)
    rows, result, folder = _ablate(monkeypatch, tmp_path, fake, "repeats=2", "steps=[accum,ac]")
    assert fake.order == [("workers", 0), ("accum", 0), ("ac", 0)] + [
        ("workers", 1), ("accum", 1), ("ac", 1)
    ]  # fmt: skip
    assert [r["name"] for r in rows] == QUICK
    by_name = {r["name"]: r for r in result["steps"]}
    assert by_name["workers"] == first["steps"][2]  # kept, its ratio still from the first call
    assert by_name["accum"]["tokens_per_sec_runs"] == [150.0, 155.0]  # replaced by name
    segment = result["segments"][-1]
    assert segment["steps"] == ["accum", "ac"] and segment["anchor"]["name"] == "workers"
    assert segment["anchor"]["tokens_per_sec_runs"] == [100.5, 102.5]
    assert by_name["workers"]["call"] != segment["call"] == by_name["accum"]["call"]
    # accum / workers from one call: 300/201 and 310/205 (0.75x against the stale row).
    assert by_name["accum"]["ratio_interval"] == [round(300 / 201, 4), round(310 / 205, 4)]
    assert by_name["ac"]["ratio"] == pytest.approx(0.5, abs=1e-3)  # ac / accum, same call
    # forloop (first call) against ac (second), no anchor between them: another machine, perhaps,
    # so the ratio of medians, with no interval and no verdict on noise.
    forloop = by_name["forloop"]
    assert forloop["ratio"] == round(145 / 76.25, 4) and forloop["ratio_across_calls"] is True
    assert forloop["ratio_interval"] is None and forloop["within_noise"] is None
    assert by_name["accum"]["ratio_across_calls"] is False
    assert len(result["segments"]) == 2  # the first call's rows are still there
    table = (folder / "quick.md").read_text()
    assert "Steps ['accum', 'ac'] ran in one call" in table
    assert "`workers` re-measured beside them" in table
    assert f"| {forloop['ratio']:.2f}x (across calls) |" in table
    # A third call re-measures ac: the second call's segment now speaks for accum alone.
    _ablate(monkeypatch, tmp_path, FakeRuns(), "repeats=2", "steps=[ac]")
    table = (folder / "quick.md").read_text()
    assert "Steps ['accum'] ran in one call" in table and "['accum', 'ac']" not in table
    assert "Steps ['ac'] ran in one call" in table and "`accum` re-measured beside them" in table


def test_a_run_whose_loss_ends_far_above_its_lowest_is_marked_diverged(
    monkeypatch, tmp_path, capsys
) -> None:
    # workers: two of three runs diverge (the loss falls to 6.2, then climbs to 8.1); accum's
    # runs wobble a little at the end (+3%), which is not divergence.
    diverging = [9.0, 6.5, 6.2, 7.4, 8.1]
    losses = {("workers", 1): diverging, ("workers", 2): diverging}
    losses |= {("accum", r): [9.0, 6.5, 6.0, 6.18] for r in range(3)}
    rows, result, folder = _ablate(monkeypatch, tmp_path, FakeRuns(losses=losses), "repeats=3")
    by_name = {r["name"]: r for r in rows}
    assert by_name["workers"]["diverged_runs"] == 2
    assert by_name["workers"]["loss_rise"] == round(8.1 / 6.2 - 1, 4)
    assert by_name["accum"]["diverged_runs"] == 0 and by_name["accum"]["loss_rise"] == 0.03
    assert by_name["bs"]["diverged_runs"] == 0 and by_name["bs"]["loss_rise"] == 0.0
    assert result["steps"][2]["diverged_runs"] == 2  # as published
    table = (folder / "quick.md").read_text()
    workers_line = next(line for line in table.splitlines() if "| `workers` |" in line)
    assert "**(2 of 3 runs diverged)**" in workers_line
    assert "*diverged*: a run's last logged training loss ended over 10% above" in table
    assert "diverged" not in next(line for line in table.splitlines() if "| `accum` |" in line)
    assert "diverged_runs" in (folder / "quick.csv").read_text().splitlines()[0]
    printed = capsys.readouterr().out
    assert printed.count("(diverged: its loss ended 31% above its lowest)") == 2
    # Rows without a diverged run say nothing about it.
    _, _, quiet = _ablate(monkeypatch, tmp_path / "quiet", FakeRuns(), "repeats=1")
    assert "diverged" not in (quiet / "quick.md").read_text()


def test_loss_rise_reads_a_runs_metrics_and_survives_what_a_killed_run_leaves(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert runner.loss_rise(metrics) is None  # no file: a run that never started
    metrics.write_text('{"step": 10, "train/loss": 6.0}\n{"step": 20, "val/loss": 9.0}\n')
    assert runner.loss_rise(metrics) is None  # one training loss: nothing to compare
    metrics.write_text(
        '{"step": 10, "train/loss": 8.0}\n{"step": 20, "train/loss": 5.0}\n'
        '{"step": 30, "train/loss": 6.0}\n{"step": 40, "train/lo'  # cut mid-line
    )
    assert runner.loss_rise(metrics) == 0.2


def test_an_explicit_anchor_and_its_mistakes(monkeypatch, tmp_path) -> None:
    fake = FakeRuns()
    rows, result, _ = _ablate(monkeypatch, tmp_path, fake, "steps=[ac]", "anchor=baseline")
    assert fake.order == [("baseline", 0), ("ac", 0)]
    # A fresh folder has no row of the anchor's step: its measurement is that row.
    assert [r["name"] for r in rows] == ["baseline", "ac"] and rows[1]["ratio"] == 1.5
    assert result["report_errors"] == [] and result["segments"][0]["anchor"]["name"] == "baseline"
    with pytest.raises(ConfigError, match="anchor=ac is one of steps"):
        _ablate(monkeypatch, tmp_path, fake, "steps=[ac]", "anchor=ac")
    with pytest.raises(ConfigError, match="anchor=nope is not a step of ladder quick"):
        _ablate(monkeypatch, tmp_path, fake, "steps=[ac]", "anchor=nope")
    fake.order.clear()
    _ablate(monkeypatch, tmp_path, fake, "steps=[ac]", "anchor=none")  # rows among themselves
    assert fake.order == [("ac", 0)]
    fake.order.clear()
    _ablate(monkeypatch, tmp_path, fake, "steps=[baseline,bs]")  # from the start: no anchor
    assert fake.order == [("baseline", 0), ("bs", 0)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ladder.steps.1.name=baseline"], r"conf/ablate/ladder/quick.yaml\) names \['baseline'\]"),
        (["steps=[bs,ac,bs]"], r"steps=\['bs', 'ac', 'bs'\] names \['bs'\] more than once"),
    ],
)
def test_repeated_step_names_are_refused_before_anything_runs(
    monkeypatch, tmp_path, args, message
) -> None:
    fake = FakeRuns()
    with pytest.raises(ConfigError, match=message) as refused:
        _ablate(monkeypatch, tmp_path, fake, *args)
    assert fake.order == [] and "\n" not in str(refused.value)


def test_a_failing_step_is_recorded_by_its_cause_and_the_ladder_goes_on(
    monkeypatch, tmp_path
) -> None:
    fake = FakeRuns(
        outcomes={"workers": ("failed", HYDRA_MISSING, {}), "accum": OSError("disk gone")}
    )
    rows, result, folder = _ablate(monkeypatch, tmp_path, fake, "repeats=2")
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "failed", "ok", "ok"]
    assert rows[2]["error"] == "In 'config': Could not find 'opt/xyz'"
    assert rows[3]["error"] == "ablate.py: OSError: disk gone"  # the harness's own failure
    # A failed step is not tried again; the others run their repeats.
    assert fake.order.count(("workers", 1)) == 0 and ("forloop", 1) in fake.order
    assert rows[4]["ratio_vs"] == "bs"  # compared with the last row that ran
    table = (folder / "quick.md").read_text()
    assert "- `workers` (failed): In 'config': Could not find 'opt/xyz'" in table


def test_steps_too_short_for_p10_p90_still_chart(monkeypatch, tmp_path) -> None:
    """A run shorter than perf.warmup_steps has no p10/p90: the chart once passed a negative
    error bar to matplotlib and the ladder died with the next steps unrun."""
    fake = FakeRuns(summary={"perf/tokens_per_sec_p10": None, "perf/tokens_per_sec_p90": None})
    rows, result, folder = _ablate(monkeypatch, tmp_path, fake, "steps=[baseline,bs]", draw=True)
    assert len(fake.order) == 2 and result["report_errors"] == []
    assert (folder / "quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ladder_chart._error_bar({"tokens_per_sec": 100.0, "tokens_per_sec_p10": None}) == (0, 0)
    ladder = OmegaConf.create({"name": "empty", "focus": "speed", "cumulative": True})
    assert (
        ladder_results.publish(ladder, [], {"device": "CPU"}, tmp_path / "empty") == []
    )  # anchor only
    # A p10 above the median of the repeats reaches no lower than the bar.
    assert ladder_chart._error_bar(
        {"tokens_per_sec": 1e3, "repeats": 2, "interval": [1.2e3, 2e3]}
    ) == (
        0.0,
        1.0,
    )


def test_a_failing_chart_does_not_stop_the_ladder(monkeypatch, tmp_path) -> None:
    def broken(*args, **kwargs):
        raise ValueError("'yerr' must not contain negative values")

    monkeypatch.setattr(ladder_chart, "chart", broken)
    fake = FakeRuns()
    with pytest.raises(SystemExit, match="some results were not written: .*chart: ValueError"):
        _ablate(monkeypatch, tmp_path, fake, draw=True)  # with the broken chart
    assert len(fake.order) == 6  # every step ran
    folder = tmp_path / "results" / ladder_results.slug(ablate.device_name())
    result = json.loads((folder / "quick.json").read_text())
    assert [r["status"] for r in result["steps"]] == ["ok"] * 6
    assert result["report_errors"] == ["chart: ValueError: 'yerr' must not contain negative values"]
    assert (folder / "quick.md").exists() and (folder / "quick.csv").exists()


def test_failure_reasons_name_the_cause_not_hydras_search_path() -> None:
    assert runner.failure_reason(HYDRA_MISSING) == "In 'config': Could not find 'opt/xyz'"
    override = (
        "Could not override 'opt.nope'.\nTo append to your config use +opt.nope=3\n"
        "Key 'nope' is not in struct\n    full_key: opt.nope\n    object_type=dict\n\n"
        "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"
    )
    reason = runner.failure_reason(override)
    assert reason.startswith("Could not override 'opt.nope'. | To append to your config use")
    assert "HYDRA_FULL_ERROR" not in reason


LADDERS = {p.stem for p in (ladders.CONF / "ladder").glob("*.yaml")}
PUBLISHED = sorted(p for p in (ROOT / "docs/results").glob("*/*.json") if p.stem in LADDERS)


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_published_ladders_still_render(tmp_path, path: Path) -> None:
    """Results written before repeats (one number per row, no segments) render as before."""
    ladder = ladders.read(path.stem)
    result = json.loads(path.read_text())
    errors = ladder_results.publish(ladder, result["steps"], result["environment"], tmp_path)
    assert errors == []
    assert (tmp_path / f"{path.stem}.md").read_text().count("\n| ") >= len(result["steps"])


def test_rows_from_before_call_ids_are_one_call_only_at_one_commit() -> None:
    """Single-run rows written before calls were recorded: the same commit is one call; another
    commit (another machine, perhaps) is compared across calls, as the README marks it."""
    row = {"name": "b", "status": "ok", "tokens_per_sec": 100.0, "git_commit": "aaa"}
    before = {"name": "a", "status": "ok", "tokens_per_sec": 50.0, "git_commit": "aaa"}
    same = stats.speed_ratio(row, before, {})
    assert same is not None and same["interval"] == [2.0, 2.0] and not same["across_calls"]
    across = stats.speed_ratio(row, {**before, "git_commit": "bbb"}, {})
    assert across is not None and across["across_calls"] and across["interval"] is None


def test_two_calls_writing_one_ladders_results_keep_each_others_rows(monkeypatch, tmp_path) -> None:
    # Two lanes of one host (a ladder on each GPU) publish into the same json: a call that runs
    # while another publishes must not drop the other's rows when it writes its own.
    other = FakeRuns(machine=0.5)
    fake = FakeRuns()

    def launch_and_let_another_call_publish(agents, run_dir: Path, timeout_s: float):
        if not other.order:  # the other lane finishes while this one runs its first step
            monkeypatch.setattr(runner, "launch", other)
            ablate.main([f"out_dir={tmp_path / 'results'}", f"runs_dir={tmp_path / 'runs'}",
                         "ladder=quick", "repeats=1", "steps=[ac]", "anchor=none"])  # fmt: skip
            monkeypatch.setattr(runner, "launch", launch_and_let_another_call_publish)
        return fake(agents, run_dir, timeout_s)

    monkeypatch.setattr(ladder_chart, "chart", lambda *args: None)
    monkeypatch.setattr(runner, "launch", launch_and_let_another_call_publish)
    ablate.main([f"out_dir={tmp_path / 'results'}", f"runs_dir={tmp_path / 'runs'}",
                 "ladder=quick", "repeats=1", "steps=[baseline,bs]"])  # fmt: skip
    folder = tmp_path / "results" / ladder_results.slug(ablate.device_name())
    result = json.loads((folder / "quick.json").read_text())
    by_name = {r["name"]: r for r in result["steps"]}
    assert sorted(by_name) == ["ac", "baseline", "bs"]
    assert by_name["ac"]["tokens_per_sec_runs"] == [75.0]  # the other lane's, kept
    assert by_name["bs"]["tokens_per_sec_runs"] == [200.0]
    assert {s["call"] for s in result["segments"]} == {by_name["ac"]["call"], by_name["bs"]["call"]}
    assert "| `ac` |" in (folder / "quick.md").read_text()
