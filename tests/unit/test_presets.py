"""The presets (conf/preset/): each composes, what the command line sets wins over it, and each
runs two steps on a CPU at a tiny size. Also amp's `dtype: auto`, and the quiet install: lowbit
without torchao says how to install it, a prepared corpus is described in words, local text
files load without `datasets`' progress bars."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

import opt
from base.distributed import Distributed
from data.prepare import describe
from data.sources import _text_files
from helpers import CONF, ROOT, make_cfg, python, tiny_cfg, tiny_run
from measure import ladders
from opt.amp import resolve_dtype

SINGLE = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
PRESETS = sorted(p.stem for p in (CONF / "preset").glob("*.yaml"))

# What each preset selects: its model, corpus and stages, in the order the preset lists them.
FAST = ["workers", "non_blocking", "compile", "amp", "tf32", "fused", "custom_op"]
EXPECTED = {
    "fastest": ("gpt2", "shakespeare", ["bs", *FAST]),
    "gpu24gb-xl": (
        "gpt2-xl",
        "shakespeare",
        ["amp", "ac", "custom_op", "lowbit", "opt_in_backward"],
    ),
    "laptop": ("tiny", "shakespeare", []),
    "gpt2-124m-fineweb": ("gpt2", "fineweb-edu", ["accum", *FAST]),
    "gpt2-124m-owt": ("gpt2", "openwebtext", ["accum", *FAST]),
}

# Shrinks a preset to a CPU smoke test: the tiny model and batch (TINY: the command line wins),
# random tokens (the reproduce presets' corpora are on the hub), 2 steps; one worker, and no
# compile (Inductor on a CPU needs a C++ toolchain and minutes; its stage has its own tests).
SMOKE = ("data=synthetic", "train.max_steps=2", "train.eval_interval=2", "train.eval_sequences=4",
         "train.checkpoint_interval=0", "sample.num_samples=0", "wandb.mode=disabled")  # fmt: skip
SMALLER_STAGES = ("opt.workers.num_workers=1", "~opt.compile")
SHRINK = {
    "fastest": ("opt.bs.batch_size=4", *SMALLER_STAGES),  # bs replaces train.batch_size
    "gpu24gb-xl": (),
    "laptop": (),
    "gpt2-124m-fineweb": SMALLER_STAGES,
    "gpt2-124m-owt": SMALLER_STAGES,
}


def test_every_preset_file_is_known() -> None:
    assert PRESETS == sorted(EXPECTED) == sorted(SHRINK)


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_composes(name: str) -> None:
    cfg = make_cfg(f"preset={name}")
    model, corpus, stages = EXPECTED[name]
    assert (cfg.model.name, cfg.data.name, list(cfg.opt)) == (model, corpus, stages)
    assert "preset" not in cfg  # its keys land where they belong (@package _global_)
    opt.selected(cfg.opt)  # only known stages


def test_the_command_line_wins_over_a_preset() -> None:
    cfg = make_cfg("preset=gpt2-124m-owt", "model=tiny", "data=synthetic", "train.lr=1e-3",
                   "+opt=ac", "~opt.compile", "opt.accum.steps=4")  # fmt: skip
    assert (cfg.model.name, cfg.data.name, cfg.train.lr) == ("tiny", "synthetic", 1e-3)
    assert "ac" in cfg.opt and "compile" not in cfg.opt and cfg.opt.accum.steps == 4
    # and the rest of the preset stays: its schedule, over the fineweb preset it builds on
    assert (cfg.train.warmup_steps, cfg.train.max_steps) == (2000, 562500)


def test_the_reproduce_presets_step_half_a_million_tokens_on_8_gpus() -> None:
    """nanoGPT's / llm.c's global batch: 8 GPUs x 64 sequences x 1024 tokens, each GPU's 64 as
    micro-batches (+opt=accum), and build-nanogpt's 10B tokens in 19,073 steps."""
    for name in ("gpt2-124m-fineweb", "gpt2-124m-owt"):
        cfg = make_cfg(f"preset={name}")
        assert 8 * cfg.train.batch_size * cfg.model.block_size == 524_288
        assert cfg.train.batch_size % cfg.opt.accum.steps == 0
        assert (cfg.train.lr, cfg.train.min_lr, cfg.train.weight_decay) == (6e-4, 6e-5, 0.1)
        assert (cfg.train.beta1, cfg.train.beta2, cfg.train.grad_clip) == (0.9, 0.95, 1.0)
    fineweb = make_cfg("preset=gpt2-124m-fineweb").train
    assert abs(fineweb.max_steps * 524_288 - 10e9) < 524_288


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n == "gpu24gb-xl" else n for n in PRESETS],
)  # gpu24gb-xl: ~18 s, torchao's update compiled by Inductor on the CPU
def test_smoke_each_preset_runs_on_a_cpu(tmp_path: Path, name: str) -> None:
    summary = tiny_run(tmp_path, f"preset={name}", *SMOKE, *SHRINK[name])
    assert summary["completed"] and torch.isfinite(torch.tensor(summary["val/loss"]))
    assert f"preset={name}" in (tmp_path / "overrides.yaml").read_text()  # what a resume rebuilds


# ---- amp: bfloat16 where the device computes in it


def test_amp_picks_bfloat16_on_a_cpu(capsys) -> None:
    plan = opt.plan(tiny_cfg("+opt=amp"), SINGLE)
    assert plan.amp_dtype == torch.bfloat16 and not plan.scale_loss
    out = capsys.readouterr().out
    assert "[opt] amp: bfloat16 mixed precision (auto)" in out and "[warning]" not in out


