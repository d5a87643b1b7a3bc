"""Every shipped config composes, the documented overrides work, and every key is explained."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
from omegaconf import OmegaConf

from helpers import CONF, ROOT, make_cfg, python
from model import GPT, GPTConfig
from train import build_model

PRESETS = {  # name: (n_layer, n_head, n_embd, millions of parameters with positions)
    "tiny": (4, 4, 128, 7.2),
    "gpt2": (12, 12, 768, 124.5),
    "gpt2-medium": (24, 16, 1024, 354.9),
    "gpt2-large": (36, 20, 1280, 774.1),
    "gpt2-xl": (48, 25, 1600, 1557.7),
}


def test_defaults_compose() -> None:
    cfg = make_cfg()
    assert cfg.model.name == "tiny" and cfg.data.name == "shakespeare"
    assert cfg.device == "auto" and cfg.wandb.mode == "auto"
    assert OmegaConf.to_container(cfg.opt) == {}  # no stage unless asked for


@pytest.mark.parametrize("preset", PRESETS)
def test_model_presets(preset: str) -> None:
    cfg = make_cfg(f"model={preset}")
    n_layer, n_head, n_embd, millions = PRESETS[preset]
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (n_layer, n_head, n_embd)
    with torch.device("meta"):  # shapes only, no memory
        model = build_model(cfg.model)
    assert model.config.padded_vocab_size == 50304
    assert model.num_params(exclude_positions=False) / 1e6 == pytest.approx(millions, abs=0.1)


def test_unknown_preset_is_refused_with_the_options() -> None:
    with pytest.raises(Exception, match=r"(?s)Could not find 'model/gpt3'.*gpt2-medium"):
        make_cfg("model=gpt3")


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "data").glob("*.yaml")))
def test_data_options_compose(name: str) -> None:
    cfg = make_cfg(f"data={name}")
    assert cfg.data.name == name
    OmegaConf.to_container(cfg, resolve=True)


def test_documented_overrides() -> None:
    cfg = make_cfg(
        "train.max_steps=7", "train.batch_size=3", "model.block_size=64", "train.lr=1e-4",
        "train.eval_interval=5", "train.log_interval=2", "train.seed=9", "device=cpu",
        "wandb.mode=disabled", "train.resume=true",
    )  # fmt: skip
    assert (cfg.train.max_steps, cfg.train.batch_size, cfg.model.block_size) == (7, 3, 64)
    assert (cfg.train.lr, cfg.train.eval_interval, cfg.train.log_interval) == (1e-4, 5, 2)
    assert (cfg.train.seed, cfg.device, cfg.wandb.mode, cfg.train.resume) == (
        9,
        "cpu",
        "disabled",
        True,
    )


def _leaf_keys(yaml_file):
    for line in yaml_file.read_text().splitlines():
        match = re.match(r"^(\s*)([\w-]+):\s*(.*)$", line)
        if match and match.group(3) and not match.group(3).startswith("#"):
            yield match.group(2), line


DOCUMENTED = [
    *sorted(CONF.glob("*.yaml")),  # the trainer's and the tools' (sample.py, tools/)
    CONF / "model/gpt2.yaml", CONF / "data/shakespeare.yaml",
    *sorted((CONF / "opt").glob("*.yaml")), CONF / "hydra/help/annotated.yaml",
]  # fmt: skip


@pytest.mark.parametrize("yaml_file", DOCUMENTED, ids=lambda p: str(p.relative_to(CONF)))
def test_every_key_has_a_comment(yaml_file) -> None:
    stage_keys = {p.stem for p in (CONF / "opt").glob("*.yaml")}
    for key, line in _leaf_keys(yaml_file):
        if key in stage_keys:  # `tf32: {}`: the file's header explains the stage
            continue
        assert "#" in line, f"{yaml_file.name}: key {key!r} has no comment: {line!r}"


@pytest.mark.parametrize("group,base", [("model", "gpt2"), ("data", "shakespeare")])
def test_derived_presets_only_override_documented_keys(group: str, base: str) -> None:
    documented = OmegaConf.load(CONF / group / f"{base}.yaml")
    for path in (CONF / group).glob("*.yaml"):
        derived = OmegaConf.load(path)
        for key in derived:
            assert key == "defaults" or key in documented, (
                f"{path.name}: {key} is not in {base}.yaml"
            )


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python(), "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_help_shows_every_key_with_its_comment_and_only_the_trainers_groups() -> None:
    helped = _cli("--help")
    assert helped.returncode == 0, helped.stderr
    text = helped.stdout
    for line in (CONF / "config.yaml").read_text().splitlines():  # the file, comments included
        assert line in text, line
    assert "max_steps: 400            # optimizer steps to run" in text
    groups = re.findall(r"^== (\w+): ", text, flags=re.M)
    assert groups == ["model", "data", "opt", "prof", "preset"]  # not ablate.py's `ladder`
    assert not re.search(r"^\W*ladder", text, flags=re.M)
    for option in (CONF / "opt").glob("*.yaml"):  # each option with its file's opening comment
        first = (CONF / "opt" / option.name).read_text().splitlines()[0].lstrip("# ")
        assert re.search(rf"^  {option.stem} +{re.escape(first[:40])}", text, flags=re.M), option
    assert "tiny          A GPT-2-shaped toy" in text


def test_cli_cfg_job() -> None:
    shown = _cli("--cfg", "job", "model=gpt2", "+opt=[amp,compile]")
    assert shown.returncode == 0, shown.stderr
    cfg = OmegaConf.create(shown.stdout)
    assert cfg.model.n_layer == 12 and list(cfg.opt) == ["amp", "compile"]


def test_gpt_config_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        GPTConfig(n_embd=100, n_head=3)
    model = GPT(
        GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=10, pad_vocab_to=4)
    )
    with pytest.raises(ValueError, match="exceeds block_size 4"):
        model(torch.zeros(1, 5, dtype=torch.long))
