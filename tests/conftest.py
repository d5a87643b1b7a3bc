"""Shared test helpers: Hydra's compose API over the real `conf/`, a per-session data cache, and
a few tiny training-run settings that take seconds on a CPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

# Before anything imports `datasets` (it reads these once): tests never reach for the hub.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_SILENT"] = "true"

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# A 2-layer, 32-wide GPT on 32-token windows: a training step takes ~50 ms on a CPU.
TINY = [
    "model=tiny", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "train.batch_size=4", "train.warmup_steps=2", "train.eval_sequences=8",
    "sample.num_samples=1", "sample.max_new_tokens=4", "wandb.mode=offline", "device=cpu",
]  # fmt: skip


def make_cfg(*overrides: str) -> DictConfig:
    """The composed config, exactly as `python train.py <overrides>` would see it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def tiny_cfg(*overrides: str) -> DictConfig:
    return make_cfg(*TINY, *overrides)


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared-corpus cache for the whole session (the config reads GPT2_RECIPE_CACHE)."""
    cache = Path(os.environ.get("GPT2_RECIPE_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["GPT2_RECIPE_CACHE"] = str(cache)
    return cache


@pytest.fixture(autouse=True)
def _fresh_torch_state() -> None:
    """Each test starts from the same global RNG and matmul precision."""
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("highest")


def logged(run_dir: Path, key: str) -> list:
    """The values of metric `key` in a run's metrics.jsonl, in order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row[key] for row in map(json.loads, lines) if key in row]


def python() -> str:
    return sys.executable