def test_amp_picks_float16_on_a_gpu_without_bfloat16(monkeypatch) -> None:
    """A pre-Ampere GPU (compute capability < 8.0): torch's default check counts an emulated
    bfloat16 as supported, auto does not."""
    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return including_emulation  # only emulated

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert resolve_dtype("auto", torch.device("cuda")) == "float16"
    assert asked == [False]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", torch.device("cuda")) == "bfloat16"  # Ampere and newer


def test_amp_keeps_the_dtype_asked_for(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("float16", torch.device("cuda")) == "float16"
    plan = opt.plan(tiny_cfg("+opt=amp", "opt.amp.dtype=float16"), SINGLE)
    assert plan.amp_dtype == torch.float16 and plan.scale_loss
    with pytest.raises(ValueError, match="must be one of auto, float16, bfloat16"):  # its knob
        opt.plan(tiny_cfg("+opt=amp", "opt.amp.dtype=fp8"), SINGLE)


def test_the_ladders_float16_rows_pin_float16() -> None:
    """The book's amp stage is float16: its ladder rows say so, whatever amp's default."""
    for ladder in ("speed", "stages"):
        (row,) = [p for p in ladders.step_plans(ladders.read(ladder)) if p["name"] == "amp_fp16"]
        assert "amp" in row["stages"] and row["overrides"][-1] == "opt.amp.dtype=float16"


# ---- the quiet install


def test_lowbit_without_torchao_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # `import` raises ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[lowbit\]"') as failed:
        opt.plan(tiny_cfg("+opt=lowbit"), SINGLE)
    assert "\n" not in str(failed.value)


def test_lowbit_is_an_extra_that_the_dev_install_includes() -> None:
    pyproject = (CONF.parent / "pyproject.toml").read_text()
    dependencies = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "torchao" not in dependencies  # not installed by `pip install -e .`
    assert re.search(r'^lowbit = \["torchao==0\.18\.\*"\]$', pyproject, flags=re.M)
    dev = re.search(r"^dev = \[(.*)\]$", pyproject, flags=re.M).group(1)
    assert '"torchao==0.18.*"' in dev  # CI installs .[dev]: the lowbit tests run there


def test_a_prepared_corpus_is_described_in_words() -> None:
    counts = {"train": {"tokens": 1377632, "bytes": 4490600, "documents": 35},
              "val": {"tokens": 155531, "bytes": 498971, "documents": 4}}  # fmt: skip
    line = describe(counts)
    assert line == ("train 1,377,632 tokens (35 documents, 4.5 MB), "
                    "val 155,531 tokens (4 documents, 0.5 MB)")  # fmt: skip
    assert "{" not in line


def test_local_text_files_load_without_progress_bars(tmp_path: Path, capfd) -> None:
    files = []
    for i in range(3):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(f"document {i}\n")
    docs = _text_files(files, tmp_path / "scratch")  # a new folder: nothing cached
    assert docs["text"] == ["document 0\n", "document 1\n", "document 2\n"]
    err = capfd.readouterr().err
    assert "Downloading data" not in err and "Generating train split" not in err
    assert datasets.is_progress_bar_enabled()  # the tokenizing bars still show


def test_help_lists_each_preset_with_its_summary_not_hydras_package_line() -> None:
    from recipe.config import annotated_help

    text = annotated_help("config")
    assert "@package" not in text.split("== preset:")[1]
    assert re.search(r"^  laptop +A run that finishes on a laptop CPU", text, flags=re.M)


# ---- presets sized for a GPU: their numbers come from the results they were measured in


def _row(ref: str) -> dict:
    path, _, name = ref.partition("#")
    return next(r for r in json.loads((ROOT / path).read_text())["steps"] if r["name"] == name)


def test_help_quotes_each_gpu_presets_numbers_from_its_results() -> None:
    from recipe.config import annotated_help

    text = " ".join(annotated_help("config").split("== preset:")[1].split())
    for name in ("fastest", "gpu24gb-xl"):
        row = _row(make_cfg(f"preset={name}").measured)
        assert (
            f"{row['tokens_per_sec']:,.0f} tokens/s and {row['peak_allocated_gib']:.1f} GiB" in text
        )
    comments = " ".join(p.read_text() for p in (CONF / "preset").glob("*.yaml"))
    assert not re.search(r"\d,\d{3} tokens/s|\d GiB", comments)  # no copy to go stale


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_a_gpu_preset_on_a_cpu_is_refused_naming_its_memory_and_the_cpu_preset(tmp_path) -> None:
    """`python train.py preset=fastest` without a GPU: one line, before any work (the kernel
    killed such a run at 20 GB), naming the preset's measured memory and preset=laptop."""
    done = subprocess.run(
        [python(), "train.py", "preset=fastest", "train.max_steps=2",
         f"hydra.run.dir={tmp_path}/r"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    peak = _row(make_cfg("preset=fastest").measured)["peak_allocated_gib"]
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("train.py: error: this preset is sized for a GPU")
    assert f"{peak:.1f} GiB" in line and "preset=laptop" in line and "device=cpu" in line
    assert not (tmp_path / "r").exists()


def test_a_gpu_preset_asked_to_run_on_the_cpu_warns(capsys) -> None:
    from recipe.config import check_device

    check_device(make_cfg("preset=gpu24gb-xl", "device=cpu"), torch.device("cpu"))
    assert "[train] warning: this preset is sized for a GPU" in capsys.readouterr().out
    check_device(make_cfg("preset=laptop"), torch.device("cpu"))  # sized for it: silent
    assert capsys.readouterr().out == ""
