"""The shipped charts: the quality plots show the gap against the tolerance band with the two
configurations named; a ladder's memory target is drawn; a ladder without memory numbers (a CPU)
draws no empty memory panel; both redraw from their json without a GPU."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import matplotlib.figure
import pytest

from helpers import ROOT
from measure import ablate, ladder_chart, ladders, quality

H100 = ROOT / "docs" / "results" / "nvidia-h100-80gb-hbm3"


@pytest.fixture
def figures(monkeypatch) -> list[matplotlib.figure.Figure]:
    """The figures the scripts save, kept for the test to read (and nothing written)."""
    saved: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    return saved


def test_the_quality_chart_names_both_configurations_and_draws_the_gap_band(figures) -> None:
    result = json.loads((H100 / "quality_lowbit.json").read_text())
    quality.chart(result, Path("unused.png"))
    loss, gap = figures[0].axes
    assert [t.get_text() for t in loss.get_legend().get_texts()] == [
        "reference: +opt=[compile,amp,fused,tf32]",
        "candidate: +opt=[compile,amp,lowbit,tf32]",
    ]
    assert "4-bit" not in loss.get_title() and "8-bit AdamW" in loss.get_title()
    band = gap.patches[0].get_extents().transformed(gap.transData.inverted())
    assert band.y0 == pytest.approx(-0.02) and band.y1 == pytest.approx(0.02)
    assert gap.get_ylim()[1] < 0.1  # the gap is visible: not on the 5-11 nats loss axis
    assert "final gap +0.0011 nats: within" in gap.get_title()  # the mean of 3 seeds


def test_the_memory_xl_chart_draws_its_target(figures) -> None:
    result = json.loads((H100 / "memory_xl.json").read_text())
    ladder_chart.chart(
        ladders.read("memory_xl"), result["steps"], result["environment"], Path("unused")
    )
    memory = figures[0].axes[1]
    assert [line.get_ydata()[0] for line in memory.get_lines()] == [20]
    assert "target: 20 GiB" in [t.get_text() for t in memory.get_legend().get_texts()]


def test_a_ladder_without_memory_numbers_draws_no_memory_panel(figures) -> None:
    rows = [{"index": i, "name": n, "status": "ok", "tokens_per_sec": 100.0 * (i + 1)}
            for i, n in enumerate(("baseline", "bs"))]  # fmt: skip
    ladder_chart.chart(ladders.read("quick"), rows, {"device": "CPU"}, Path("unused"))
    assert len(figures[0].axes) == 1


def test_results_redraw_from_their_json(tmp_path, monkeypatch) -> None:
    for name in ("memory_xl", "quality"):
        shutil.copy(H100 / f"{name}.json", tmp_path)
    ablate.main([f"report={tmp_path / 'memory_xl.json'}"])
    monkeypatch.setattr(sys, "argv", ["quality.py", "--report", str(tmp_path / "quality.json")])
    quality.main()
    assert (tmp_path / "memory_xl.png").stat().st_size > 0
    assert (tmp_path / "quality.png").stat().st_size > 0
