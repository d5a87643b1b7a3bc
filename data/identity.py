"""What a run trained on, recorded in its checkpoint and checked on resume: the sources' content
(not their paths or modification times), the tokenizer and the token dtype. A resume whose corpus
differs is refused before any work, naming what changed: an edited `data=text` file is another
corpus. The same content hash keys the prepared corpus's folder (data/prepare.py), so what a run
trains on is what its checkpoint records.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError
from data.integrity import content_sha256
from data.sources import expand_files, shakespeare_files, unreadable
from data.tokenizer import TOKEN_DTYPE, TOKENIZER


def _sources(cfg: DictConfig) -> tuple[str, str]:
    """How messages name the corpus's sources, and the sha256 of what they hold: each file's
    content for local files, the dataset's spec for the hub (its content is not local) and for
    synthetic tokens."""
    if cfg.source in ("text", "shakespeare"):
        files = expand_files(cfg.files) if cfg.source == "text" else shakespeare_files()
        spec: object = _content_sha256s(files)
        name = "data.files content" if cfg.source == "text" else "the bundled plays' content"
    elif cfg.source == "hub":
        spec, name = OmegaConf.to_container(cfg.hub, resolve=True), "data.hub"
    else:
        spec, name = {"vocab_size": cfg.vocab_size}, "data.vocab_size"
    return name, hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _content_sha256s(files: list[Path]) -> list[str]:
    digests = []
    for path in files:
        try:
            digests.append(content_sha256(path))
        except OSError as e:
            raise unreadable(path, e) from e
    return digests


def corpus_identity(cfg: DictConfig) -> dict[str, str]:
    """The corpus `cfg` (cfg.data) names: {sources, sha256, tokenizer, dtype}."""
    name, digest = _sources(cfg)
    return {"sources": name, "sha256": digest, "tokenizer": TOKENIZER, "dtype": TOKEN_DTYPE}


def check_corpus(saved: dict[str, str] | None, current: dict[str, str]) -> None:
    """Refuses a resume whose corpus differs from the checkpoint's, naming what changed. A
    checkpoint that records none (written by an older version) is not checked."""
    if saved is None:
        return
    for key, what in (("sha256", current["sources"]), ("tokenizer", "the tokenizer"),
                      ("dtype", "the token dtype")):  # fmt: skip
        old, new = saved.get(key), current[key]
        if old != new:
            raise ConfigError(
                f"the corpus changed since the checkpoint: {what} differs ({key} "
                f"{_short(key, old)} -> {_short(key, new)}); resume with the original files or "
                "start a new run"
            )


def _short(key: str, value: object) -> str:
    return f"{value[:12]}…" if key == "sha256" and isinstance(value, str) else repr(value)
