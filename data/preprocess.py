"""The book's deliberately CPU-heavy per-sample text pipeline: lower-casing, regex cleaning and
random word deletion/swap. It makes the input pipeline a real bottleneck, the situation in which
DataLoader workers and non-blocking copies pay off (the speed ladder's stages 2 and 3)."""

from __future__ import annotations

import re

import numpy as np
from omegaconf import DictConfig

_MARKUP = re.compile(r"[^\w\s'.,;:!?\-\x1e]")  # anything but words, spaces and punctuation
_SPACES = re.compile(r"[ \t]{2,}")


def clean(text: str) -> str:
    """Lower-cases and strips markup."""
    return _SPACES.sub(" ", _MARKUP.sub(" ", text.lower()))


def preprocess(text: str, cfg: DictConfig, rng: np.random.Generator) -> str:
    """Cleans `text`, then drops each word with probability `cfg.word_drop` and swaps it with
    its right neighbour with probability `cfg.word_swap`. The cleaning runs `cfg.repeat` times
    on the raw text, the same work each time: a dial for the CPU cost per sample."""
    cleaned = text
    for _ in range(max(1, cfg.repeat)):
        cleaned = clean(text)
    words = cleaned.split(" ")
    keep = rng.random(len(words)) >= cfg.word_drop
    words = [w for w, k in zip(words, keep, strict=True) if k]
    for i in np.flatnonzero(rng.random(len(words)) < cfg.word_swap):
        if i + 1 < len(words):
            words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)
