"""Capped rows: `perf.memory_cap_gib` lets a run use only that much of the GPU, as a
smaller card would; a ladder step's `memory_cap_gib` reaches its train.py command line and its
row (json, csv, table); the memory_xl ladder's capped rows compose; on a CPU the cap is recorded
and does nothing."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from omegaconf import OmegaConf

from helpers import ROOT, make_cfg, tiny_run
from measure import ablate, ladder_chart, ladder_results, ladders, runner
from recipe import config
from recipe.hardware import GiB, cap_memory


def _ladder(name: str, *overrides: str):
    return ladders.config([f"ladder={name}", *overrides]).ladder


def test_memory_xl_has_rows_capped_at_22_14_and_10_gib() -> None:
    plans = {p["name"]: p for p in ladders.step_plans(_ladder("memory_xl"))}
    caps = {name: p.get("memory_cap_gib") for name, p in plans.items()}
    assert {caps["cap22"], caps["cap14"], caps["cap10"]} == {22, 14, 10}
    assert all(caps[n] is None for n in ("lowbit", "offload", "bs128"))  # not carried over
    assert sorted(plans["cap22"]["stages"]) == sorted(plans["lowbit"]["stages"])
    # Each smaller card: the lowbit row's stages, knobs that shrink it added one row at a time
    assert plans["cap10"]["stages"] == plans["cap14"]["stages"] == plans["cap22"]["stages"]
    assert plans["cap14"]["overrides"][-1] == "opt.amp.residual=compute"
    assert plans["cap10"]["overrides"][-3:] == [
        "opt.amp.residual=compute", "opt.lowbit.weights=bfloat16", "opt.lowbit.bits=4"
    ]  # fmt: skip
    for name in ("cap22", "cap14", "cap10"):
        plan = plans[name]
        ((command, _),) = runner.launches(plan, _ladder("memory_xl"), [], ROOT / "runs" / name)
        assert f"perf.memory_cap_gib={caps[name]}" in command
        args = command[command.index("train.py") + 1 : -3]  # less run folder and wandb names
        cfg = make_cfg(*args)
        assert cfg.perf.memory_cap_gib == caps[name]
        assert cfg.train.batch_size * cfg.model.block_size == 16 * 1024
    ((command, _),) = runner.launches(plans["bs128"], _ladder("memory_xl"), [], ROOT / "r")
    assert not any(a.startswith("perf.memory_cap_gib") for a in command)


def test_a_capped_step_records_its_cap_in_every_result(monkeypatch, tmp_path) -> None:
    commands = []

    def fake(agents, run_dir, timeout_s):
        commands.append(agents[0][0])
        tps = 100.0
        return "ok", "", {"perf/tokens_per_sec": tps, "mem/peak_allocated_gib": 1.0}

    monkeypatch.setattr(runner, "launch", fake)
    monkeypatch.setattr(ladder_chart, "chart", lambda *args: None)
    ablate.main(["ladder=quick", "+ladder.steps.1.memory_cap_gib=6", "steps=[baseline,bs]",
                 f"out_dir={tmp_path}", f"runs_dir={tmp_path / 'runs'}"])  # fmt: skip
    assert "perf.memory_cap_gib=6" in commands[1] and not any(
        a.startswith("perf.memory_cap_gib") for a in commands[0]
    )
    folder = tmp_path / ladder_results.slug(ablate.device_name())
    rows = {r["name"]: r for r in json.loads((folder / "quick.json").read_text())["steps"]}
    assert rows["bs"]["memory_cap_gib"] == 6 and "memory_cap_gib" not in rows["baseline"]
    assert "perf.memory_cap_gib=6" in rows["bs"]["command"]
    with open(folder / "quick.csv") as f:
        table = {r["name"]: r for r in csv.DictReader(f)}
    assert table["bs"]["memory_cap_gib"] == "6" and table["baseline"]["memory_cap_gib"] == ""
    assert "(cap 6 GiB)" in (folder / "quick.md").read_text()


def test_a_run_over_its_cap_is_classified_out_of_memory() -> None:
    """What PyTorch raises when the caching allocator would pass the process's fraction."""
    message = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        "capacity of 79.18 GiB of which 60.12 GiB is free. Including non-PyTorch memory, this "
        "process has 19.05 GiB memory in use. Of the allocated memory 13.35 GiB is allocated by "
        "PyTorch, with 14.00 GiB allowed"
    )
    assert runner.OOM.search(message)


def test_the_cap_sets_the_process_fraction_on_a_gpu(monkeypatch) -> None:
    fractions = []
    props = type("Props", (), {"total_memory": 80 * GiB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f)
    )
    cap_memory(torch.device("cuda", 0), 22)
    assert fractions == [pytest.approx(22 / 80)]
    cap_memory(torch.device("cuda", 0), None)
    assert len(fractions) == 1
    with pytest.raises(ValueError, match="memory_cap_gib=100 exceeds this GPU's 80.0 GiB"):
        cap_memory(torch.device("cuda", 0), 100)


def test_a_bad_cap_is_refused_before_the_run() -> None:
    with pytest.raises(ValueError, match="perf.memory_cap_gib must be"):
        config.validate(make_cfg("perf.memory_cap_gib=0"))


def test_on_a_cpu_the_cap_is_recorded_and_does_nothing(tmp_path, capsys) -> None:
    summary = tiny_run(tmp_path / "run", "train.max_steps=2", "perf.memory_cap_gib=1")
    assert summary["step"] == 2
    out = capsys.readouterr().out
    assert out.count("memory_cap_gib=1: recorded, no effect on a cpu run") == 1
    saved = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert saved.perf.memory_cap_gib == 1
