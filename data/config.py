"""The data settings (`cfg.data`, conf/data/*.yaml), checked before any work starts."""

from __future__ import annotations

import re

from omegaconf import DictConfig

from base.errors import ConfigError
from data.tokenizer import VOCAB_SIZE

SOURCES = ("shakespeare", "text", "hub", "synthetic")
LOADERS = ("memmap", "text")
_FOLDER_NAME = re.compile(r"[A-Za-z0-9._-]+")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(cfg: DictConfig) -> None:
    """Refuses data settings that cannot work, in one line naming the key and what it accepts."""
    if cfg.source not in SOURCES:
        raise ConfigError(f"data.source={cfg.source!r}: choose one of {', '.join(SOURCES)}")
    name = cfg.name
    if not isinstance(name, str) or not _FOLDER_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            f"data.name={name!r} names the prepared folder inside data.cache_dir: use a plain "
            "folder name (letters, digits, '.', '_', '-'; not '.' or '..')"
        )
    if cfg.loader not in LOADERS:
        raise ConfigError(f"data.loader={cfg.loader!r}: choose one of {', '.join(LOADERS)}")
    if not _is_number(cfg.val_fraction) or not 0 < cfg.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be a number in (0, 1), got {cfg.val_fraction!r}")
    if cfg.num_proc is not None and (not _is_integer(cfg.num_proc) or cfg.num_proc < 1):
        raise ConfigError(f"data.num_proc must be null or an integer >= 1, got {cfg.num_proc!r}")
    if cfg.source == "synthetic" and (
        not _is_integer(cfg.vocab_size) or not 1 <= cfg.vocab_size <= VOCAB_SIZE
    ):
        raise ConfigError(
            f"data.vocab_size must be an integer in [1, {VOCAB_SIZE}] (GPT-2's vocabulary, which "
            f"the model predicts over), got {cfg.vocab_size!r}"
        )
