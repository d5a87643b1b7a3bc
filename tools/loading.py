"""What the after-training tools share (tools/sample.py, tools/evaluate.py, tools/export_hf.py):
the model they read, from a run folder or from Hugging Face weights; the device and precision
they run in. Bad input raises base/errors.py's classes: one line, not a traceback."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

import checkpointing
from base.errors import ConfigError, FileRefused, MissingFile
from model import GPT
from recipe import precision


def run_dir(run: str | None) -> Path:
    """`run=`: the folder of a training run."""
    path = Path(str(run)).expanduser()
    if not path.is_dir():
        raise MissingFile(
            f"run={run}: no such folder; give the folder of a training run (its hydra.run.dir, "
            "by default outputs/<date>/<time>-<pid>)"
        )
    return path


def output_file(out: str | None) -> Path | None:
    """`out=`: a file to write, checked before the work that fills it: not a folder, in a folder
    that exists, and writable."""
    if out is None:
        return None
    path = Path(str(out)).expanduser()
    if path.is_dir():
        raise FileRefused(f"out={out} is a folder: give the path of a file to write")
    if not path.parent.is_dir():
        raise MissingFile(
            f"out={out}: there is no folder {path.parent}: create it, or give another path"
        )
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise FileRefused(f"out={out}: not writable by this user: give another path")
    return path


def load_model(cfg: DictConfig, device: torch.device) -> tuple[GPT, dict[str, Any] | None]:
    """The model that `run=` or `model.pretrained=` names (exactly one of them), on `device`,
    and the run's saved config (None for Hugging Face weights)."""
    run, pretrained = cfg.get("run"), cfg.model.get("pretrained")
    if (run is None) == (pretrained is None):
        raise ConfigError(
            f"run={run} and model.pretrained={pretrained} both name a model: give one"
            if run is not None
            else "which model? Give run=<a training run's folder> or model.pretrained=<a "
            "save_pretrained dir or hub name>"
        )
    if run is not None:
        which = cfg.get("checkpoint", "latest")
        return checkpointing.load_model(run_dir(run), device, verify=cfg.verify, which=which)
    return GPT.from_pretrained(pretrained).to(device), None


def source(cfg: DictConfig) -> str:
    """The model a tool read, as its setting: `run=...` or `model.pretrained=...`."""
    if cfg.get("run") is not None:
        return f"run={cfg.run}"
    return f"model.pretrained={cfg.model.pretrained}"


def dtype(choice: str, device: torch.device) -> torch.dtype:
    """`dtype=`: auto is bfloat16 on a GPU that supports it, else float32."""
    if choice == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    if choice not in precision.DTYPES:
        raise ConfigError(f"dtype={choice!r}: choose auto, {', '.join(precision.DTYPES)}")
    precision.warn_if_float16_on_cpu(precision.DTYPES[choice], device, "dtype")
    return precision.DTYPES[choice]
